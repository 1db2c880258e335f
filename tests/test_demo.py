"""``kvfabric demo --serve`` end to end, as a user runs it: a real collector process, vLLM's real scheduler, the
plugin loaded through vLLM's entry points, REST, Parquet; the numbers must agree everywhere."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import httpx
import pytest

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "kill"])
def test_demo_report_rest_parquet_and_engine_agree(tmp_path: Path, stop: signal.Signals) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFABRIC_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvfabric.cli", "demo", "--serve", "--json", "--port", "0", "--run-id", "demo-test"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        # Ctrl-C as at a terminal: a suite started in the background (nohup, `&`) passes SIGINT down ignored, and
        # Python then never raises KeyboardInterrupt (the demo would sit there until killed, its collector orphaned).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    out: list[str] = []
    report: dict = {}
    api = ""
    deadline = time.monotonic() + 240
    try:
        assert proc.stdout is not None
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            out.append(line)
            if line.startswith("{"):
                report = json.loads(line)
            if line.startswith("API: http"):
                api = line.split()[1].rsplit("/api/v1/", 1)[0]
                break
        assert api, "demo did not come up:\n" + "".join(out[-40:])
        text = "".join(out)
        summary, stats = report["summary"], report["stats"]
        engine = stats["engine"]

        # The printed report is the REST summary, which the served API still returns, field for field.
        served = httpx.get(f"{api}/api/v1/runs/demo-test/summary", timeout=10).json()
        for key in ("prompt_tokens", "prefix_hit_tokens", "evicted_blocks", "rebuilt_from_eviction_blocks",
                    "wasted_prefill_tokens", "regretful_evictions", "shared_anchor_eviction_ratio"):
            assert served[key] == summary[key], key
        assert f"evicted blocks                {summary['evicted_blocks']:,}" in text
        assert f"wasted prefill tokens         {summary['wasted_prefill_tokens']:,}" in text

        # Real pressure, and the collector's numbers equal what vLLM itself observed in the harness.
        assert summary["evicted_blocks"] > 0 and summary["rebuilt_from_eviction_blocks"] > 0
        assert summary["evicted_blocks"] == engine["evicted_blocks"]
        assert summary["rebuilt_from_eviction_blocks"] == engine["rebuilt_blocks"]
        assert summary["prefix_hit_tokens"] == engine["admitted_hit_tokens"]
        assert summary["wasted_prefill_tokens"] == 16 * engine["rebuilt_blocks"]
        assert 0 < summary["shared_anchor_eviction_ratio"] < 1
        assert stats["events_lost"] == 0

        # Parquet read back with DuckDB: the same counts as the database, every triggered event type present.
        counts = report["parquet_counts"]
        assert sum(counts.values()) == stats["rows_sent"] == stats["events_emitted"]
        assert set(counts) >= {"prefix_lookup", "block_allocated", "block_sealed", "block_touched",
                               "ref_count_changed", "block_freed", "block_evicted", "block_rebuilt"}
        parquet = tmp_path / "kvfabric-parquet" / "events"
        assert any(p.name == "run_id=demo-test" for p in parquet.iterdir())
    finally:
        proc.send_signal(stop)  # either way the demo stops its collector (which flushes) before it exits
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, "the demo did not stop on the signal by itself"
    # The database (after the collector's SIGTERM flush) holds exactly what Parquet held.
    con = duckdb.connect(str(tmp_path / "kvfabric.duckdb"), read_only=True)
    try:
        rows = dict(con.execute(
            "SELECT event, count(*) FROM events WHERE run_id = 'demo-test' GROUP BY 1").fetchall())
    finally:
        con.close()
    assert rows == counts
