"""Stream identity: metadata ``kvfabric.source`` (absent = ``plugin``) reaches ``streams.source``; an unknown source is
refused; files and lakes written before the column existed get it in place, ``plugin`` on every older row."""

from __future__ import annotations

from pathlib import Path

import duckdb
import httpx
import pytest
from support.collector_testkit import batch, collector_files, meta, send_stream, wait_until

from kvfabric.contract import schema as S
from kvfabric.ingest.backend import Backend
from kvfabric.ingest.errors import BadStream
from kvfabric.ingest.store import STREAMS_SCHEMA, load_streams, open_database
from kvfabric.ingest.validate import parse_stream_meta
from kvfabric.lake import LakeLocation


def test_the_source_is_read_from_the_metadata_and_refused_when_unknown() -> None:
    assert parse_stream_meta(S.stream_schema(meta("s", "r", "e"))).source == "plugin"
    kv = meta("s", "r", "e") | {S.META_SOURCE: "kv_events"}
    assert parse_stream_meta(S.stream_schema(kv)).source == "kv_events"
    with pytest.raises(BadStream, match=r"kvfabric\.source='carrier_pigeon'"):
        parse_stream_meta(S.stream_schema(meta("s", "r", "e") | {S.META_SOURCE: "carrier_pigeon"}))


def test_a_collector_stores_each_streams_source() -> None:
    with collector_files() as files:
        with files.process():
            send_stream(files.socket_path, meta("plug", "r", "e0"), [batch([{"ts_ns": 1, "event": "cache_reset"}], 0)])
            send_stream(files.socket_path, meta("kv", "r", "e1") | {S.META_SOURCE: "kv_events"},
                        [batch([{"ts_ns": 2, "event": "cache_reset"}], 0)])
            wait_until(lambda: sum(r["events"] for r in httpx.get(files.http_url + "/api/v1/runs").json()) == 2, 10,
                       "both committed")
        with duckdb.connect(files.db_path, read_only=True) as con:
            assert con.execute("SELECT stream_id, source FROM streams ORDER BY stream_id").fetchall() == [
                ("kv", "kv_events"), ("plug", "plugin")]


@pytest.mark.parametrize("backend", ["file", "lake"])
def test_older_stores_gain_the_source_column_in_place(tmp_path: Path, backend: str) -> None:
    if backend == "file":
        b = Backend(str(tmp_path / "old.duckdb"))
        table = "streams"
    else:
        b = Backend("", LakeLocation.parse(str(tmp_path / "catalog.duckdb"), str(tmp_path / "data")))
        table = "stream_log"
    con = b.open()
    con.execute(f"ALTER TABLE {table} DROP COLUMN source")  # as a collector of the previous release left it
    con.execute(f"INSERT INTO {table} (stream_id, run_id, engine, block_size, num_blocks, policy, schema_version, "
                "peer, first_seen_ns, last_seen_ns, connections, batches, rows, last_seq, gaps, seq_resets, "
                "duplicates, refused_batches, refused_rows) "
                "VALUES ('old', 'r', 'e', 16, 10, 'lru', 3, 'p', 1, 2, 1, 0, 0, -1, 0, 0, 0, 0, 0)")
    con.close()
    con = b.open()
    try:
        assert [r[0] for r in con.execute("DESCRIBE streams").fetchall()] == [f.name for f in STREAMS_SCHEMA]
        assert load_streams(con)["old"].source == "plugin"
    finally:
        con.close()
    if backend == "file":
        open_database(b.db_path).close()  # (opening it again changes nothing)
