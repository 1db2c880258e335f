"""Retention on the DuckDB file, end to end with real collector processes (``--retain``, ``--maintenance-interval``):
events older than the cutoff and streams silent since then are deleted, younger ones stay, and the file stops
growing once retention runs (DuckDB reuses the blocks freed by a CHECKPOINT); ``--retain 0`` keeps everything."""

from __future__ import annotations

import time

import duckdb
import httpx
import pyarrow as pa
import pytest
from support.collector_testkit import collector_files, meta, send_stream, wait_until

from kvfabric.contract import schema as S
from kvfabric.ingest.store import db_size_bytes

pytestmark = pytest.mark.timeout(240)

NS = 1_000_000_000
DAY_NS = 86_400 * NS
ROUND_ROWS = 150_000  # per round: large enough that the file would grow by megabytes per round without retention
BATCH_ROWS = 15_000
ROUNDS = 7
GROWTH_TOLERANCE = 1.25  # every size from round 3 on <= 1.25 x the largest of rounds 1-2 (+ 1 MiB of block slack)
SLACK_BYTES = 1 << 20


def evicted_batch(seq: int, n: int, ts0: int, run_id: str, engine: str = "e0") -> pa.RecordBatch:
    """``n`` block_evicted rows stamped ``ts0``, ``ts0 + 1``, ... (run summaries count them: evicted_blocks)."""
    cols: dict[str, pa.Array] = {
        "seq": pa.array([seq] * n, pa.int64()),
        "ts_ns": pa.array(range(ts0, ts0 + n), pa.int64()),
        "engine": pa.array([engine] * n, pa.string()),
        "run_id": pa.array([run_id] * n, pa.string()),
        "event": pa.array([S.BLOCK_EVICTED] * n, pa.string()),
        "block_id": pa.array(range(n), pa.int32()),
        "block_hash": pa.array([(seq << 32) + i for i in range(n)], pa.int64()),
        "request_id": pa.array([f"req-{seq}-{i % 997}" for i in range(n)], pa.string()),
    }
    arrays = [cols.get(f.name, pa.nulls(n, f.type)) for f in S.EVENT_SCHEMA]
    return pa.RecordBatch.from_arrays(arrays, schema=S.EVENT_SCHEMA)


def runs(url: str) -> dict[str, int]:
    """run_id -> events the streams table accounts for (runs disappear when all their streams are deleted)."""
    return {r["run_id"]: r["events"] for r in httpx.get(url + "/api/v1/runs", timeout=10).json()}


def evicted_stored(url: str, run_id: str) -> int:
    """block_evicted rows of ``run_id`` in the events table now (the summary scans the events)."""
    return int(httpx.get(f"{url}/api/v1/runs/{run_id}/summary", timeout=10).json()["evicted_blocks"])


def test_file_retention_expires_old_rows_and_streams_and_the_file_stays_flat() -> None:
    sizes: list[int] = []
    live_sent = 0
    with collector_files() as f:
        with f.process(retain_s=2, maintenance_interval_s=1) as proc:
            url = proc.http_url
            assert url is not None
            for k in range(ROUNDS):
                now = time.time_ns()
                send_stream(f.socket_path, meta(f"s{k}", f"r{k}", "e0"),
                            [evicted_batch(seq, BATCH_ROWS, now + seq * BATCH_ROWS, f"r{k}")
                             for seq in range(ROUND_ROWS // BATCH_ROWS)])
                # One long-lived stream (a batch per round): its old rows go, its newest stay.
                send_stream(f.socket_path, meta("live", "live", "e0"), [evicted_batch(k, 1000, time.time_ns(), "live")])
                live_sent += 1000
                wait_until(lambda k=k, n=live_sent: runs(url).get(f"r{k}") == ROUND_ROWS and runs(url).get("live") == n,
                           timeout=60, what=f"round {k} committed")
                live_now = evicted_stored(url, "live")
                assert live_now >= 1000, "the newest rows of a live stream (younger than the cutoff) must stay"
                if k >= 3:
                    assert live_now < live_sent, "rows of the live stream older than the cutoff must go"
                # The round's stream goes silent now: > 2 s later it is deleted, and its events (stamped before
                # it was received) with it or before it.
                wait_until(lambda k=k: f"r{k}" not in runs(url), timeout=30, what=f"r{k} expired")
                time.sleep(1.5)  # one more maintenance run: its CHECKPOINT folds the WAL into the file
                sizes.append(db_size_bytes(f.db_path))
        con = duckdb.connect(f.db_path, read_only=True)
        try:
            per_run = dict(con.execute("SELECT run_id, count(*) FROM events GROUP BY run_id").fetchall())
            streams = {r[0] for r in con.execute("SELECT stream_id FROM streams").fetchall()}
        finally:
            con.close()
    print(f"file size after each round (bytes): {sizes}")
    for k in range(ROUNDS - 1):
        assert per_run.get(f"r{k}", 0) == 0, f"round {k}'s rows are past the cutoff but still stored"
        assert f"s{k}" not in streams
    assert per_run.get("live", 0) < live_sent
    # Flat: measured each time after the round's rows expired, so the file holds ~nothing but its high-water mark;
    # freed blocks are reused, so it does not grow with the rounds. Without retention it would grow by one round's
    # bytes per round (ROUNDS x the round-1 size by the end); the bound is well under that.
    bound = max(sizes[:2]) * GROWTH_TOLERANCE + SLACK_BYTES
    assert all(s <= bound for s in sizes[2:]), (sizes, bound)
    assert sizes[-1] < sizes[0] * ROUNDS / 2, sizes

def test_retain_zero_keeps_everything() -> None:
    now = time.time_ns()
    with collector_files() as f:
        with f.process(retain_s=0, maintenance_interval_s=1) as proc:
            url = proc.http_url
            assert url is not None
            send_stream(f.socket_path, meta("old", "old", "e0"), [evicted_batch(0, 5000, now - 30 * DAY_NS, "old")])
            send_stream(f.socket_path, meta("new", "new", "e0"), [evicted_batch(0, 5000, now, "new")])
            wait_until(lambda: runs(url) == {"old": 5000, "new": 5000}, timeout=30, what="both committed")
            time.sleep(3.5)  # three maintenance runs (CHECKPOINT only)
            assert evicted_stored(url, "old") == 5000
            assert evicted_stored(url, "new") == 5000
        con = duckdb.connect(f.db_path, read_only=True)
        try:
            assert con.execute("SELECT count(*) FROM events").fetchone() == (10_000,)
            assert con.execute("SELECT count(*) FROM streams").fetchone() == (2,)
        finally:
            con.close()
