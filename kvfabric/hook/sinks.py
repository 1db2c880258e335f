"""Sinks: the background thread that moves events from the hook's buffer to the collector (or a file).

Invariants:
  * all I/O happens on the sink thread; the scheduler only appends to the :class:`EventBuffer`;
  * every batch carries a per-stream sequence number ``seq`` (0, 1, 2, ... across reconnects of one stream id),
    so the collector sees lost batches as gaps;
  * nothing is lost silently: events that cannot be delivered (buffer full, collector down at shutdown, a write
    that failed) are counted, and the count is sent as a ``sink_dropped`` row in the next batch that goes out;
  * while the collector is unreachable, rows stay in the bounded buffer (up to its capacity) and the sink retries
    with exponential backoff (0.1 s doubling to 5 s), so a collector that starts late or restarts loses nothing.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import IO

import pyarrow as pa

from kvfabric import schema as S
from kvfabric.hook.buffer import EventBuffer

log = logging.getLogger("kvfabric.hook")

_ARROW_TYPES = [EVENT_FIELD.type for EVENT_FIELD in S.EVENT_SCHEMA][1:]  # seq excluded: stamped per batch


# Rows converted per slice before the sink thread hands the GIL back. vLLM's scheduler thread shares the GIL
# with this thread: one long conversion would stall it for up to the interpreter's 5 ms switch interval, which on a
# fast model is a whole engine step. Slices of 256 rows hold the GIL for ~0.1 ms at a time.
_SLICE_ROWS = 256


def rows_to_batch(rows: list[tuple], seq: int, schema: pa.Schema) -> pa.RecordBatch:
    """Transpose hook rows into one Arrow batch with a constant ``seq`` column, yielding the GIL between slices."""
    parts: list[list[pa.Array]] = [[] for _ in _ARROW_TYPES]
    for start in range(0, len(rows), _SLICE_ROWS):
        columns = zip(*rows[start : start + _SLICE_ROWS], strict=True)
        for part, col, typ in zip(parts, columns, _ARROW_TYPES, strict=True):
            part.append(pa.array(col, typ))
        time.sleep(0)  # releases the GIL: a waiting scheduler thread runs now, not after a switch interval
    arrays = [pa.array([seq] * len(rows), pa.int64())]
    arrays += [pa.concat_arrays(part) if len(part) > 1 else part[0] for part in parts]
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


class Sink:
    """Base sink: the thread, batching, drop accounting. Subclasses implement ``_ready`` and ``_write``."""

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
        self.send_lost = 0  # events lost in writes that failed or at shutdown
        self.reported_lost = 0  # lost events already reported in a sink_dropped row that went out
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
                    lost = len(self.buffer.drain())
                    self.send_lost += lost
                    if self.lost_events - self.reported_lost:
                        log.warning(
                            "kvfabric: sink %s closed with the destination unreachable: %d events lost",
                            self.name, self.lost_events - self.reported_lost,
                        )
                return
            while True:  # one batch per round: memory and GIL hold stay bounded however deep the backlog
                rows = self.buffer.drain(self.batch_events)
                pending = self.lost_events - self.reported_lost
                if not rows and not pending:
                    return
                n_events = len(rows)
                if pending:
                    rows.insert(0, self._dropped_row(pending))
                seq = self.seq
                self.seq += 1
                try:
                    self._write(rows, seq)
                except Exception as exc:
                    self.send_lost += n_events
                    self._on_write_error(exc)
                    if not self._ready(final):
                        return  # what is still buffered waits for the next attempt (or is counted at close)
                    continue
                self.sent_events += n_events
                self.sent_rows += len(rows)
                self.sent_batches += 1
                self.reported_lost += pending
                if self.on_progress is not None:
                    self.on_progress()

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


class UnixArrowSink(Sink):
    """Arrow IPC stream over a Unix domain socket, one stream per connection, reconnecting with backoff."""

    name = "unix"

    def __init__(self, path: str, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.path = path
        self._sock: socket.socket | None = None
        self._file: IO[bytes] | None = None
        self._writer: pa.ipc.RecordBatchStreamWriter | None = None
        self._backoff = 0.1
        self._next_attempt = 0.0
        self.connects = 0
        self._warned = False

    def _ready(self, final: bool) -> bool:
        if self._writer is not None:
            return True
        now = time.monotonic()
        if now < self._next_attempt and not final:
            return False
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(5.0)  # a stuck collector must not wedge the sink thread forever
            sock.connect(self.path)
            f = sock.makefile("wb")
            self._writer = pa.ipc.new_stream(f, self.schema)
            self._sock, self._file = sock, f
        except OSError as exc:
            self._close_output()
            self._next_attempt = now + self._backoff
            self._backoff = min(self._backoff * 2, 5.0)
            if not self._warned:
                log.warning("kvfabric: collector socket %s unreachable (%s); retrying with backoff", self.path, exc)
                self._warned = True
            return False
        self._backoff = 0.1
        self._warned = False
        self.connects += 1
        return True

    def _write(self, rows: list[tuple], seq: int) -> None:
        assert self._writer is not None and self._file is not None
        self._writer.write_batch(rows_to_batch(rows, seq, self.schema))
        self._file.flush()

    def _on_write_error(self, exc: Exception) -> None:
        super()._on_write_error(exc)
        self._close_output()
        self._next_attempt = time.monotonic() + self._backoff

    def _close_output(self) -> None:
        writer, f, sock = self._writer, self._file, self._sock
        self._writer = self._file = self._sock = None
        for closer in (writer, f, sock):
            if closer is None:
                continue
            try:
                closer.close()
            except Exception:  # closing a broken stream may fail again; nothing left to save
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
