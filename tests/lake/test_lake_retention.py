"""Retention and compaction on a lake (PostgreSQL catalog, local data folder): whole ``day`` partitions before the
cutoff are dropped and, once no snapshot needs them, their Parquet files leave the data folder; small files are
merged; rows younger than the cutoff survive while another collector keeps committing to the same lake; streams
silent past the cutoff go; ``--retain 0`` keeps everything."""

from __future__ import annotations

import datetime as dt
import glob
import os
import threading
import time
from typing import Any

import httpx
import pyarrow as pa
import pytest
from support.collector_testkit import collector_files, meta, send_stream, wait_until
from support.lake_testkit import LakeLocation as KitLocation

from kvfabric.collector import CollectorProcess
from kvfabric.contract import schema as S
from kvfabric.ingest.backend import NS_PER_DAY, Backend
from kvfabric.ingest.retention import SNAPSHOT_KEEP_S, Retention
from kvfabric.lake import LakeLocation

pytestmark = pytest.mark.timeout(300)

NS = 1_000_000_000


def rows_batch(seq: int, n: int, ts0: int, run_id: str, step_ns: int = 1) -> pa.RecordBatch:
    cols: dict[str, pa.Array] = {
        "seq": pa.array([seq] * n, pa.int64()),
        "ts_ns": pa.array([ts0 + i * step_ns for i in range(n)], pa.int64()),
        "engine": pa.array(["e0"] * n, pa.string()),
        "run_id": pa.array([run_id] * n, pa.string()),
        "event": pa.array([S.BLOCK_TOUCHED] * n, pa.string()),
        "block_id": pa.array(range(n), pa.int32()),
    }
    return pa.RecordBatch.from_arrays([cols.get(f.name, pa.nulls(n, f.type)) for f in S.EVENT_SCHEMA],
                                      schema=S.EVENT_SCHEMA)


def day_of(ts_ns: int) -> str:
    return (dt.date(1970, 1, 1) + dt.timedelta(days=ts_ns // NS_PER_DAY)).isoformat()


def parquet_files(data: str, day: str, run_id: str = "*") -> list[str]:
    """The Parquet files of ``events`` in partition (``run_id``, ``day``) on disk (referenced or not)."""
    return glob.glob(f"{data}**/run_id={run_id}/*/day={day}/*.parquet", recursive=True)


def live_files(con: Any, day: str, run_id: str) -> int:
    """Data files of ``events`` in partition (``run_id``, ``day``) that the current snapshot references."""
    return len({p for (p,) in con.execute("SELECT data_file FROM ducklake_list_files('lake', 'events')").fetchall()
                if f"run_id={run_id}/" in p and f"day={day}/" in p})


def runs(url: str) -> dict[str, int]:
    return {r["run_id"]: r["events"] for r in httpx.get(url + "/api/v1/runs", timeout=10).json()}


class Steady:
    """Sends a batch of ``rows`` events stamped now every ``every`` seconds on one stream; remembers each ts."""

    def __init__(self, socket_path: str, rows: int = 500, every: float = 0.2) -> None:
        self.socket_path, self.rows, self.every = socket_path, rows, every
        self.ts: list[int] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            seq = 0
            while not self._stop.is_set():
                t0 = time.time_ns()
                send_stream(self.socket_path, meta("steady", "steady", "e0"),
                            [rows_batch(seq, self.rows, t0, "steady", step_ns=1000)])
                self.ts.extend(t0 + i * 1000 for i in range(self.rows))
                seq += 1
                self._stop.wait(self.every)
        except BaseException as e:
            self.error = e

    def start(self) -> Steady:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        assert self.error is None, self.error


@pytest.mark.parametrize("lake_location", ["local"], indirect=True)
def test_lake_retention_drops_old_days_merges_small_files_and_keeps_young_rows(lake_location: KitLocation) -> None:
    now = time.time_ns()
    old_ts = now - 3 * NS_PER_DAY
    future_ts = now + 600 * NS  # young for the whole test: must survive every retention run
    old_day, future_day = day_of(old_ts), day_of(future_ts)
    data = lake_location.data
    with collector_files() as fa, collector_files() as fb:
        def process(f: Any, **kw: Any) -> CollectorProcess:
            config = f.config(lake=lake_location.catalog, data=data, coalesce_ms=50, **kw)
            return CollectorProcess(config, log_path=f.log_path, ready_timeout=60.0)

        # Phase 1: no maintenance yet. Three-day-old rows, and eight separate small commits of young rows.
        with process(fa, retain_s=0, maintenance_interval_s=3600) as a:
            url = a.http_url
            assert url is not None
            send_stream(fa.socket_path, meta("old", "old", "e0"), [rows_batch(0, 5000, old_ts, "old")])
            for i in range(8):
                send_stream(fa.socket_path, meta(f"young{i}", "young", "e0"),
                            [rows_batch(0, 2000, future_ts + i * 2000, "young")])
                wait_until(lambda i=i: runs(url).get("young") == 2000 * (i + 1), timeout=30, what=f"commit {i}")
            wait_until(lambda: runs(url).get("old") == 5000, timeout=30, what="old rows committed")
            con = lake_location.connect()
            try:  # counted while A runs: its shutdown CHECKPOINT (DuckLake's own maintenance) merges them too
                assert live_files(con, future_day, "young") >= 8, "eight commits, eight small files"
            finally:
                con.close()
        old_files = parquet_files(data, old_day)
        assert old_files, "the old rows are in Parquet files of their own day partition"

        # Phase 2: A retains 3 s (snapshots kept as long: min(1 h, retain)); B keeps everything but compacts too,
        # and takes a steady stream of rows stamped now while A deletes and both merge.
        with process(fa, retain_s=3, maintenance_interval_s=1) as a, \
                process(fb, retain_s=0, maintenance_interval_s=1) as b:
            url_b = b.http_url
            assert url_b is not None
            steady = Steady(fb.socket_path).start()
            try:
                wait_until(lambda: not any(os.path.exists(p) for p in old_files), timeout=60,
                           what="the old day's Parquet files removed from the data folder")
                wait_until(lambda: not parquet_files(data, old_day), timeout=30, what="no file of the old day left")

                def merged() -> bool:
                    c = lake_location.connect()
                    try:
                        return live_files(c, future_day, "young") == 1
                    finally:
                        c.close()

                wait_until(merged, timeout=60, what="the young day's small files merged into one")
                time.sleep(6)  # more rounds of deletes and merges while B commits
            finally:
                steady.stop()
            sent = len(steady.ts)
            wait_until(lambda: runs(url_b).get("steady") == sent, timeout=60, what="B committed the steady rows")
            stop_began = time.time_ns()
            a.stop()
            stopped = time.time_ns()
        con = lake_location.connect()
        try:
            ts = [r[0] for r in con.execute("SELECT ts_ns FROM lake.events WHERE run_id = 'steady'").fetchall()]
            young = con.execute("SELECT count(*) FROM lake.events WHERE run_id = 'young'").fetchone()[0]
            old = con.execute("SELECT count(*) FROM lake.events WHERE run_id = 'old'").fetchone()[0]
            streams = {r[0] for r in con.execute("SELECT stream_id FROM lake.streams").fetchall()}
            steady_log_rows = con.execute(
                "SELECT count(*) FROM lake.stream_log WHERE stream_id = 'steady'").fetchone()[0]
            remaining_future_files = len(parquet_files(data, future_day, "young"))
        finally:
            con.close()
    assert old == 0 and "old" not in streams
    assert young == 16_000, "rows younger than the cutoff are never lost to deletes or merges"
    # Every cutoff A used was <= stopped - 3 s: every row stamped after that is stored, exactly once.
    cutoff_bound = stopped - 3 * NS
    expected = sorted(t for t in steady.ts if t >= cutoff_bound)
    assert sorted(t for t in ts if t >= cutoff_bound) == expected
    assert len(expected) > 0
    # A ran at least once a second until it stopped: rows older than its last cutoffs are gone.
    assert not [t for t in ts if t < stop_began - 3 * NS - 3 * NS]
    assert "steady" in streams
    # Every commit of B appended a stream_log row for the steady stream; A deletes the superseded ones each run.
    batches = len(steady.ts) // steady.rows
    assert steady_log_rows < max(10, batches // 3), (steady_log_rows, batches)
    assert remaining_future_files <= 3, "merged-away small files are cleaned up once no snapshot needs them"


@pytest.mark.parametrize("lake_location", ["local"], indirect=True)
def test_lake_retention_unit_snapshot_keep_and_retain_zero(lake_location: KitLocation) -> None:
    """Retention itself on the writer's kind of connection: dropped partitions stay on disk while a snapshot may
    still read them, go once expired; ``retain_s`` 0 deletes nothing; the default keep follows the retention."""
    assert Retention(lake=True, retain_s=60).snapshot_keep_s == 60
    assert Retention(lake=True, retain_s=0).snapshot_keep_s == SNAPSHOT_KEEP_S
    assert Retention(lake=True, retain_s=7 * 86400).snapshot_keep_s == SNAPSHOT_KEEP_S
    con = Backend("", LakeLocation.parse(lake_location.catalog, lake_location.data)).open()
    try:
        now = time.time_ns()
        old_ts = now - 3 * NS_PER_DAY
        insert = ("INSERT INTO events (seq, ts_ns, event, run_id, engine, day) SELECT 0, x, 'block_touched', 'r', "
                  "'e0', DATE '1970-01-01' + (x // ?)::INTEGER FROM unnest(?::BIGINT[]) t(x)")
        con.execute(insert, [NS_PER_DAY, [old_ts + i for i in range(3000)]])
        for k in range(4):
            con.execute(insert, [NS_PER_DAY, [now + k * 10_000 + i for i in range(2000)]])
        data = lake_location.data
        assert parquet_files(data, day_of(old_ts)) and live_files(con, day_of(now), "r") == 4

        report = Retention(lake=True, retain_s=0)(con)
        assert report.deleted_events == 0
        assert con.execute("SELECT count(*) FROM events").fetchone() == (11_000,)
        assert live_files(con, day_of(now), "r") == 1, "retain 0 still merges small files"

        report = Retention(lake=True, retain_s=3600, snapshot_keep_s=3600)(con)
        assert report.deleted_events == 3000
        assert con.execute("SELECT count(*) FROM events").fetchone() == (8_000,)
        assert parquet_files(data, day_of(old_ts)), "a snapshot younger than the keep still needs the old files"
        assert len(parquet_files(data, day_of(now))) == 5, "nor are the merged-away small files removed yet"

        # A run expires the snapshots older than the keep (their files become scheduled for deletion); the files
        # leave the folder once scheduled longer than the keep too: at the next run.
        short = Retention(lake=True, retain_s=3600, snapshot_keep_s=0.1)
        time.sleep(0.2)
        assert short(con).deleted_events == 0
        time.sleep(0.2)
        assert short(con).deleted_events == 0
        assert not parquet_files(data, day_of(old_ts)), "the dropped day's files left the data folder"
        assert len(parquet_files(data, day_of(now))) == 1
        assert con.execute("SELECT count(*) FROM events").fetchone() == (8_000,)
    finally:
        con.close()
