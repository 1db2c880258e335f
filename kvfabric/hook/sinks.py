"""Sinks: the background thread that moves events from the hook's buffer to the collector (or a file).

Invariants:
  * all I/O happens on the sink thread; the scheduler only appends to the :class:`EventBuffer`;
  * every batch carries a per-stream sequence number ``seq`` (0, 1, 2, ... across reconnects of one stream id),
    so the collector sees lost batches as gaps and recognises resent ones;
  * nothing is lost silently: events that cannot be delivered (buffer full, a batch that cannot be encoded, the
    destination unreachable at shutdown) are counted, and the count is sent as a ``sink_dropped`` row in the next
    batch that goes out; a write that fails keeps its batch for the next attempt instead of discarding it;
  * while the destination is unreachable, rows stay in the bounded buffer (up to its capacity) and the sink retries
    with exponential backoff (0.1 s doubling to 5 s).

:class:`UnixArrowSink` speaks protocol 2 (kvfabric/protocol.py) and makes "delivered" mean *committed*: it checks
who listens on the socket before sending anything, sends nothing before the collector's HELLO, keeps every batch
until the collector acknowledges its commit (a bounded replay buffer, ``replay_events`` rows; when it is full the
sink waits and the hook's buffer absorbs, then drops and counts), resends unacknowledged batches in order after a
reconnect (the collector deduplicates on (stream id, seq)), and resets its backoff only once a batch is confirmed.
So a collector killed mid-stream and restarted loses nothing, and whatever does get lost is counted.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import select
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO

import pyarrow as pa

from kvfabric import protocol as P
from kvfabric import schema as S
from kvfabric.hook.buffer import EventBuffer

log = logging.getLogger("kvfabric.hook")

_ARROW_TYPES = [EVENT_FIELD.type for EVENT_FIELD in S.EVENT_SCHEMA][1:]  # seq excluded: stamped per batch


# Rows converted per slice before the sink thread hands the GIL back. vLLM's scheduler thread shares the GIL
# with this thread: one long conversion would stall it for up to the interpreter's 5 ms switch interval, which on a
# fast model is a whole engine step. Slices of 256 rows hold the GIL for ~0.1 ms at a time.
_SLICE_ROWS = 256


def rows_to_batch(rows: list[tuple], seq: int, schema: pa.Schema) -> pa.RecordBatch:
    """Transpose hook rows into one Arrow batch with a constant ``seq`` column, yielding the GIL between slices.

    Raises (``pa.ArrowException``, ``TypeError``, ``ValueError``) when a row does not fit the schema."""
    parts: list[list[pa.Array]] = [[] for _ in _ARROW_TYPES]
    for start in range(0, len(rows), _SLICE_ROWS):
        columns = zip(*rows[start : start + _SLICE_ROWS], strict=True)
        for part, col, typ in zip(parts, columns, _ARROW_TYPES, strict=True):
            part.append(pa.array(col, typ))
        time.sleep(0)  # releases the GIL: a waiting scheduler thread runs now, not after a switch interval
    arrays = [pa.array([seq] * len(rows), pa.int64())]
    arrays += [pa.concat_arrays(part) if len(part) > 1 else part[0] for part in parts]
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


_ENCODE_ERRORS = (pa.ArrowException, TypeError, ValueError, OverflowError)
"""A batch that raises one of these cannot be encoded at all: retrying would fail again, so it is counted lost."""


class Sink:
    """Base sink: the thread, batching, drop accounting. Subclasses implement ``_ready`` and ``_write``.

    ``_write`` raising ``OSError`` means "the destination failed": the batch is kept and retried (after
    ``_ready`` says the destination is back). Any other exception means the batch cannot be encoded: its events
    are counted lost (and reported in the next batch).
    """

    name = "none"

    def __init__(
        self,
        buffer: EventBuffer,
        metadata: dict[str, str],
        dropped_row: Callable[[int], tuple],
        batch_events: int = 4096,
        flush_ms: int = 100,
    ) -> None:
        self.buffer = buffer
        self.metadata = {S.META_STREAM_ID: uuid.uuid4().hex, **metadata}
        self.schema = S.stream_schema(self.metadata)
        self._dropped_row = dropped_row
        self.batch_events = batch_events
        self.flush_s = flush_ms / 1000.0
        self.seq = 0
        self.sent_events = 0  # hook events delivered
        self.sent_rows = 0  # rows delivered: events plus sink_dropped markers
        self.sent_batches = 0
        self.send_lost = 0  # events lost: batches that could not be encoded, or undeliverable at shutdown
        self.reported_lost = 0  # lost events already carried in a sink_dropped row that went out
        self._retry: tuple[list[tuple], int, int, int] | None = None  # (rows, seq, events, reported) of a failed write
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._flush_lock = threading.Lock()  # one flusher at a time (the thread, or close())
        self.on_progress: Callable[[], None] | None = None  # called after every batch delivered

    # ---- life cycle ------------------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"kvfabric-sink-{self.name}", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread and flush what is left (bounded by ``timeout``); idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self.buffer.wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._flush(final=True)
        self._close_output()

    @property
    def lost_events(self) -> int:
        """Every event that will never reach the destination (buffer overflow plus failed writes)."""
        return self.buffer.dropped + self.send_lost

    def accounted_events(self) -> int:
        """Events the destination has (delivered), plus lost events already reported in a delivered row."""
        return self.sent_events + self.reported_lost

    def _run(self) -> None:
        wakeup = self.buffer.wakeup
        while not self._stop.is_set():
            wakeup.wait(self.flush_s)
            wakeup.clear()
            try:
                self._flush(final=False)
            except Exception:  # the thread must survive anything a destination does
                log.exception("kvfabric: sink flush failed")

    # ---- batching --------------------------------------------------------------------------------------------

    def _flush(self, final: bool) -> None:
        with self._flush_lock:
            if not self._ready(final):
                if final:
                    self._abandon()
                return
            failed_once = False
            while True:  # one batch per round: memory and GIL hold stay bounded however deep the backlog
                if self._retry is not None:
                    rows, seq, n_events, pending = self._retry
                else:
                    pending = self.lost_events - self.reported_lost
                    batch = self._take_batch(self.batch_events, pending)
                    if batch is None:
                        return
                    rows, n_events = batch
                    seq = self.seq
                    self.seq += 1
                try:
                    self._write(rows, seq)
                except OSError as exc:
                    self._retry = (rows, seq, n_events, pending)  # kept: the next connection gets it
                    self._on_write_error(exc)
                    if failed_once or not self._ready(final):
                        if final:
                            self._abandon()
                        return  # retried on the next round
                    failed_once = True
                    continue
                except _ENCODE_ERRORS as exc:
                    self._retry = None
                    self._unencodable(n_events, exc)
                    continue
                self._retry = None
                self._count_sent(len(rows), n_events, pending)
                if self.on_progress is not None:
                    self.on_progress()

    def _take_batch(self, limit: int, pending: int) -> tuple[list[tuple], int] | None:
        """The next batch: a ``sink_dropped`` row for the ``pending`` lost events not yet reported (if any), then up
        to ``limit`` buffered rows. (rows, events among them), or None when there is nothing to send."""
        rows = self.buffer.drain(limit)
        if not rows and not pending:
            return None
        n_events = len(rows)
        if pending:
            rows.insert(0, self._dropped_row(pending))
        return rows, n_events

    def _unencodable(self, n_events: int, exc: Exception) -> None:
        """A batch that cannot be encoded at all (retrying would fail again): its events are counted lost."""
        self.send_lost += n_events
        log.error("kvfabric: sink %s cannot encode a batch of %d events (%s); they are counted lost",
                  self.name, n_events, exc)

    def _count_sent(self, rows: int, n_events: int, pending: int) -> None:
        """A batch of ``rows`` rows went out: ``n_events`` events, and a report of ``pending`` lost ones."""
        self.sent_events += n_events
        self.sent_rows += rows
        self.sent_batches += 1
        self.reported_lost += pending

    def _abandon(self) -> None:
        """Closing with the destination unreachable: everything still held is lost, and said so."""
        lost = len(self.buffer.drain())
        if self._retry is not None:
            lost += self._retry[2]
            self._retry = None
        self.send_lost += lost
        unreported = self.lost_events - self.reported_lost
        if unreported:
            log.warning("kvfabric: sink %s closed with the destination unreachable: %d events lost",
                        self.name, unreported)

    # ---- destination -----------------------------------------------------------------------------------------

    def _ready(self, final: bool) -> bool:
        return True

    def _write(self, rows: list[tuple], seq: int) -> None:
        """Deliver one batch or raise."""

    def _on_write_error(self, exc: Exception) -> None:
        log.warning("kvfabric: sink %s write failed: %s", self.name, exc)

    def _close_output(self) -> None:
        pass


class NullSink(Sink):
    """Discards events (counted as sent): recording without a destination, e.g. for overhead benchmarks."""

    name = "none"


DEFAULT_REPLAY_EVENTS = 262_144
"""Rows kept until the collector acknowledges their commit (~25 MB of Arrow at ~100 bytes a row; at the default
batch size, 64 batches, several hundred ms of the fastest streams measured)."""


_EOS = b"\xff\xff\xff\xff\x00\x00\x00\x00"  # Arrow IPC end-of-stream marker


@dataclass
class _Unacked:
    """A batch sent (or to be resent) and not yet acknowledged, kept as its encoded IPC message."""

    seq: int
    message: pa.Buffer
    rows: int  # rows in it (events plus a sink_dropped marker)
    events: int  # hook events in it
    reported: int  # lost events its sink_dropped row reports (0 if none)


class UnixArrowSink(Sink):
    """Arrow IPC stream over a Unix domain socket, protocol 2: acknowledged, replayed, deduplicated.

    See the module docstring. Counters: :meth:`accounted_events` (committed or refused-and-counted by the
    collector, plus losses reported in committed rows), ``acked_events``, ``refused_events``, ``lost_events``.
    """

    name = "unix"

    def __init__(
        self,
        path: str,
        *args: object,
        replay_events: int = DEFAULT_REPLAY_EVENTS,
        hello_timeout_s: float = 5.0,
        write_timeout_s: float = 10.0,
        **kwargs: object,
    ) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.metadata[P.META_PROTOCOL] = str(P.PROTOCOL_VERSION)
        self.schema = S.stream_schema(self.metadata)
        self.path = path
        self.replay_events = max(1, replay_events)
        self.hello_timeout_s = hello_timeout_s
        self.write_timeout_s = write_timeout_s
        self._sock: socket.socket | None = None  # connected, schema sent and HELLO received
        self._schema_message = self.schema.serialize()  # the stream's first IPC message
        self._decoder = P.AckDecoder()
        self._unacked: deque[_Unacked] = deque()
        self._unacked_rows = 0
        self._sent_upto = 0  # entries of _unacked already written on the current connection
        self._backoff = 0.1
        self._next_attempt = 0.0
        self._hello_seen = False  # this sink (process) has learnt its stream's committed position
        self._close_deadline = float("inf")
        self.connects = 0
        self.acked_events = 0  # events the collector committed (or recognised as already committed)
        self.acked_reported = 0  # lost events reported in sink_dropped rows the collector committed
        self.refused_events = 0  # events the collector refused and counted (never stored)
        self._warned = False

    # ---- accounting ------------------------------------------------------------------------------------------

    def accounted_events(self) -> int:
        """Events the collector has accounted for: committed, or refused and counted by it, plus lost events
        reported in a committed ``sink_dropped`` row. Never counts a batch merely written to the socket."""
        return self.acked_events + self.refused_events + self.acked_reported

    @property
    def unacked_events(self) -> int:
        return sum(e.events for e in self._unacked)

    # ---- life cycle ------------------------------------------------------------------------------------------

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread, send what is left and wait (up to ``timeout``) for the collector to acknowledge it;
        whatever is still unacknowledged then is counted lost and logged. Idempotent."""
        if self._stop.is_set():
            return
        deadline = time.monotonic() + timeout
        self._close_deadline = deadline + 0.5  # a HELLO wait during close must not outlast it
        self._stop.set()
        self.buffer.wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():  # stuck in a write to a collector that stopped reading: unblock it
                self._shutdown_socket()
                self._thread.join(1.0)
        with self._flush_lock:
            while time.monotonic() < deadline:
                self._flush_locked(final=True)
                if not self._unacked and not len(self.buffer) and self._retry is None:
                    break
                if self._sock is None:
                    time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
                    continue
                self._read_acks(min(0.05, max(0.0, deadline - time.monotonic())))
            self._give_up()
            self._close_output()

    def _shutdown_socket(self) -> None:
        sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _give_up(self) -> None:
        """Closing: rows never acknowledged are lost (they may still be committed later: then they are
        over-counted, never under-counted)."""
        lost = len(self.buffer.drain())
        for e in self._unacked:
            lost += e.events
            self.reported_lost -= e.reported  # their report did not get through either
        self._unacked.clear()
        self._unacked_rows = 0
        self._sent_upto = 0
        self.send_lost += lost
        unreported = self.lost_events - self.reported_lost
        if unreported:
            log.warning("kvfabric: sink %s closed with %d events not acknowledged by the collector at %s: counted "
                        "lost", self.name, unreported, self.path)

    # ---- the flush loop --------------------------------------------------------------------------------------

    def _flush(self, final: bool) -> None:
        with self._flush_lock:
            self._flush_locked(final)

    def _flush_locked(self, final: bool) -> None:
        if self._sock is None and not (len(self.buffer) or self._unacked or self.lost_events > self.reported_lost):
            return  # connect only with something to send: an idle hook holds no connection (nor a slot)
        if not self._ensure_connected(final):
            return
        while True:
            self._read_acks(0.0)
            if self._sock is None:
                return  # the connection died: reconnect on the next round (with backoff)
            if self._sent_upto < len(self._unacked):  # resend, in order, what the collector has not confirmed
                if not self._send(self._unacked[self._sent_upto].message):
                    return
                self._sent_upto += 1
                continue
            pending = self.lost_events - self.reported_lost
            room = self.replay_events - self._unacked_rows - (1 if pending else 0)  # rows, sink_dropped included
            if room <= 0 and self._unacked:
                # Wait for acknowledgements (briefly: close() may want the lock); meanwhile the hook's bounded
                # buffer absorbs, then drops and counts.
                self._read_acks(min(self.flush_s, 0.05))
                if self._unacked_rows >= self.replay_events - (1 if pending else 0):
                    return
                continue
            batch = self._take_batch(max(0, min(self.batch_events, room)), pending)
            if batch is None:
                return
            rows, n_events = batch
            seq = self.seq
            try:
                message = rows_to_batch(rows, seq, self.schema).serialize()
            except _ENCODE_ERRORS as exc:
                self._unencodable(n_events, exc)
                continue
            self.seq += 1
            self._unacked.append(_Unacked(seq, message, len(rows), n_events, pending))
            self._unacked_rows += len(rows)
            self._count_sent(len(rows), n_events, pending)
            if not self._send(message):
                return
            self._sent_upto += 1

    def _send(self, message: pa.Buffer | bytes) -> bool:
        assert self._sock is not None
        try:
            self._sock.sendall(message)
        except (OSError, ValueError) as exc:
            self._drop_connection(f"write failed: {exc}")
            return False
        return True

    # ---- connection ------------------------------------------------------------------------------------------

    def _ensure_connected(self, final: bool) -> bool:
        if self._sock is not None:
            return True
        now = time.monotonic()
        if now < self._next_attempt and not final:
            return False
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.write_timeout_s)  # a stuck collector must not wedge the sink thread forever
            sock.connect(self.path)
        except OSError as exc:
            sock.close()
            self._failed_attempt(f"unreachable ({exc})")
            return False
        why = P.untrusted_listener(P.peer_credentials(sock), self.path)
        if why is not None:  # checked before a single byte (even the metadata) goes out
            sock.close()
            self._failed_attempt(f"refused: {why}", level=logging.ERROR)
            return False
        # The schema goes out on its own (pyarrow's stream writer would hold it back until the first batch): the
        # collector answers it with HELLO, and no batch leaves before that answer.
        try:
            sock.sendall(self._schema_message)
        except OSError as exc:
            sock.close()
            self._failed_attempt(f"closed before the schema was sent ({exc})")
            return False
        self._sock = sock
        self._decoder = P.AckDecoder()
        hello = self._await_hello()
        if hello is None:
            self._drop_connection("no HELLO from the collector (connection limit, peer refused, shutting down, "
                                  "or a collector older than protocol 2)")
            return False
        if not self._hello_seen:
            # A new process adopting an existing stream id (a restarted forwarder) continues its numbering.
            self.seq = max(self.seq, hello + 1)
            self._hello_seen = True
        self._confirm_upto(hello)
        self._sent_upto = 0
        self.connects += 1
        if self._warned:
            log.warning("kvfabric: collector socket %s reachable again; resending %d unacknowledged batches",
                        self.path, len(self._unacked))
            self._warned = False
        return True

    def _await_hello(self) -> int | None:
        deadline = min(time.monotonic() + self.hello_timeout_s, self._close_deadline)
        while True:
            frames = self._recv_frames(max(0.0, deadline - time.monotonic()))
            if frames is None:
                return None
            for kind, value in frames:
                if kind == P.HELLO:
                    return value
            if time.monotonic() >= deadline:
                return None

    def _failed_attempt(self, why: str, level: int = logging.WARNING) -> None:
        self._next_attempt = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, 5.0)
        if not self._warned:
            log.log(level, "kvfabric: collector socket %s %s; retrying with backoff", self.path, why)
            self._warned = True

    def _drop_connection(self, why: str) -> None:
        """The connection is unusable: close it; unacknowledged batches are resent on the next one. The backoff
        keeps growing until a batch is confirmed, so a collector that accepts and breaks at once is not hammered."""
        self._close_output()
        self._sent_upto = 0
        self._failed_attempt(f"connection lost: {why}")

    # ---- acknowledgements ------------------------------------------------------------------------------------

    def _recv_frames(self, timeout: float) -> list[tuple[int, int]] | None:
        """Acknowledgement frames available within ``timeout`` (0: only those already here); None when the
        connection ended or broke."""
        sock = self._sock
        if sock is None:
            return None
        try:
            readable, _, _ = select.select([sock], [], [], timeout)
            if not readable:
                return []
            data = sock.recv(4096)
        except (OSError, ValueError):
            return None
        if not data:
            return None
        try:
            return self._decoder.feed(data)
        except P.ProtocolError as exc:
            log.error("kvfabric: collector socket %s: %s", self.path, exc)
            return None

    def _read_acks(self, timeout: float) -> None:
        frames = self._recv_frames(timeout)
        if frames is None:
            if self._sock is None:
                return
            if self._unacked:
                self._drop_connection("the collector closed the connection")
            else:  # e.g. closed while idle, or to make room: nothing is pending, reconnect when there is
                log.debug("kvfabric: collector closed an idle connection on %s", self.path)
                self._close_output()
                self._sent_upto = 0
            return
        progressed = False
        for kind, value in frames:
            if kind == P.COMMITTED:
                progressed |= self._confirm_upto(value)
            elif kind == P.REFUSED:
                progressed |= self._refused(value)
        if progressed:
            self._backoff = 0.1  # only a confirmed batch proves the collector works
            if self.on_progress is not None:
                self.on_progress()

    def _confirm_upto(self, seq: int) -> bool:
        popped = False
        while self._unacked and self._unacked[0].seq <= seq:
            e = self._unacked.popleft()
            self._unacked_rows -= e.rows
            self.acked_events += e.events
            self.acked_reported += e.reported
            self._sent_upto = max(0, self._sent_upto - 1)
            popped = True
        return popped

    def _refused(self, seq: int) -> bool:
        for i, e in enumerate(self._unacked):
            if e.seq == seq:
                del self._unacked[i]
                self._unacked_rows -= e.rows
                self.refused_events += e.events
                self.reported_lost -= e.reported  # its sink_dropped row was not stored: report those again
                if i < self._sent_upto:
                    self._sent_upto -= 1
                log.error("kvfabric: the collector refused batch %d (%d events, counted by the collector); see its "
                          "log", seq, e.events)
                return True
        return False

    def _close_output(self) -> None:
        """Close the connection; a clean end (the Arrow end-of-stream marker) when nothing is left unconfirmed."""
        sock, self._sock = self._sock, None
        if sock is None:
            return
        try:
            if not self._unacked:
                sock.sendall(_EOS)
        except OSError:
            pass
        try:
            sock.close()
        except OSError:
            pass


class JsonlSink(Sink):
    """One JSON object per event, appended to a file; the first line of each stream is its metadata."""

    name = "jsonl"

    def __init__(self, path: str, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.path = path
        self._file: IO[str] | None = None

    def _ready(self, final: bool) -> bool:
        if self._file is None:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")
            self._file.write(json.dumps({"kvfabric_stream": self.metadata}) + "\n")
        return True

    def _write(self, rows: list[tuple], seq: int) -> None:
        assert self._file is not None
        names = S.EMIT_COLUMNS
        dumps = json.dumps
        self._file.write(
            "".join(dumps({"seq": seq, **dict(zip(names, row, strict=True))}) + "\n" for row in rows)
        )
        self._file.flush()

    def _close_output(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
