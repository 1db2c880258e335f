"""``kvfabric demo --serve`` end to end, as a user runs it: a real collector process, vLLM's real scheduler, the
plugin loaded through vLLM's entry points, REST, Parquet; the numbers must agree everywhere."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
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

        # The collector serving now is the one that ingested: /metrics has this run's analytics counters, equal to
        # the report's numbers (a restarted collector would have none).
        metrics = _samples(httpx.get(f"{api}/metrics", timeout=10).text, run="demo-test")
        assert metrics["kvfabric_events_total"] == stats["rows_sent"]
        assert metrics["kvfabric_prompt_tokens_total"] == summary["prompt_tokens"]
        assert metrics["kvfabric_prefix_hit_tokens_total"] == summary["prefix_hit_tokens"]
        assert metrics["kvfabric_evicted_blocks_total"] == summary["evicted_blocks"]
        assert metrics["kvfabric_rebuilt_blocks_total"] == summary["rebuilt_from_eviction_blocks"]
        assert metrics["kvfabric_wasted_prefill_tokens_total"] == summary["wasted_prefill_tokens"]

        # /docs works offline: Swagger UI from the package, no URL off this server.
        docs = httpx.get(f"{api}/docs", timeout=10)
        assert docs.status_code == 200 and "swagger-ui" in docs.text
        urls = re.findall(r'(?:src|href)="([^"]+)"|url: \'([^\']+)\'', docs.text)
        urls = [a or b for a, b in urls]
        assert urls and not [u for u in urls if "://" in u or u.startswith("//")], urls
        for u in urls:
            assert httpx.get(f"{api}{u}", timeout=10).status_code == 200, u
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


def _samples(text: str, run: str) -> dict[str, float]:
    """Prometheus text -> {metric name: sum of its samples labelled ``run``}."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("run") == run:
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def _demo(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFABRIC_")}
    return subprocess.run([sys.executable, "-m", "kvfabric.cli", "demo", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)


def test_bad_values_are_refused_in_one_line_and_leave_nothing(tmp_path: Path) -> None:
    before = set(Path(tempfile.gettempdir()).glob("kvfabric-demo-*"))
    for args, words in ((["--port", "99999"], "--port"), (["--num-blocks", "0"], "--num-blocks"),
                        (["--num-blocks", "50"], "needs 95 blocks")):
        proc = _demo(tmp_path, *args)
        assert proc.returncode == 2, (args, proc.stderr)
        assert proc.stderr.startswith("kvfabric demo: ") and proc.stderr.count("\n") == 1, proc.stderr
        assert words in proc.stderr and proc.stdout == ""
    # A port asked for that another program listens on: refused, named (the default port would move instead).
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = _demo(tmp_path, "--port", str(port))
    assert proc.returncode == 2 and f"127.0.0.1:{port} is in use" in proc.stderr
    assert set(Path(tempfile.gettempdir()).glob("kvfabric-demo-*")) == before
    assert list(tmp_path.iterdir()) == []


def test_the_default_port_in_time_wait_is_free() -> None:
    from kvfabric.demo import choose_port

    # A port whose last connection was closed by the server side sits in TIME-WAIT: the collector (SO_REUSEADDR)
    # can listen there again, so the demo keeps it rather than moving to a random port.
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = server.accept()
        conn.close()  # the server side closes first: its end goes to TIME-WAIT
        client.close()
    assert choose_port(port) == (port, None)
