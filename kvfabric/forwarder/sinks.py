"""Sinks: the forwarder's background thread that moves event rows from its buffer to the collector (or a file).

Runs in the forwarder process (:mod:`kvfabric.forwarder`), never in vLLM's: the forwarder's main loop expands
records and appends rows to the :class:`~kvfabric.forwarder.buffer.EventBuffer`; the sink thread drains it.

Invariants:
  * all I/O happens on the sink thread; the forwarder's main loop only appends to the buffer;
  * every batch carries a per-stream sequence number ``seq`` (0, 1, 2, ... across reconnects of one stream id),
    so the collector sees lost batches as gaps and recognises resent ones;
  * nothing is lost silently: events that cannot be delivered (buffer full, a batch that cannot be encoded, the
    destination unreachable at shutdown) are counted, and the count is sent as a ``sink_dropped`` row in the next
    batch that goes out; a write that fails keeps its batch for the next attempt instead of discarding it;
  * while the destination is unreachable, rows stay in the bounded buffer (up to its capacity) and the sink retries
    with exponential backoff (0.1 s doubling to 5 s);
  * a failing destination is logged once, never once per flush (:class:`FailureLog`): one line naming the sink, its
    path and the reason, then at most one summary a minute (failures by reason, events dropped since the last
    line), and one line when it works again; every failure is counted (``Sink.failures``) whether logged or not.

:class:`UnixArrowSink` speaks protocol 2 (kvfabric/contract/protocol.py) and makes "delivered" mean *committed*: it
checks who listens on the socket before sending anything, sends nothing before the collector's HELLO, keeps every batch
until the collector acknowledges its commit (a bounded replay buffer, ``replay_events`` rows; when it is full the
sink waits and the forwarder's buffer absorbs, then drops and counts), resends unacknowledged batches in order after a
reconnect (the collector deduplicates on (stream id, seq)), and resets its backoff only once a batch is confirmed.
So a collector killed mid-stream and restarted loses nothing, and whatever does get lost is counted.
"""

from __future__ import annotations

import atexit
import errno
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

from kvfabric.contract import protocol as P
from kvfabric.contract import schema as S
from kvfabric.forwarder.buffer import EventBuffer

log = logging.getLogger("kvfabric.forwarder")

_ARROW_TYPES = [EVENT_FIELD.type for EVENT_FIELD in S.EVENT_SCHEMA][1:]  # seq excluded: stamped per batch


REPORT_EVERY_S = 60.0
"""While a destination keeps failing, at most one summary line per this many seconds."""


def os_reason(exc: OSError) -> str:
    """The failure reason (a short fixed word, see docs/metrics.md) of an ``OSError`` opening or writing a file."""
    e = exc.errno
    if e in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return "disk_full"
    if e in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "permission"
    if e in (errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EEXIST, errno.ENAMETOOLONG, errno.ELOOP):
        return "bad_path"
    return "io_error"


class FailureLog:
    """What a sink says while its destination fails: logged once, counted always.

    The first failure logs one line naming the sink, its path, the reason and the error; later ones are only
    counted until ``every_s`` has passed since the last line, and then summarised in one line (failures by reason,
    events dropped since the last line, events waiting); the first success after failures logs one line. A
    destination that fails again within ``every_s`` of the last line (one that flaps) starts no new line: its
    failures go into the next summary, and its recovery is not logged. So however often a sink flushes, a failing
    destination costs at most two lines, then one a minute; never a traceback per flush (an unexpected exception's
    traceback is logged once per sink).

    ``events()`` gives (events lost so far, events waiting); ``clock`` is injectable so tests can step through
    minutes without sleeping.
    """

    def __init__(self, what: str, events: Callable[[], tuple[int, int]],
                 clock: Callable[[], float] = time.monotonic, every_s: float = REPORT_EVERY_S) -> None:
        self.what = what
        self._events = events
        self.clock = clock
        self.every_s = every_s
        self.failures: dict[str, int] = {}  # every failure, by reason (monotonic)
        self.lines = 0  # lines logged
        self.failing = False
        self._announced = False  # this run of failures was announced (so its end is too)
        self._last_line: float | None = None
        self._since: dict[str, int] = {}  # failures by reason since the last line
        self._lost_mark = 0  # events lost as of the last line
        self._last_error = ""
        self._traced = False

    @property
    def total(self) -> int:
        return sum(self.failures.values())

    def failed(self, reason: str, error: str, *, level: int = logging.WARNING,
               exc: BaseException | None = None) -> None:
        """Count one failure; log it when it starts a run of failures or a summary is due."""
        self.failures[reason] = self.failures.get(reason, 0) + 1
        self._since[reason] = self._since.get(reason, 0) + 1
        self._last_error = error
        now = self.clock()
        due = self._last_line is None or now - self._last_line >= self.every_s
        trace = exc if exc is not None and not self._traced else None
        if not self.failing:
            self.failing = True
            self._announced = due
            if due:
                _, waiting = self._events()
                self._log(level, now, trace, "kvfabric: %s failed (%s): %s; events wait (%d now) up to a bound, "
                          "then are dropped and counted; further failures are summarised at most every %.0f s",
                          self.what, reason, error, waiting, self.every_s)
        elif due:
            self._summary(now, level, trace, "still failing")

    def recovered(self) -> None:
        """The destination took a batch: the run of failures (if any) is over."""
        if not self.failing:
            return
        self.failing = False
        if self._announced:
            lost, _ = self._events()
            self._log(logging.WARNING, self.clock(), None,
                      "kvfabric: %s works again after %d more failures; %d events dropped by this sink meanwhile "
                      "(all loss, this sink's and the ring's in vLLM's process, goes out in sink_dropped rows)",
                      self.what, sum(self._since.values()), lost - self._lost_mark)

    def close(self) -> None:
        """At shutdown: one last summary of failures not yet logged (if any)."""
        if self._since:
            self._summary(self.clock(), logging.WARNING, None, "closing")

    def _summary(self, now: float, level: int, trace: BaseException | None, state: str) -> None:
        lost, waiting = self._events()
        since = "never" if self._last_line is None else f"{now - self._last_line:.0f} s"
        by_reason = ", ".join(f"{r}: {n}" for r, n in sorted(self._since.items()))
        self._log(level, now, trace, "kvfabric: %s %s: %d failures in the last %s (%s), %d events dropped by this "
                  "sink since, %d waiting; last error: %s", self.what, state, sum(self._since.values()), since,
                  by_reason, lost - self._lost_mark, waiting, self._last_error)

    def _log(self, level: int, now: float, trace: BaseException | None, msg: str, *args: object) -> None:
        if trace is not None:
            self._traced = True
        log.log(level, msg, *args, exc_info=trace)
        self.lines += 1
        self._last_line = now
        self._since = {}
        self._lost_mark = self._events()[0]


# Rows converted per slice before the sink thread hands the GIL back. The forwarder's ring reader shares the GIL
# with this thread: one long conversion would stall it for up to the interpreter's 5 ms switch interval while the
# ring fills. Slices of 256 rows hold the GIL for ~0.1 ms at a time.
_SLICE_ROWS = 256


def rows_to_batch(rows: list[tuple], seq: int, schema: pa.Schema) -> pa.RecordBatch:
    """Transpose event rows into one Arrow batch with a constant ``seq`` column, yielding the GIL between slices.

    Raises (``pa.ArrowException``, ``TypeError``, ``ValueError``) when a row does not fit the schema."""
    parts: list[list[pa.Array]] = [[] for _ in _ARROW_TYPES]
    for start in range(0, len(rows), _SLICE_ROWS):
        columns = zip(*rows[start : start + _SLICE_ROWS], strict=True)
        for part, col, typ in zip(parts, columns, _ARROW_TYPES, strict=True):
            part.append(pa.array(col, typ))
        time.sleep(0)  # releases the GIL: the waiting ring reader runs now, not after a switch interval
    arrays = [pa.array([seq] * len(rows), pa.int64())]
    arrays += [pa.concat_arrays(part) if len(part) > 1 else part[0] for part in parts]
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


_ENCODE_ERRORS = (pa.ArrowException, TypeError, ValueError, OverflowError)
"""A batch that raises one of these cannot be encoded at all: retrying would fail again, so it is counted lost."""


class Sink:
    """Base sink: the thread, batching, drop accounting. Subclasses implement ``_ready`` and ``_write``.

    ``_write`` raising ``OSError`` means "the destination failed": the batch is kept and retried at the next flush
    (once ``_ready`` says the destination is back). Any other exception means the batch cannot be encoded: its
    events are counted lost (and reported in the next batch). Failures go to :attr:`failure_log` (logged once,
    counted always); ``clock`` is its clock (and the backoff's), injectable for tests.
    """

    name = "none"

    def __init__(
        self,
        buffer: EventBuffer,
        metadata: dict[str, str],
        dropped_row: Callable[[int], tuple],
        batch_events: int = 4096,
        flush_ms: int = 100,
        clock: Callable[[], float] = time.monotonic,
        report_every_s: float = REPORT_EVERY_S,
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
        self._clock = clock
        self.failure_log = FailureLog(self.describe(), lambda: (self.lost_events, self.waiting_events()), clock,
                                      report_every_s)

    def describe(self) -> str:
        """The sink and where it writes, as its log lines name it."""
        return f"{self.name} sink {getattr(self, 'path', '')}".rstrip()

    @property
    def failures(self) -> dict[str, int]:
        """Failures of the destination so far, by reason (docs/metrics.md lists the reasons)."""
        return self.failure_log.failures

    def waiting_events(self) -> int:
        """Events held for the destination: buffered, or in a batch kept for retry."""
        return len(self.buffer) + (self._retry[2] if self._retry is not None else 0)

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
        try:
            self._flush(final=True)
        except Exception as exc:  # never into the caller (atexit, the forwarder's exit)
            self._internal_error(exc)
        self._close_output()
        self.failure_log.close()

    @property
    def lost_events(self) -> int:
        """Every event that will never reach the destination (buffer overflow plus failed writes)."""
        return self.buffer.dropped + self.send_lost

    def accounted_events(self) -> int:
        """Events the destination has (delivered), plus lost events already reported in a delivered row."""
        return self.sent_events + self.reported_lost

    def handed_events(self) -> int:
        """Events handed to the destination (plus lost events reported in rows handed to it): accounted for, or
        sent and not yet confirmed. Minus :meth:`accounted_events`, what a sink that dies now may have delivered
        without knowing it (0 for a sink whose write is its delivery)."""
        return self.sent_events + self.reported_lost

    def _run(self) -> None:
        wakeup = self.buffer.wakeup
        while not self._stop.is_set():
            self._idle(wakeup)
            wakeup.clear()
            try:
                self._flush(final=False)
            except Exception as exc:  # the thread must survive anything a destination does
                self._internal_error(exc)

    def _idle(self, wakeup: threading.Event) -> None:
        """Between flushes: until ``flush_s`` has passed or the buffer wakes the thread."""
        wakeup.wait(self.flush_s)

    def _internal_error(self, exc: Exception) -> None:
        """A flush raised what no destination should: counted and logged like a failure (its traceback once)."""
        self.failure_log.failed("internal", f"{type(exc).__name__}: {exc}", level=logging.ERROR, exc=exc)

    # ---- batching --------------------------------------------------------------------------------------------

    def _flush(self, final: bool) -> None:
        with self._flush_lock:
            if not self._ready(final):
                if final:
                    self._abandon()
                return
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
                    self._retry = (rows, seq, n_events, pending)  # kept: the next flush retries it
                    self._on_write_error(exc)
                    if final:
                        self._abandon()
                    return
                except _ENCODE_ERRORS as exc:
                    self._retry = None
                    self._unencodable(n_events, exc)
                    continue
                self._retry = None
                self._count_sent(len(rows), n_events, pending)
                self.failure_log.recovered()
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
        self.failure_log.failed("unencodable", f"a batch of {n_events} events cannot be encoded ({exc}); they are "
                                "counted lost", level=logging.ERROR)

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

    def _on_write_error(self, exc: OSError) -> None:
        self.failure_log.failed(os_reason(exc), f"cannot write: {exc}")

    def _close_output(self) -> None:
        pass


class NullSink(Sink):
    """Discards events (counted as sent): recording without a destination, e.g. for overhead benchmarks."""

    name = "none"


DEFAULT_REPLAY_EVENTS = 262_144
"""Rows kept until the collector acknowledges their commit (~25 MB of Arrow at ~100 bytes a row; at the default
batch size, 64 batches, several hundred ms of the fastest streams measured)."""


ACK_POLL_S = 0.01
"""While batches wait for their acknowledgement, the idle sink thread reads the socket for it in slices this
long, checking between them whether the buffer woke it: acknowledgements are read as they arrive."""


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
        self.path = path
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.metadata[P.META_PROTOCOL] = str(P.PROTOCOL_VERSION)
        self.schema = S.stream_schema(self.metadata)
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
        self._protocol_error: str | None = None  # why the last read of acknowledgements failed, if it was garbage

    # ---- accounting ------------------------------------------------------------------------------------------

    def accounted_events(self) -> int:
        """Events the collector has accounted for: committed, or refused and counted by it, plus lost events
        reported in a committed ``sink_dropped`` row. Never counts a batch merely written to the socket."""
        return self.acked_events + self.refused_events + self.acked_reported

    def _idle(self, wakeup: threading.Event) -> None:
        """Between flushes, while batches wait for their acknowledgement: read acknowledgements as they arrive
        (each publishes the accounting, ``on_progress``), checking the buffer's wakeup every ``ACK_POLL_S``.
        Otherwise an acknowledgement would wait for the next flush (``flush_s``, however long it is) and a
        forwarder killed meanwhile would leave events the collector committed counted as lost."""
        deadline = time.monotonic() + self.flush_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or self._stop.is_set():
                return
            if not self._unacked or self._sock is None:
                wakeup.wait(left)
                return
            if wakeup.is_set():
                return
            with self._flush_lock:  # held at most ACK_POLL_S: close() takes it next
                if self._unacked and self._sock is not None:
                    self._read_acks(min(left, ACK_POLL_S))

    @property
    def unacked_events(self) -> int:
        return sum(e.events for e in self._unacked)

    def waiting_events(self) -> int:
        return len(self.buffer) + self.unacked_events

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
        self.failure_log.close()

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
        if final and self._sock is None and not (len(self.buffer) or self._unacked
                                                 or self.lost_events > self.reported_lost):
            return  # closing, nothing to send. Otherwise connected even while idle: the collector lists engines
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
            if self.on_progress is not None:
                self.on_progress()  # handed_events() reaches the ring's header before the bytes leave
            if not self._send(message):
                return
            self._sent_upto += 1

    def _send(self, message: pa.Buffer | bytes) -> bool:
        assert self._sock is not None
        try:
            self._sock.sendall(message)
        except (OSError, ValueError) as exc:
            self._drop_connection("connection_lost", f"write failed: {exc}")
            return False
        return True

    # ---- connection ------------------------------------------------------------------------------------------

    def _ensure_connected(self, final: bool) -> bool:
        if self._sock is not None:
            return True
        now = self._clock()
        if now < self._next_attempt and not final:
            return False
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.write_timeout_s)  # a stuck collector must not wedge the sink thread forever
            sock.connect(self.path)
        except OSError as exc:
            sock.close()
            reason = "permission" if exc.errno in (errno.EACCES, errno.EPERM) else "unreachable"
            self._failed_attempt(reason, f"cannot connect to the collector: {exc}")
            return False
        why = P.untrusted_listener(P.peer_credentials(sock), self.path)
        if why is not None:  # checked before a single byte (even the metadata) goes out
            sock.close()
            self._failed_attempt("untrusted_listener", f"nothing sent: {why}", level=logging.ERROR)
            return False
        # The schema goes out on its own (pyarrow's stream writer would hold it back until the first batch): the
        # collector answers it with HELLO, and no batch leaves before that answer.
        try:
            sock.sendall(self._schema_message)
        except OSError as exc:
            sock.close()
            self._failed_attempt("connection_lost", f"closed before the schema was sent ({exc})")
            return False
        self._sock = sock
        self._decoder = P.AckDecoder()
        self._protocol_error = None
        hello = self._await_hello()
        if hello is None:
            if self._protocol_error is not None:
                self._drop_connection("protocol_error", self._protocol_error)
            else:
                self._drop_connection("no_hello", "no HELLO from the collector (connection limit, peer refused, "
                                      "shutting down, or a collector older than protocol 2)")
            return False
        if not self._hello_seen:
            # A new process adopting an existing stream id (a restarted forwarder) continues its numbering.
            self.seq = max(self.seq, hello + 1)
            self._hello_seen = True
        self._confirm_upto(hello)
        self._sent_upto = 0
        self.connects += 1
        self.failure_log.recovered()  # the collector answered (the backoff waits for a confirmed batch)
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

    def _failed_attempt(self, reason: str, error: str, level: int = logging.WARNING) -> None:
        """One failed attempt: back off (0.1 s doubling to 5 s), count and maybe log it (FailureLog)."""
        self._next_attempt = self._clock() + self._backoff
        self._backoff = min(self._backoff * 2, 5.0)
        self.failure_log.failed(reason, f"{error}; retrying with backoff", level=level)

    def _drop_connection(self, reason: str, why: str) -> None:
        """The connection is unusable: close it; unacknowledged batches are resent on the next one. The backoff
        keeps growing until a batch is confirmed, so a collector that accepts and breaks at once is not hammered."""
        self._close_output()
        self._sent_upto = 0
        self._failed_attempt(reason, f"connection lost: {why}")

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
            self._protocol_error = str(exc)  # the caller drops the connection, naming this as the reason
            return None

    def _read_acks(self, timeout: float) -> None:
        frames = self._recv_frames(timeout)
        if frames is None:
            if self._sock is None:
                return
            if self._protocol_error is not None:
                self._drop_connection("protocol_error", self._protocol_error)
            elif self._unacked:
                self._drop_connection("connection_lost", "the collector closed the connection")
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
            self.failure_log.recovered()
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
                self.failure_log.failed("refused_batch", f"the collector refused batch {seq} ({e.events} events, "
                                        "counted by the collector; see its log)", level=logging.ERROR)
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
    """One JSON object per event, appended to a file; the first line of each stream is its metadata.

    There is no collector here, so the file is where loss is reported. A file that cannot be opened or written
    (a bad path, no permission, a full disk) is retried at every flush while rows wait in the bounded buffer, as for
    a collector that is away; the failure is logged once, then summarised (:class:`FailureLog`). A write that
    stopped part way (a full disk) resumes where it stopped, so no line is written twice or cut. Events dropped
    meanwhile (the buffer full, or the ring in vLLM's process) are counted, and the count is written as a
    ``sink_dropped`` row as soon as writing works again.
    """

    name = "jsonl"

    def __init__(self, path: str, *args: object, **kwargs: object) -> None:
        self.path = path
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._file: IO[bytes] | None = None
        # Bytes not yet written, in order: the stream's first line, then the rest of a batch a failure interrupted.
        self._pending = bytearray(json.dumps({"kvfabric_stream": self.metadata}).encode() + b"\n")
        self._pending_seq: int | None = None  # the batch whose unwritten rest is in _pending

    def _ready(self, final: bool) -> bool:
        if self._file is None:
            try:
                os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
                self._file = open(self.path, "ab", buffering=0)  # kept open for the stream
            except OSError as exc:
                self.failure_log.failed(os_reason(exc), f"cannot open: {exc}")
                return False
        return True

    def _write(self, rows: list[tuple], seq: int) -> None:
        if self._pending_seq != seq:  # not a retry of the batch whose rest is pending: encode it
            names = S.EMIT_COLUMNS
            dumps = json.dumps
            self._pending += "".join(
                dumps({"seq": seq, **dict(zip(names, row, strict=True))}) + "\n" for row in rows
            ).encode()
            self._pending_seq = seq
        self._write_pending()
        self._pending_seq = None

    def _write_pending(self) -> None:
        """Write ``_pending`` out; on ``OSError`` keep what was not written, and raise."""
        assert self._file is not None
        done = 0
        try:
            while done < len(self._pending):
                with memoryview(self._pending) as view, view[done:] as rest:  # released even if a traceback holds it
                    done += self._file.write(rest) or 0
        finally:
            del self._pending[:done]

    def _abandon(self) -> None:
        super()._abandon()
        if self._pending_seq is not None:  # the interrupted batch is counted lost: do not write its rest
            self._pending.clear()
            self._pending_seq = None

    def _close_output(self) -> None:
        if self._file is not None:
            try:
                if self._pending and self._pending_seq is None:
                    self._write_pending()  # the first line of a stream that had no events
            except OSError:
                pass
            try:
                self._file.close()
            except OSError:
                pass
            self._file = None
