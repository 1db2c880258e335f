"""Sinks over a real Unix socket: batching, sequence numbers, metadata, acknowledgements, replay, backoff, the
listener check, and counted loss.

The receiver here is a minimal protocol-2 collector (kvfabric/contract/protocol.py) whose misbehaviour each test
controls (hang up after N batches without acknowledging, accept and close at once, never acknowledge). End-to-end
guarantees against the real collector process are in tests/collector/test_collector_reliability.py.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

import pytest
from support.sink_testkit import META, StreamServer, dropped_row, row, wait_for

from kvfabric.contract import protocol as P
from kvfabric.contract import schema as S
from kvfabric.contract.ring import W_ACCOUNTED, W_SENT, Ring
from kvfabric.forwarder import loop as forwarder
from kvfabric.forwarder.buffer import EventBuffer
from kvfabric.forwarder.sinks import JsonlSink, UnixArrowSink


def make_sink(path: str, buffer: EventBuffer, batch: int = 100, **kwargs: object) -> UnixArrowSink:
    return UnixArrowSink(path, buffer, dict(META), dropped_row, batch_events=batch, flush_ms=20, **kwargs)


def test_unix_sink_delivers_everything_in_numbered_batches(tmp_path: Path) -> None:
    path = str(tmp_path / "s.sock")
    server = StreamServer(path)
    buffer = EventBuffer(capacity=10_000, wake_at=100)
    sink = make_sink(path, buffer)
    sink.start()
    for i in range(250):
        buffer.append(row(i))
    sink.close()
    wait_for(lambda: len(server.rows()) == 250)
    assert [r["block_id"] for r in server.rows()] == list(range(250))
    seqs = [b.column("seq")[0].as_py() for b in server.batches]
    assert seqs == list(range(len(seqs))) and len(seqs) >= 3
    assert server.streams[0][S.META_ENGINE] == "e" and len(server.streams[0][S.META_STREAM_ID]) == 32
    assert server.streams[0][P.META_PROTOCOL] == "2"
    assert sink.lost_events == 0 and sink.sent_events == 250 and sink.accounted_events() == 250
    server.close()


def test_a_sink_says_hello_before_it_has_anything_to_send(tmp_path: Path) -> None:
    """A sink connects as soon as it starts, with nothing to send (its stream's metadata is how the collector lists
    an engine before its first request), and keeps that one connection while idle and for its first events."""
    path = str(tmp_path / "i.sock")
    server = StreamServer(path)
    buffer = EventBuffer(capacity=1000, wake_at=10)
    sink = make_sink(path, buffer, batch=10)
    sink.start()
    wait_for(lambda: sink.connects == 1)
    assert server.streams[0][S.META_ENGINE] == "e" and not server.batches
    time.sleep(0.3)
    assert server.accepted == 1
    for i in range(10):
        buffer.append(row(i))
    wait_for(lambda: len(server.rows()) == 10)
    assert server.accepted == 1 and sink.connects == 1
    sink.close()
    server.close()


def test_collector_late_loses_nothing(tmp_path: Path) -> None:
    path = str(tmp_path / "late.sock")
    buffer = EventBuffer(capacity=10_000, wake_at=100)
    sink = make_sink(path, buffer)
    sink.start()
    for i in range(50):
        buffer.append(row(i))
    time.sleep(0.3)  # several failed connection attempts; the rows must wait in the buffer
    assert sink.lost_events == 0
    server = StreamServer(path)
    wait_for(lambda: len(server.rows()) == 50)
    sink.close()
    assert not [r for r in server.rows() if r["event"] == S.SINK_DROPPED]
    server.close()


def test_overflow_is_counted_and_reported(tmp_path: Path) -> None:
    path = str(tmp_path / "o.sock")
    buffer = EventBuffer(capacity=10, wake_at=10_000)
    for i in range(25):  # nothing drains yet: 15 events cannot be held
        buffer.append(row(i))
    assert buffer.dropped == 15
    server = StreamServer(path)
    sink = make_sink(path, buffer)
    sink.start()
    sink.close()
    wait_for(lambda: len(server.rows()) == 11)
    rows = server.rows()
    assert rows[0]["event"] == S.SINK_DROPPED and rows[0]["count"] == 15
    assert [r["block_id"] for r in rows[1:]] == list(range(10))
    assert sink.accounted_events() == 25  # 10 committed + 15 lost and reported in a committed row
    server.close()


def test_a_collector_dying_mid_stream_loses_nothing(tmp_path: Path) -> None:
    """Issue #9 defects 3 and 4: the receiver hangs up after every second batch without acknowledging it (as a
    collector killed between reading and committing). Every batch is kept until acknowledged and resent on the
    next connection: all 400 events arrive exactly once, none counted lost."""
    path = str(tmp_path / "d.sock")
    server = StreamServer(path, max_batches_per_conn=2)
    buffer = EventBuffer(capacity=100_000, wake_at=10)
    sink = make_sink(path, buffer, batch=10)
    sink.start()
    for i in range(400):
        buffer.append(row(i))
        if i % 10 == 9:
            time.sleep(0.005)
    wait_for(lambda: sink.connects >= 3)
    sink.close(timeout=60)
    rows = server.rows()
    assert sorted(r["block_id"] for r in rows) == list(range(400))  # each exactly once
    assert not [r for r in rows if r["event"] == S.SINK_DROPPED]
    assert sink.lost_events == 0 and sink.accounted_events() == 400
    assert server.received > len(server.batches)  # resends happened (the unacknowledged batch of each connection)
    # All streams of one sink share one stream id, and seq keeps growing across reconnects.
    assert len({s[S.META_STREAM_ID] for s in server.streams}) == 1
    seqs = [b.column("seq")[0].as_py() for b in server.batches]
    assert seqs == list(range(len(seqs)))
    server.close()


def test_backoff_keeps_growing_while_the_collector_accepts_and_hangs_up(tmp_path: Path) -> None:
    """Issue #9 defect 3: a collector that accepts and closes at once must not reset the backoff (the sink would
    retry every 0.1 s and, before the fix, throw a batch away each time). Nothing is lost once it behaves."""
    path = str(tmp_path / "b.sock")
    server = StreamServer(path)
    server.close_at_once = True
    buffer = EventBuffer(capacity=10_000, wake_at=10)
    sink = make_sink(path, buffer, batch=10)
    sink.start()
    for i in range(100):
        buffer.append(row(i))
    time.sleep(3.0)
    # 0.1 + 0.2 + 0.4 + 0.8 + 1.6 s of backoff fit in 3 s: at most ~6 attempts (a reset-on-connect sink: ~30).
    assert 2 <= server.accepted <= 7, server.accepted
    assert sink.lost_events == 0
    server.close_at_once = False
    wait_for(lambda: len(server.rows()) == 100, timeout=15)
    sink.close()
    assert sorted(r["block_id"] for r in server.rows()) == list(range(100))
    assert sink.lost_events == 0
    server.close()


def test_written_but_unacknowledged_rows_are_not_accounted(tmp_path: Path) -> None:
    """Issue #9 defect 4: "accounted" means committed. A collector that takes the rows but never confirms a
    commit leaves them unaccounted (the forwarder's parent would count them lost if the forwarder died), and at
    close they are counted lost, not silently dropped."""
    path = str(tmp_path / "n.sock")
    server = StreamServer(path, ack=False)
    buffer = EventBuffer(capacity=10_000, wake_at=10)
    sink = make_sink(path, buffer, batch=10)
    sink.start()
    for i in range(50):
        buffer.append(row(i))
    wait_for(lambda: server.received == 5)
    time.sleep(0.2)
    assert sink.sent_events == 50
    assert forwarder.accounted(sink) == 0
    sink.close(timeout=1.0)
    assert sink.lost_events == 50 and forwarder.accounted(sink) == 0
    server.close()


def test_acknowledged_batches_reach_the_rings_header_while_the_forwarder_is_busy(tmp_path: Path) -> None:
    """The parent counts a dead forwarder's loss as expanded minus what the ring's header says is accounted. The
    forwarder's main loop publishes that count only when it idles; while it is busy (never idle), every batch the
    collector acknowledges must reach the header from the sink's own thread, or a killed forwarder's committed
    events would be counted lost. Nothing here calls the publisher: only acknowledgements move the header."""
    path = str(tmp_path / "a.sock")
    server = StreamServer(path)
    ring = Ring.create(1 << 12)
    buffer = EventBuffer(capacity=10_000, wake_at=10)
    sink = make_sink(path, buffer, batch=10)
    forwarder.publish_accounting(ring, sink)
    sink.start()
    try:
        for i in range(50):
            buffer.append(row(i))
        wait_for(lambda: ring.word(W_ACCOUNTED) == 50)
        assert forwarder.accounted(sink) == 50
    finally:
        sink.close()
        server.close()
        ring.close()


def test_an_idle_sink_reads_acknowledgements_as_they_arrive(tmp_path: Path) -> None:
    """A batch sent, then nothing to send for a long flush interval: its acknowledgement must still reach the
    ring's header at once. (It used to wait for the next flush, 10 minutes here, and a forwarder killed meanwhile
    left events the collector had committed counted lost: stored + lost > emitted.) W_SENT covers the batch from
    before it is sent: W_SENT - W_ACCOUNTED is what a forwarder killed then may have had stored."""
    path = str(tmp_path / "i.sock")
    server = StreamServer(path)
    ring = Ring.create(1 << 12)
    buffer = EventBuffer(capacity=10_000, wake_at=1_000_000)
    sink = UnixArrowSink(path, buffer, dict(META), dropped_row, batch_events=1_000_000, flush_ms=600_000)
    forwarder.publish_accounting(ring, sink)
    try:
        for i in range(30):
            buffer.append(row(i))
        sink.start()  # its first round runs at once (wakeup set): connects, sends the 30 rows, then idles
        buffer.wakeup.set()
        wait_for(lambda: ring.word(W_ACCOUNTED) == 30, timeout=5.0)
        assert ring.word(W_SENT) == 30 and sink.handed_events() == 30
    finally:
        sink.close()
        server.close()
        ring.close()


def test_the_replay_buffer_is_bounded_and_the_hook_buffer_absorbs(tmp_path: Path) -> None:
    """With the collector not confirming, at most ``replay_events`` rows are held for replay; the rest wait in
    the hook's bounded buffer, which drops and counts when full."""
    path = str(tmp_path / "r.sock")
    server = StreamServer(path, ack=False)
    buffer = EventBuffer(capacity=100, wake_at=10)
    sink = make_sink(path, buffer, batch=10, replay_events=30)
    sink.start()
    for i in range(300):
        buffer.append(row(i))
        time.sleep(0.001)
    time.sleep(0.3)
    assert 20 < sink._unacked_rows <= 30  # rows held for replay, sink_dropped markers included
    assert server.received == len(sink._unacked)  # sent, then the sink waits for acknowledgements
    assert len(buffer) == 100 and buffer.dropped > 0
    assert sink.unacked_events + len(buffer) + buffer.dropped == 300
    sink.close(timeout=0.5)
    assert sink.lost_events == 300  # nothing was ever confirmed: all counted
    server.close()


def test_a_listener_of_another_user_receives_nothing(tmp_path: Path) -> None:
    """Issue #9 defect 8: another user listening at the socket path (a shared directory such as /tmp) must not
    receive anything from the sink, not even the stream's metadata."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run a listener as another user")
    shared = Path(tempfile.mkdtemp(prefix="kvf-shared-", dir="/tmp"))  # reachable by the other user
    os.chmod(shared, 0o1777)  # like /tmp itself
    path = str(shared / "kvfabric.sock")
    got = shared / "received"
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the other user's listener
        try:
            os.close(r)
            os.setgid(65534)
            os.setuid(65534)
            srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            srv.bind(path)
            srv.listen(8)
            os.write(w, b"x")
            srv.settimeout(3.0)
            total = 0
            try:
                while True:
                    conn, _ = srv.accept()
                    conn.settimeout(0.5)
                    try:
                        while data := conn.recv(65536):
                            total += len(data)
                    except OSError:
                        pass
                    conn.close()
            except OSError:
                pass
            fd = os.open(str(got), os.O_WRONLY | os.O_CREAT, 0o666)
            os.write(fd, str(total).encode())
            os.close(fd)
        finally:
            os._exit(0)
    os.close(w)
    assert os.read(r, 1) == b"x"
    os.close(r)
    buffer = EventBuffer(capacity=10_000, wake_at=10)
    sink = make_sink(path, buffer, batch=10)
    sink.start()
    for i in range(50):
        buffer.append(row(i))
    time.sleep(1.0)
    sink.close(timeout=0.5)
    os.waitpid(pid, 0)
    try:
        assert got.read_text() == "0"  # not a byte, metadata included
        assert sink.lost_events == 50 and sink.connects == 0
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_jsonl_sink_writes_metadata_then_rows(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    buffer = EventBuffer(capacity=1000, wake_at=100)
    sink = JsonlSink(str(path), buffer, {S.META_RUN_ID: "r"}, dropped_row, batch_events=4, flush_ms=20)
    sink.start()
    for i in range(10):
        buffer.append(row(i))
    sink.close()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert lines[0]["kvfabric_stream"][S.META_RUN_ID] == "r"
    assert [x["block_id"] for x in lines[1:]] == list(range(10))
    assert [x["seq"] for x in lines[1:]] == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2]


def test_a_batch_that_cannot_be_encoded_is_counted_not_silently_dropped(tmp_path: Path) -> None:
    path = str(tmp_path / "e.sock")
    server = StreamServer(path)
    buffer = EventBuffer(capacity=1000, wake_at=1000)
    for i in range(10):
        buffer.append(row(i))
    bad = list(row(10))
    bad[S.EMIT_COLUMNS.index("block_id")] = "not a number"
    buffer.append(tuple(bad))
    sink = make_sink(path, buffer, batch=11)
    sink.start()
    for i in range(11, 20):
        buffer.append(row(i))
    sink.close()
    rows = server.rows()
    assert [r["block_id"] for r in rows if r["event"] != S.SINK_DROPPED] == list(range(11, 20))
    assert sum(r["count"] for r in rows if r["event"] == S.SINK_DROPPED) == 11 == sink.lost_events
    server.close()


@pytest.mark.parametrize("capacity", [1, 1000])
def test_buffer_never_exceeds_capacity(capacity: int) -> None:
    buffer = EventBuffer(capacity=capacity, wake_at=capacity)
    for i in range(2000):
        buffer.append(row(i))
    assert len(buffer) == capacity and buffer.dropped == 2000 - capacity and buffer.total == 2000
