"""``kvfabric demo --kv-events`` as a user runs it, next to ``kvfabric demo`` on the same workload and seed: vLLM's
real scheduler, its real ``ZmqEventPublisher`` in place of the plugin, a real collector subscribed with
``--kv-events``, a real DuckDB file. The evictions and rebuilt-from-eviction the two sources report must be equal,
block for block, and equal to what vLLM's pool itself reported in the harness."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import duckdb
import pytest

from kvfabric.queries import availability as A

pytestmark = pytest.mark.vllm


def _demo(cwd: Path, run_id: str, *args: str, env: dict[str, str] | None = None) -> tuple[dict[str, Any], str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVFABRIC_")}
    proc = subprocess.run(
        [sys.executable, "-m", "kvfabric.cli", "demo", "--json", "--port", "0", "--seed", "0", "--run-id", run_id,
         "--db", str(cwd / f"{run_id}.duckdb"), "--parquet", str(cwd / f"{run_id}-parquet"), *args],
        cwd=cwd, env={**base, **(env or {})}, capture_output=True, text=True, timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [line] = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    return json.loads(line), proc.stdout


def _rows(db: Path, sql: str, run_id: str) -> list[tuple]:
    con = duckdb.connect(str(db), read_only=True)
    try:
        return con.execute(sql, [run_id]).fetchall()
    finally:
        con.close()


@pytest.fixture(scope="module")
def both(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    cwd = tmp_path_factory.mktemp("demo-kv-events")
    plugin, plugin_out = _demo(cwd, "demo-plugin")
    kv, kv_out = _demo(cwd, "demo-kv", "--kv-events")
    return {"cwd": cwd, "plugin": plugin, "kv": kv, "plugin_out": plugin_out, "kv_out": kv_out}


def test_evictions_and_rebuilds_equal_the_plugins(both: dict[str, Any]) -> None:
    p, k = both["plugin"]["summary"], both["kv"]["summary"]
    engine = both["kv"]["stats"]["engine"]
    assert p["evicted_blocks"] > 0 and p["rebuilt_from_eviction_blocks"] > 0
    assert k["evicted_blocks"] == p["evicted_blocks"] == engine["evicted_blocks"]
    assert k["rebuilt_from_eviction_blocks"] == p["rebuilt_from_eviction_blocks"] == engine["rebuilt_blocks"]
    assert k["wasted_prefill_tokens"] == p["wasted_prefill_tokens"]
    # Every block vLLM announced reached the collector, and nothing was lost on the way.
    published = both["kv"]["stats"]["published"]
    assert k["events_by_type"]["block_sealed"] == published["stored_blocks"]
    assert k["events_by_type"]["block_evicted"] == published["removed_blocks"]
    assert k["sequence_gaps"] == 0 and k["sink_dropped_events"] == 0


def test_the_same_blocks_are_evicted_and_rebuilt(both: dict[str, Any]) -> None:
    cwd = both["cwd"]
    # (The demo's requests carry family hints, which the plugin follows and these events cannot know: families are
    # compared where there are none, in test_side_by_side.py.)
    by_block = ("SELECT event, block_hash, count(*) FROM events WHERE run_id = ? "
                "AND event IN ('block_evicted', 'block_rebuilt') GROUP BY ALL ORDER BY ALL")
    plugin = _rows(cwd / "demo-plugin.duckdb", by_block, "demo-plugin")
    kv = _rows(cwd / "demo-kv.duckdb", by_block, "demo-kv")
    assert plugin and kv == plugin  # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0: the plugin's digests


def test_the_report_marks_what_kv_events_cannot_tell(both: dict[str, Any]) -> None:
    k, out = both["kv"]["summary"], both["kv_out"]
    assert k["sources"] == ["kv_events"] and k["prefix_hit_rate"] is None and k["requests"] is None
    assert set(k["unavailable"]) == set(A.SUMMARY_LOOKUP_FIELDS)
    assert f"prefix hit rate               {A.NO_LOOKUPS}" in out
    assert f"regretful evictions           {A.NO_LOOKUPS}" in out
    assert f"evicted blocks                {k['evicted_blocks']:,}" in out
    assert f"n/a: {A.NO_LOOKUPS}" in out  # the families table
    # The plugin's report has every number (the hit rate among them) and no such line.
    assert A.NO_LOOKUPS not in both["plugin_out"]
    assert both["plugin"]["summary"]["prefix_hit_rate"] > 0


def test_a_policy_or_a_lake_with_kv_events_is_refused_in_one_line(tmp_path: Path) -> None:
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVFABRIC_")}
    for args, words in ((["--policy", "family_protect"], "by its own LRU"),
                        (["--lake", "x.ducklake", "--data", "lake-data"], "writes a DuckDB file")):
        proc = subprocess.run([sys.executable, "-m", "kvfabric.cli", "demo", "--kv-events", *args], cwd=tmp_path,
                              env=base, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and words in proc.stderr, proc.stderr
        assert proc.stdout == ""
    assert list(tmp_path.iterdir()) == []
