"""End-to-end guarantees of the hook's sink and a real collector process (issue #9 defects 4 and 6, sequence
handling): a collector killed mid-stream loses nothing it acknowledged and, with the sink's replay, nothing at all;
a resent batch is stored once; a late batch is not reported as a gap; a full disk makes the collector unhealthy at
once, holds ingest, recovers when space returns, and never claims a flush it did not do."""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import duckdb
import httpx
import pytest
from support.collector_testkit import (
    CollectorFiles,
    bulk_batches,
    collector_files,
    hook_row,
    hook_sink,
    meta,
    metric,
    scrape,
    send_stream,
    stored,
    wait_until,
)


def _metrics(files: CollectorFiles) -> dict:
    return scrape(httpx.get(files.http_url + "/metrics", timeout=10).text)


class Producer:
    """Appends hook rows to a sink's buffer at a steady rate on a thread (as vLLM's scheduler would)."""

    def __init__(self, sink: object, run_id: str, rate: float = 10_000.0) -> None:
        self.sink = sink
        self.run_id = run_id
        self.rate = rate
        self.emitted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        t0 = time.monotonic()
        append = self.sink.buffer.append  # type: ignore[attr-defined]
        while not self._stop.is_set():
            due = int((time.monotonic() - t0) * self.rate)
            while self.emitted < due:
                append(hook_row(self.emitted, self.run_id, "e0"))
                self.emitted += 1
            time.sleep(0.005)

    def __enter__(self) -> Producer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.emitted


@dataclass
class Stored:
    events: int  # rows other than sink_dropped
    distinct: int  # distinct block ids among them (each emitted row has its own)
    reported_lost: int  # sum of sink_dropped counts
    gaps: int
    duplicates: int


def stored_in(db_path: str, run_id: str) -> Stored:
    with duckdb.connect(db_path, read_only=True) as con:
        events, distinct, lost = con.execute(
            "SELECT count(*) FILTER (WHERE event <> 'sink_dropped'), "
            "count(DISTINCT block_id) FILTER (WHERE event <> 'sink_dropped'), "
            "coalesce(sum(\"count\") FILTER (WHERE event = 'sink_dropped'), 0) FROM events WHERE run_id = ?",
            [run_id],
        ).fetchone()
        gaps, dups = con.execute("SELECT coalesce(sum(gaps), 0), coalesce(sum(duplicates), 0) FROM streams "
                                 "WHERE run_id = ?", [run_id]).fetchone()
    return Stored(events, distinct, lost, gaps, dups)


def test_kill_9_of_the_collector_mid_stream_loses_nothing() -> None:
    """Issue #9 defect 4: ``kill -9`` of the collector mid-stream and a restart lost 2,000 events in 4 of 5 tries,
    with no sink_dropped count. Now the sink keeps every batch until the collector acknowledges its commit and
    resends the rest after reconnecting; the collector stores each (stream, seq) once. Two crashes in one run:
    stored == emitted, each event exactly once, nothing counted lost."""
    with collector_files() as files:
        proc = files.process().start()
        sink = hook_sink(files.socket_path, "run-crash", batch_events=200)
        try:
            with Producer(sink, "run-crash", rate=10_000) as producer:
                # Connections counted before each kill: the sink may reconnect while the restarted collector is
                # still being waited for, so the count to beat is taken before the kill, not after the restart.
                before_kill = 0
                for _ in range(2):
                    wait_until(lambda b=before_kill: sink.connects > b, timeout=20, what="the sink (re)connected")
                    so_far = stored(files.http_url, "run-crash")
                    wait_until(lambda b=so_far: stored(files.http_url, "run-crash") > b, what="rows committed")
                    time.sleep(1.0)
                    before_kill = sink.connects
                    proc.kill()  # SIGKILL: no flush, no goodbye; batches in flight are in nobody's database
                    time.sleep(0.5)
                    proc = files.process().start()
                time.sleep(1.0)
                emitted = producer.stop()
            sink.close(timeout=30)
        finally:
            proc.stop()
        got = stored_in(files.db_path, "run-crash")
        assert sink.lost_events == 0 and sink.accounted_events() == emitted
        assert got.events == emitted and got.distinct == emitted and got.reported_lost == 0
        assert got.gaps == 0
        assert emitted > 20_000
        assert sink.connects >= 3


def test_loss_past_the_bounds_is_counted_end_to_end() -> None:
    """When the collector stays away longer than the sink's buffers hold, events are lost, but never silently:
    stored + reported (sink_dropped rows) == emitted."""
    with collector_files() as files:
        proc = files.process().start()
        sink = hook_sink(files.socket_path, "run-bounded", capacity=3_000, batch_events=200, replay_events=2_000)
        try:
            with Producer(sink, "run-bounded", rate=5_000) as producer:
                wait_until(lambda: stored(files.http_url, "run-bounded") > 0, what="rows committed")
                proc.kill()
                time.sleep(2.5)  # ~12,500 events emitted while at most 5,000 can be held
                proc = files.process().start()
                time.sleep(1.0)
                emitted = producer.stop()
            sink.close(timeout=30)
        finally:
            proc.stop()
        got = stored_in(files.db_path, "run-bounded")
        assert got.reported_lost > 0 and got.reported_lost == sink.lost_events
        assert got.events + got.reported_lost == emitted
        assert got.distinct == got.events  # nothing stored twice


def test_a_resent_batch_is_stored_once_and_a_late_one_is_not_a_gap() -> None:
    """Duplicate batches were stored twice, and a batch arriving after its successor (two connections of one
    stream) was reported as a gap. Here: seq 0, 1, 3 on one connection, then 2 (late), 3 (again) and 4 on the
    next. Stored: 0..4 once each; no gap, one duplicate."""
    with collector_files() as files:
        with files.process():
            m = meta("reorder", "run-reorder", "e0")
            b = {k: bulk_batches("run-reorder", "e0", 1, 10, first_seq=k)[0] for k in range(5)}
            send_stream(files.socket_path, m, [b[0], b[1], b[3]])
            wait_until(lambda: stored(files.http_url, "run-reorder") == 30, what="first connection stored")
            send_stream(files.socket_path, m, [b[2], b[3], b[4]])
            wait_until(lambda: stored(files.http_url, "run-reorder") == 50, what="second connection stored")
            time.sleep(6.0)  # past the 5 s grace in which a missing batch may still arrive
            m_ = _metrics(files)
            assert metric(m_, "kvfabric_sequence_gaps_total") == 0
            assert metric(m_, "kvfabric_duplicate_batches_total") == 1
            runs = httpx.get(files.http_url + "/api/v1/runs").json()
            assert [(r["run_id"], r["events"], r["sequence_gaps"]) for r in runs] == [("run-reorder", 50, 0)]
        with duckdb.connect(files.db_path, read_only=True) as con:
            assert con.execute("SELECT seq, count(*) FROM events GROUP BY seq ORDER BY seq").fetchall() == [
                (k, 10) for k in range(5)]
            assert con.execute("SELECT batches, rows, last_seq, gaps, duplicates FROM streams").fetchone() == (
                5, 50, 4, 0, 1)


# ------------------------------------------------------------------------------------------- storage faults


class FullDisk:
    """A real filesystem that fills up: a small tmpfs with a filler file (``fill``/``clear``).

    Where mounting is not allowed, the same fault comes from RLIMIT_FSIZE on the collector process: its writes
    past the current file sizes fail in the kernel (EFBIG) exactly where a full disk fails them (ENOSPC)."""

    def __init__(self, root: str, size_mb: int = 64) -> None:
        self.dir = os.path.join(root, "disk")
        os.makedirs(self.dir)
        # KVFABRIC_TEST_DISK_FAULT=fsize forces the RLIMIT_FSIZE variant (to exercise it where tmpfs works).
        self.mounted = os.environ.get("KVFABRIC_TEST_DISK_FAULT") != "fsize" and subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", self.dir], capture_output=True
        ).returncode == 0
        self.filler = os.path.join(self.dir, "filler")
        self._pid: int | None = None
        self._limit: tuple[int, int] | None = None

    def fill(self, pid: int, leave: int = 0) -> None:
        """No space left (or only ``leave`` bytes: enough for a few commits, not for the next checkpoint)."""
        if self.mounted:
            self._write_until_full(leave)
            return
        self._pid = pid
        self._limit = resource.prlimit(pid, resource.RLIMIT_FSIZE)
        biggest = max(os.path.getsize(os.path.join(self.dir, n)) for n in os.listdir(self.dir))
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (biggest + leave, self._limit[1]))

    def _write_until_full(self, leave: int = 0) -> None:
        """Write the filler until the kernel says the disk is full, or until only ``leave`` bytes are free (the
        collector keeps writing meanwhile). With ``leave``, the disk is never full on the way: filling it and then
        truncating the filler left a moment with no space at all, in which the collector's next commit failed
        first (the WAL write, not the checkpoint the test waits for)."""
        chunk = b"\0" * (1 << 20)
        with open(self.filler, "wb", buffering=0) as f:
            while leave:
                st = os.statvfs(self.dir)
                room = st.f_bavail * st.f_frsize - leave
                if room < 4096:
                    return
                f.write(chunk[: min(len(chunk), room)])
            while True:
                try:
                    f.write(chunk)
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    if len(chunk) <= 4096:
                        return
                    chunk = chunk[: len(chunk) // 2]

    def clear(self) -> None:
        if self.mounted:
            os.unlink(self.filler)
        elif self._pid is not None and self._limit is not None:
            with contextlib.suppress(ProcessLookupError):  # a collector that exited took its limit with it
                resource.prlimit(self._pid, resource.RLIMIT_FSIZE, self._limit)

    def close(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", self.dir], capture_output=True)


@contextlib.contextmanager
def collector_on_small_disk() -> Iterator[tuple[CollectorFiles, FullDisk]]:
    with collector_files() as files:
        disk = FullDisk(files.root)
        try:
            files.db_path = os.path.join(disk.dir, "events.duckdb")
            yield files, disk
        finally:
            disk.close()


def _health(files: CollectorFiles) -> tuple[int, dict]:
    r = httpx.get(files.http_url + "/healthz", timeout=10)
    return r.status_code, r.json()


@pytest.mark.parametrize(
    ("leave", "threshold", "fault"),
    [(0, "64MB", "Failed to commit"), (1536 * 1024, "1MB", "database reopened")],
    ids=["wal-write-fails", "checkpoint-invalidates"],
)
def test_a_full_disk_makes_the_collector_unhealthy_holds_ingest_and_recovers(
    leave: int, threshold: str, fault: str
) -> None:
    """Issue #9 defect 6: on a full disk DuckDB failed (and, at its next checkpoint, invalidated the database);
    the writer went on dropping every later batch, /healthz stayed 200, kvfabric_up 1, /api/v1/runs answered 500
    and nothing recovered when space returned. Now: 503 and kvfabric_up 0 at once, ingest held (the sink keeps
    its unacknowledged batches), 503 not 500 from the API, and once space returns (the database reopened when
    DuckDB invalidated it) every event is stored exactly once.

    Two faults: no space at all with checkpoints far away (the commit's WAL write fails), and 1.5 MB left with a
    1 MB checkpoint threshold (commits succeed until the WAL passes the threshold; the checkpoint then fails and
    DuckDB invalidates the database: only closing and reopening it gets out of that)."""
    # Which write runs out of space first in the second case is DuckDB's to decide: in some fresh-clone runs its
    # WAL outgrew the 1.5 MB left before an automatic checkpoint ran, though the disk was never full on the way
    # (FullDisk.fill). The collector must behave either way, and every round checks that; the reopen path needs
    # the checkpoint to be the write that fails, so that case runs again (at most three rounds) until it is.
    rounds = 3 if fault == "database reopened" else 1
    for _ in range(rounds):
        log = _full_disk_round(leave, threshold)
        if fault in log:
            break
    assert fault in log


def _full_disk_round(leave: int, threshold: str) -> str:
    """One round of the test above: fill the disk under ingest, check the failing state, free the space, check
    the recovery and that every event is stored once. Returns the collector's log."""
    with collector_on_small_disk() as (files, disk):
        proc = files.process(checkpoint_threshold=threshold).start()
        assert proc.proc is not None
        sink = hook_sink(files.socket_path, "run-disk", batch_events=200)
        try:
            with Producer(sink, "run-disk", rate=5_000) as producer:
                wait_until(lambda: stored(files.http_url, "run-disk") > 2_000, what="rows committed")
                disk.fill(proc.proc.pid, leave)
                wait_until(lambda: _health(files)[0] == 503, timeout=30, what="/healthz 503")
                _, body = _health(files)
                assert body["status"] == "failing" and body["storage"] == "failing"
                assert "db_path" not in body and files.root not in str(body)  # no paths for anonymous callers
                m = _metrics(files)
                assert metric(m, "kvfabric_up") == 0 and metric(m, "kvfabric_storage_healthy") == 0
                assert metric(m, "kvfabric_storage_errors_total") >= 1
                assert httpx.get(files.http_url + "/api/v1/runs", timeout=10).status_code in (200, 503)
                time.sleep(2.0)  # ingest goes on arriving while the disk is full
                assert httpx.get(files.http_url + "/api/v1/runs", timeout=10).status_code in (200, 503)
                disk.clear()
                wait_until(lambda: _health(files)[0] == 200, timeout=30, what="recovered")
                m = _metrics(files)
                assert metric(m, "kvfabric_up") == 1 and metric(m, "kvfabric_storage_healthy") == 1
                time.sleep(1.0)
                emitted = producer.stop()
            sink.close(timeout=30)
        finally:
            proc.stop()
        log = files.log()
        print(log[-6000:])
        assert "storage failing" in log and "storage recovered" in log
        assert "Traceback" not in log
        got = stored_in(files.db_path, "run-disk")
        assert sink.lost_events == 0 and sink.accounted_events() == emitted
        assert got.events == emitted and got.distinct == emitted and got.reported_lost == 0
        return log


def test_stopping_on_a_full_disk_does_not_claim_a_flush_and_the_next_collector_gets_the_rows() -> None:
    """SIGTERM while the disk is full: the collector said "flushed" after a failed checkpoint. Now it says what
    was not committed and exits 1; the sink still holds those batches and the next collector stores them."""
    with collector_on_small_disk() as (files, disk):
        proc = files.process(checkpoint_threshold="1MB").start()
        assert proc.proc is not None
        sink = hook_sink(files.socket_path, "run-term", batch_events=200)
        try:
            with Producer(sink, "run-term", rate=5_000) as producer:
                wait_until(lambda: stored(files.http_url, "run-term") > 1_000, what="rows committed")
                disk.fill(proc.proc.pid)
                wait_until(lambda: _health(files)[0] == 503, timeout=10, what="/healthz 503")
                time.sleep(1.0)
                assert proc.stop(timeout=60) == 1
                log = files.log()
                assert "WITHOUT a clean flush" in log and "flushed" not in log
                disk.clear()
                proc = files.process().start()
                time.sleep(1.0)
                emitted = producer.stop()
            sink.close(timeout=30)
        finally:
            proc.stop()
        got = stored_in(files.db_path, "run-term")
        assert sink.lost_events == 0
        assert got.events == emitted and got.distinct == emitted


def test_the_full_disk_fault_is_real() -> None:
    """The fault the two tests above inject is a kernel write failure, not a mock: a plain write fails."""
    with tempfile.TemporaryDirectory(dir="/tmp") as root:
        disk = FullDisk(root, size_mb=4)
        try:
            if not disk.mounted:
                pytest.skip("tmpfs cannot be mounted here; the RLIMIT_FSIZE variant is used instead")
            disk.fill(os.getpid())
            with pytest.raises(OSError, match="No space left"), open(os.path.join(disk.dir, "x"), "wb") as f:
                f.write(b"\0" * (1 << 20))
                f.flush()
        finally:
            disk.close()
