"""``kvfabric demo --lake CATALOG --data PATH``: the demo's collector writes the run to the lake (PostgreSQL catalog,
moto S3) instead of ``./kvfabric.duckdb``, and what the lake holds is what the engine emitted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.lake_testkit import LakeLocation as KitLocation

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]


@pytest.mark.parametrize("lake_location", ["s3"], indirect=True)
def test_the_demo_writes_its_run_to_the_lake(lake_location: KitLocation, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFABRIC_")} | lake_location.env
    proc = subprocess.run(
        [sys.executable, "-m", "kvfabric.cli", "demo", "--lake", lake_location.catalog, "--data", lake_location.data,
         "--port", "0", "--run-id", "demo-lake", "--json"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not (tmp_path / "kvfabric.duckdb").exists()  # the lake, not the default file
    report = json.loads(proc.stdout.strip().splitlines()[-3])  # (--json's line, before "Done" and "API")
    stats, summary = report["stats"], report["summary"]
    assert stats["events_lost"] == 0 and stats["rows_sent"] == stats["events_emitted"] > 10_000
    assert sum(report["parquet_counts"].values()) == stats["rows_sent"] == summary["events"]

    fleet = subprocess.run(
        [sys.executable, "-m", "kvfabric.cli", "fleet", "--lake", lake_location.catalog, "--data",
         lake_location.data, "--format", "json"], env=env, capture_output=True, text=True, timeout=120)
    assert fleet.returncode == 0, fleet.stderr
    engines = json.loads(fleet.stdout)["engines"]
    assert len(engines) == 1 and engines[0]["events"] == stats["rows_sent"]
    assert engines[0]["requests"] == summary["requests"] and engines[0]["hit_tokens"] == summary["prefix_hit_tokens"]
