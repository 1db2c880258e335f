"""A sink whose destination fails is logged once and counted always (issue 26, deliverable 3).

Before: an unwritable JSONL path logged a traceback at every 100 ms flush (845 lines in 7.7 s). Now every
failure (a bad path, no permission, a full disk, a collector that is down) logs one line naming the sink, its
path and the reason, then at most one summary a minute, and one line when it works again; what was dropped
meanwhile is counted and reported in a ``sink_dropped`` row (in the file for a JSONL sink, at the collector's
``/metrics`` for a Unix one).

Minutes pass on a clock the test steps (the sink's ``clock``), so the one-minute limit is tested without waiting;
the real forwarder process is tested on real time, over a few seconds of flushes every 20 ms.
"""

from __future__ import annotations

import errno
import json
import logging
import re
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.collector_testkit import collector_files, metric, scrape, wait_until
from support.sink_testkit import META, StreamServer, dropped_row, row

from kvfabric.contract import schema as S
from kvfabric.forwarder.buffer import EventBuffer
from kvfabric.forwarder.sinks import FailureLog, JsonlSink, UnixArrowSink


class Clock:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def hook_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "kvfabric.forwarder"]


def blocked_path(tmp_path: Path) -> tuple[Path, Path]:
    """A JSONL path that cannot be created, even by root: its directory would be inside a regular file."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    return blocker, blocker / "events.jsonl"


# ------------------------------------------------------------------------------------------ the rule itself


def test_failure_log_says_it_once_then_once_a_minute() -> None:
    clock = Clock()
    lost = [0]
    emitted: list[str] = []
    fl = FailureLog("jsonl sink /x", lambda: (lost[0], 7), clock)
    handler = logging.Handler()
    handler.emit = lambda record: emitted.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("kvfabric.forwarder")
    logger.addHandler(handler)
    try:
        for k in range(6000):  # ten minutes of 100 ms flushes, every one failing
            clock.now = 1000 + k / 10
            fl.failed("permission", "cannot open: [Errno 13] Permission denied")
            lost[0] += 1
        clock.now = 1600
        fl.recovered()
        # It flaps: fails again 1 s later and works 1 s after that, within a minute of the last line: no line.
        clock.now += 1
        fl.failed("disk_full", "cannot write: [Errno 28] No space left on device")
        clock.now += 1
        fl.recovered()
        fl.close()
    finally:
        logger.removeHandler(handler)
    assert fl.failures == {"permission": 6000, "disk_full": 1} and fl.total == 6001
    assert "failed (permission): cannot open: [Errno 13] Permission denied; events wait (7 now)" in emitted[0]
    summaries = [m for m in emitted if "still failing" in m]
    assert len(summaries) == 9  # at 60, 120, ... 540 s
    assert "600 failures in the last 60 s (permission: 600), 600 events dropped by this sink since, 7 waiting" \
        in summaries[0]
    assert "works again after 599 more failures; 600 events dropped by this sink meanwhile" in emitted[10]
    assert "closing: 1 failures" in emitted[11] and "disk_full: 1" in emitted[11]
    assert len(emitted) == 12 == fl.lines


# -------------------------------------------------------------------------------------- a JSONL sink, in process


def test_an_unwritable_jsonl_path_logs_once_and_reports_its_loss_when_writing_works(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    blocker, path = blocked_path(tmp_path)
    buffer = EventBuffer(capacity=500, wake_at=100)
    sink = JsonlSink(str(path), buffer, {S.META_RUN_ID: "r"}, dropped_row, batch_events=100, flush_ms=100,
                     clock=clock)
    with caplog.at_level(logging.WARNING, logger="kvfabric.forwarder"):
        for i in range(6000):  # ten minutes of flushes (the thread is not started: each flush is this loop's)
            clock.now = 1000 + i / 10
            buffer.append(row(i))
            sink._flush(final=False)
        lines = hook_lines(caplog)
        assert sink.failures == {"bad_path": 6000}
        assert buffer.dropped == 6000 - 500  # the buffer holds 500 and counts the rest
        firsts = [r for r in lines if "failed (bad_path)" in r.getMessage()]
        assert len(firsts) == 1 and str(path) in firsts[0].getMessage()
        assert "Not a directory" in firsts[0].getMessage() or "File exists" in firsts[0].getMessage()
        assert len([r for r in lines if "still failing" in r.getMessage()]) == 9
        assert len(lines) == 10 and not any(r.exc_info for r in lines)
        blocker.unlink()  # the path works again
        clock.now = 1600
        sink._flush(final=False)
        sink.close()
    out = [json.loads(x) for x in path.read_text().splitlines()]
    assert out[0]["kvfabric_stream"][S.META_RUN_ID] == "r"
    assert out[1]["event"] == S.SINK_DROPPED and out[1]["count"] == 5500  # the loss, first thing written
    assert [x["block_id"] for x in out[2:]] == list(range(500))  # what the buffer held
    assert "works again" in hook_lines(caplog)[-1].getMessage()
    assert len(hook_lines(caplog)) == 11


def test_a_full_disk_logs_once_and_a_cut_write_resumes_where_it_stopped(tmp_path: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    """/dev/full: every write fails with ENOSPC. Then a disk that fills half way through a batch: the rest goes
    out when space returns, no line written twice or cut."""
    clock = Clock()
    buffer = EventBuffer(capacity=10_000, wake_at=100)
    sink = JsonlSink("/dev/full", buffer, {}, dropped_row, batch_events=10, clock=clock)
    with caplog.at_level(logging.WARNING, logger="kvfabric.forwarder"):
        for i in range(1000):
            clock.now = 1000 + i / 10
            buffer.append(row(i))
            sink._flush(final=False)
        sink.close()
    assert sink.failures == {"disk_full": 1001}  # every flush, and the last one at close
    lines = [r.getMessage() for r in hook_lines(caplog)]
    assert len([m for m in lines if "failed (disk_full)" in m and "/dev/full" in m]) == 1
    assert len([m for m in lines if "still failing" in m]) == 1  # at 60 s; 100 s in all
    assert sink.lost_events == 1000

    class FillingFile:
        """Takes ``room`` bytes, then fails like a full disk until space is made."""

        def __init__(self, room: int) -> None:
            self.data = bytearray()
            self.room = room

        def write(self, b: memoryview) -> int:
            if self.room <= 0:
                raise OSError(errno.ENOSPC, "No space left on device")
            n = min(len(b), self.room)
            self.data += b[:n]
            self.room -= n
            return n

        def close(self) -> None:
            pass

    buffer = EventBuffer(capacity=10_000, wake_at=100)
    sink = JsonlSink(str(tmp_path / "e.jsonl"), buffer, {}, dropped_row, batch_events=10, clock=clock)
    fake = FillingFile(room=700)
    sink._file = fake  # type: ignore[assignment]
    for i in range(30):
        buffer.append(row(i))
    sink._flush(final=False)  # the first line and part of the first batch fit
    assert sink.failures == {"disk_full": 1} and 0 < len(fake.data) == 700
    fake.room = 10**9
    sink._flush(final=False)
    out = [json.loads(x) for x in fake.data.decode().splitlines()]  # every line whole
    assert "kvfabric_stream" in out[0]
    assert [x["block_id"] for x in out[1:]] == list(range(30))  # each once, in order
    assert sink.lost_events == 0


def test_an_unexpected_error_in_a_flush_is_traced_once_not_per_flush(tmp_path: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    class Broken(JsonlSink):
        def _ready(self, final: bool) -> bool:
            raise RuntimeError("a bug")

    buffer = EventBuffer(capacity=100, wake_at=1)
    sink = Broken(str(tmp_path / "e.jsonl"), buffer, {}, dropped_row, flush_ms=5)
    with caplog.at_level(logging.WARNING, logger="kvfabric.forwarder"):
        sink.start()
        wait_until(lambda: sink.failure_log.total >= 50, timeout=20, what="50 flushes")
        sink.close()
    lines = hook_lines(caplog)
    assert len(lines) == 2 and "failed (internal): RuntimeError: a bug" in lines[0].getMessage()
    assert lines[0].exc_info is not None  # the one traceback, for the bug report
    assert "closing: " in lines[1].getMessage() and lines[1].exc_info is None  # the count of the others
    assert sink.failures["internal"] == sink.failure_log.total >= 50


# ------------------------------------------------------------------------------------ a Unix sink, in process


def test_a_dead_collector_logs_once_and_delivers_with_the_count_when_back(tmp_path: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    path = str(tmp_path / "c.sock")
    buffer = EventBuffer(capacity=300, wake_at=10_000)
    sink = UnixArrowSink(path, buffer, dict(META), dropped_row, batch_events=100, flush_ms=100, clock=clock)
    attempts = 0
    with caplog.at_level(logging.WARNING, logger="kvfabric.forwarder"):
        for i in range(6000):  # ten minutes of flushes; connections are tried at the backoff's pace (up to 5 s)
            clock.now = 1000 + i / 10
            buffer.append(row(i))
            before = sink._next_attempt
            sink._flush(final=False)
            attempts += sink._next_attempt != before
        lines = [r.getMessage() for r in hook_lines(caplog)]
        assert sink.failures == {"unreachable": attempts} and 110 < attempts < 130
        firsts = [m for m in lines if "failed (unreachable)" in m]
        assert len(firsts) == 1 and path in firsts[0] and "No such file or directory" in firsts[0]
        assert len([m for m in lines if "still failing" in m]) == 9
        assert len(lines) == 10 and not any(r.exc_info for r in hook_lines(caplog))
        server = StreamServer(path)
        clock.now = 1610
        sink._flush(final=False)
        sink.close()
    rows = server.rows()
    assert rows[0]["event"] == S.SINK_DROPPED and rows[0]["count"] == buffer.dropped == 6000 - 300
    assert [r["block_id"] for r in rows[1:]] == list(range(300))  # what the buffer held
    assert sink.lost_events == 5700 and sink.accounted_events() == 6000
    assert "works again" in hook_lines(caplog)[-1].getMessage()
    server.close()


# ----------------------------------------------------------------------------------- through the real forwarder

pytest.importorskip("vllm")


def make_hook(sink: str, run_id: str) -> tuple[Any, Any]:
    """vLLM's real KVCacheManager with the hook streaming through the real forwarder (and a local expansion, to
    know what was made). A small event bound, so that a destination that is away makes the ring overflow."""
    from support.pools import BLOCK, bare_manager  # vLLM and torch: only the tests that drive the real manager

    from kvfabric.engine.config import load_hook_settings
    from kvfabric.engine.install import build_hook

    manager = bare_manager(14)
    settings = load_hook_settings({"KVFABRIC_LIFECYCLE": "1", "KVFABRIC_SINK": sink, "KVFABRIC_RUN_ID": run_id,
                                   "KVFABRIC_BATCH_EVENTS": "64", "KVFABRIC_FLUSH_MS": "20",
                                   "KVFABRIC_BUFFER_EVENTS": "100"})
    inst = build_hook(manager, settings, block_size=BLOCK, engine="test", outlet="tee")
    assert inst is not None
    return manager, inst


def forwarder_lines(err: str) -> list[str]:
    return [x for x in err.splitlines() if "kvfabric" in x]


def test_through_the_forwarder_an_unwritable_jsonl_path_logs_once_and_the_file_gets_the_count(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    from support.pools import traffic  # vLLM and torch: only the tests that drive the real manager

    blocker, path = blocked_path(tmp_path)
    manager, inst = make_hook(f"jsonl://{path}", "jsonl-fail")
    outlet = inst.outlet.remote
    assert outlet.wait_ready()
    for k in range(20):  # 2 s: ~100 of the forwarder's 20 ms flushes, all failing; the ring fills and overflows
        traffic(manager, inst, 3, start=3 * k)
        time.sleep(0.1)
    assert outlet.lost_events > 0
    blocker.unlink()
    wait_until(lambda: outlet.ring.used() == 0, timeout=10, what="the forwarder writing and reading again")
    traffic(manager, inst, 3, start=60)
    inst.close()
    err = capfd.readouterr().err
    lines = forwarder_lines(err)
    assert "Traceback" not in err
    firsts = [x for x in lines if "failed (bad_path)" in x]
    assert len(firsts) == 1 and str(path) in firsts[0], lines
    assert not [x for x in lines if "still failing" in x]  # under a minute
    assert len([x for x in lines if "works again" in x]) == 1
    assert len(lines) <= 3, lines  # the two above, and at most the parent's count of loss at close
    out = [json.loads(x) for x in path.read_text().splitlines()]
    reported = sum(x["count"] for x in out[1:] if x["event"] == S.SINK_DROPPED)
    assert reported == outlet.lost_events  # every event lost is reported in the file
    assert any(x.get("request_id") == "q62" for x in out[1:])  # the stream went on


def test_through_the_forwarder_a_dead_collector_logs_once_and_metrics_get_the_count(
        capfd: pytest.CaptureFixture[str]) -> None:
    from support.pools import traffic  # vLLM and torch: only the tests that drive the real manager

    with collector_files() as files:
        manager, inst = make_hook(f"unix://{files.socket_path}", "dead-collector")
        outlet = inst.outlet.remote
        assert outlet.wait_ready()
        for k in range(20):  # 2 s with no collector: connection attempts fail (backoff), the ring overflows
            traffic(manager, inst, 3, start=3 * k)
            time.sleep(0.1)
        assert outlet.lost_events > 0
        proc = files.process()
        proc.start()
        try:
            wait_until(lambda: outlet.ring.used() == 0, timeout=20, what="the forwarder sending and reading again")
            traffic(manager, inst, 3, start=60)
            inst.close()
            lost = outlet.lost_events

            def dropped() -> float:
                text = httpx.get(f"{files.http_url}/metrics", timeout=10).text
                return metric(scrape(text), "kvfabric_sink_dropped_events_total", run="dead-collector",
                              engine="test")

            wait_until(lambda: dropped() == lost, timeout=20, what="the loss at /metrics")
        finally:
            proc.stop()
    err = capfd.readouterr().err
    lines = forwarder_lines(err)
    assert "Traceback" not in err
    firsts = [x for x in lines if re.search(r"failed \(unreachable\)", x)]
    assert len(firsts) == 1 and files.socket_path in firsts[0], lines
    assert not [x for x in lines if "still failing" in x]
    assert len([x for x in lines if "works again" in x]) == 1, lines
