"""The lake kit (:mod:`support.lake_testkit`) with DuckDB 1.5.5 and the extension wheels, offline: a DuckLake catalogued
in a throwaway PostgreSQL with its Parquet data in a local folder and on moto's S3 takes a two-table transaction
that a second connection (and a child process given only ``lake_location.env``) reads back, and survives its
catalog going away and coming back."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import duckdb
import httpx
import pytest
from support import lake_testkit
from support.lake_testkit import (
    LakeKitError,
    LakeLocation,
    MotoS3,
    PostgresServer,
    extension_path,
    load_lake_extensions,
)


def _data_files(loc: LakeLocation) -> list[str]:
    """The Parquet files under the lake's DATA_PATH (so a test knows the rows left the catalog: DuckLake inlines
    small inserts into the catalog database)."""
    if loc.kind == "local":
        return sorted(str(p) for p in Path(loc.data).rglob("*.parquet"))
    assert loc.s3 is not None
    bucket, _, prefix = loc.data.removeprefix("s3://").partition("/")
    listing = httpx.get(f"{loc.s3.url}/{bucket}", params={"list-type": "2", "prefix": prefix}, timeout=10)
    assert listing.status_code == 200, listing.text
    return sorted(k for k in re.findall(r"<Key>([^<]+)</Key>", listing.text) if k.endswith(".parquet"))


def test_extensions_load_from_their_wheels() -> None:
    assert duckdb.__version__ == "1.5.5"
    con = duckdb.connect(config={"autoinstall_known_extensions": False})
    for name in lake_testkit.LAKE_EXTENSIONS:
        path = extension_path(name)
        assert path.parts[-4:] == (f"duckdb_extension_{name}", "extensions", "v1.5.5", f"{name}.duckdb_extension")
    load_lake_extensions(con)
    loaded = {r[0] for r in con.execute("SELECT extension_name FROM duckdb_extensions() WHERE loaded").fetchall()}
    assert {"ducklake", "postgres_scanner", "httpfs"} <= loaded


def test_two_table_transaction_is_one_snapshot_that_a_second_connection_reads(lake_location: LakeLocation) -> None:
    loc = lake_location
    first = loc.connect()
    first.execute("CREATE TABLE lake.runs (run VARCHAR, engine VARCHAR)")
    first.execute("CREATE TABLE lake.events (run VARCHAR, seq BIGINT, kind VARCHAR)")
    before = first.execute("SELECT count(*) FROM ducklake_snapshots('lake')").fetchone()[0]
    first.execute("BEGIN")
    first.execute("INSERT INTO lake.runs VALUES ('r1', 'vllm')")
    first.execute("INSERT INTO lake.events SELECT 'r1', i, 'stored' FROM range(1000) t(i)")
    first.execute("COMMIT")
    assert first.execute("SELECT count(*) FROM ducklake_snapshots('lake')").fetchone()[0] == before + 1
    first.close()

    second = loc.connect()
    assert second.execute("SELECT * FROM lake.runs").fetchall() == [("r1", "vllm")]
    assert second.execute("SELECT count(*), sum(seq) FROM lake.events").fetchone() == (1000, sum(range(1000)))
    second.execute("INSERT INTO lake.runs VALUES ('r2', 'sim')")
    assert second.execute("SELECT count(*) FROM lake.runs").fetchone()[0] == 2
    second.close()
    assert _data_files(loc), f"no Parquet under {loc.data}: the rows stayed in the catalog"


def test_child_process_reaches_the_lake_with_only_its_env(lake_location: LakeLocation) -> None:
    loc = lake_location
    con = loc.connect()
    con.execute("CREATE TABLE lake.t AS SELECT i FROM range(500) t(i)")
    con.close()
    assert _data_files(loc)
    # no secret in the child: httpfs takes the keys, region, endpoint and TLS switch from the environment; only the
    # URL style has no variable (and "SELECT count(*)" would be answered from the catalog: sum reads the Parquet)
    code = textwrap.dedent(
        f"""
        import duckdb
        from support.lake_testkit import load_lake_extensions
        con = duckdb.connect(config={{"autoinstall_known_extensions": False}})
        load_lake_extensions(con)
        con.execute("SET s3_url_style = 'path'")
        con.execute({loc.attach_sql()!r})
        print(con.execute("SELECT count(*), sum(i) FROM lake.t").fetchone())
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(loc.env, PYTHONPATH=str(Path(lake_testkit.__file__).parent.parent))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str((500, sum(range(500))))
    if loc.kind == "s3":
        assert loc.s3 is not None
        assert loc.env == {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": f"http://{loc.s3.endpoint}",
            "DUCKDB_S3_ENDPOINT": loc.s3.endpoint,
            "DUCKDB_S3_USE_SSL": "false",
        }
    else:
        assert loc.env == {}


@pytest.mark.parametrize("lake_location", ["local"], indirect=True)
def test_catalog_goes_away_and_comes_back(lake_location: LakeLocation, postgres: PostgresServer) -> None:
    con = lake_location.connect()
    con.execute("CREATE TABLE lake.t AS SELECT 1 AS x")
    con.close()
    port = postgres.port
    postgres.stop()
    try:
        assert not postgres.running
        with pytest.raises(duckdb.Error):
            lake_location.connect()
    finally:
        postgres.start()
    assert postgres.running and postgres.port == port
    again = lake_location.connect()
    again.execute("INSERT INTO lake.t VALUES (2)")
    assert again.execute("SELECT list(x ORDER BY x) FROM lake.t").fetchone()[0] == [1, 2]
    again.close()


def test_catalog_string_and_moto_endpoint(postgres: PostgresServer, moto_s3: MotoS3) -> None:
    catalog = postgres.create_database("kit_catalog_string")
    assert catalog == f"postgres:dbname=kit_catalog_string host=127.0.0.1 port={postgres.port} user=postgres"
    assert re.fullmatch(r"127\.0\.0\.1:\d+", moto_s3.endpoint)
    bucket = moto_s3.create_bucket("kit-bucket")
    assert f"<Name>{bucket}</Name>" in httpx.get(moto_s3.url + "/", timeout=10).text


def test_missing_parts_fail_loudly(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(lake_testkit.glob, "glob", lambda pattern: [])
    with pytest.raises(LakeKitError, match=r"apt-get install .*postgresql"):
        lake_testkit.postgres_bin_dir()
    monkeypatch.setattr(lake_testkit.sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(LakeKitError, match=r"moto_server .*pip install"):
        lake_testkit.moto_server_path()
    with pytest.raises(LakeKitError, match="not installed"):
        extension_path("no_such_extension")
