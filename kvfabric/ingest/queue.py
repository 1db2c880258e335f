"""The bounded hand-off between connection threads (producers) and the single DuckDB writer (consumer).

Bounded by rows *and* bytes so memory stays bounded whatever the batch shape: a producer that would exceed either
bound blocks in :meth:`BatchQueue.put` until the writer catches up. That block is the backpressure: the
connection stops reading, the kernel socket buffer fills, and the sink's own bounded buffer (which drops and
counts) takes over. One item larger than the bounds is still admitted when the queue is empty, so no batch that
passed validation can deadlock the pipeline.

Items are consumed in FIFO order, which is what makes per-stream sequence checks in the writer meaningful.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

import pyarrow as pa

from kvfabric.ingest.acks import AckChannel
from kvfabric.ingest.validate import BatchInfo, StreamMeta


@dataclass(frozen=True)
class StreamOpened:
    """A connection delivered a valid schema: the writer records (or refreshes) the stream's row. ``refresh``: the
    same connection learnt more of its metadata (a KV-event stream's block size, known from its first stored
    block): the row is updated without counting a connection."""

    meta: StreamMeta
    peer: str
    received_ns: int = field(default_factory=time.time_ns)
    rows: int = 0
    nbytes: int = 0
    refresh: bool = False


@dataclass(frozen=True)
class BatchReceived:
    """One validated record batch of ``stream_id``; ``ack`` is its connection's channel (protocol 2) or None."""

    stream_id: str
    batch: pa.RecordBatch
    info: BatchInfo
    received_ns: int = field(default_factory=time.time_ns)
    ack: AckChannel | None = field(default=None, compare=False)

    @property
    def rows(self) -> int:
        return self.info.rows

    @property
    def nbytes(self) -> int:
        return self.info.nbytes


@dataclass(frozen=True)
class BatchRefused:
    """A batch of ``stream_id`` refused for its content: the writer records it (its rows are counted, the stream's
    sequence advances past it) in order with the stream's other batches. ``seq`` is None when it was unreadable."""

    stream_id: str
    seq: int | None
    refused_rows: int
    reason: str
    received_ns: int = field(default_factory=time.time_ns)
    ack: AckChannel | None = field(default=None, compare=False)
    rows: int = 0  # holds no data: costs the queue nothing
    nbytes: int = 0


QueueItem = StreamOpened | BatchReceived | BatchRefused


class QueueClosed(Exception):
    """``put`` on a closed queue: the collector is shutting down and no longer accepts data."""


class BatchQueue:
    """FIFO of :data:`QueueItem` bounded by total rows and bytes (see module docstring)."""

    def __init__(self, max_rows: int, max_bytes: int) -> None:
        self._max_rows = max_rows
        self._max_bytes = max_bytes
        self._items: deque[tuple[float, QueueItem]] = deque()
        self._rows = 0
        self._bytes = 0
        self._closed = False
        self._cond = threading.Condition()

    @property
    def rows(self) -> int:
        """Rows waiting (not yet taken by the writer)."""
        return self._rows

    def put(self, item: QueueItem) -> None:
        """Append ``item``, blocking while the queue is over its bounds. Raises :class:`QueueClosed`."""
        with self._cond:
            while (
                not self._closed
                and self._items
                and (self._rows + item.rows > self._max_rows or self._bytes + item.nbytes > self._max_bytes)
            ):
                self._cond.wait()
            if self._closed:
                raise QueueClosed()
            self._items.append((time.monotonic(), item))
            self._rows += item.rows
            self._bytes += item.nbytes
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed

    def get_many(self, target_rows: int, window_s: float, timeout: float | None = None) -> list[QueueItem] | None:
        """Take items for one coalesced insert; None once the queue is closed and empty.

        Waits for a first item (at most ``timeout`` s, then returns ``[]``), then returns as soon as ``target_rows``
        are available or the *oldest* waiting item has waited ``window_s`` (so a writer that was busy does not add
        a second window of latency).
        """
        with self._cond:
            if timeout is None:
                while not self._items and not self._closed:
                    self._cond.wait()
            elif not self._items and not self._closed:
                self._cond.wait(timeout)
                if not self._items and not self._closed:
                    return []
            if not self._items:
                return None
            deadline = self._items[0][0] + window_s
            while self._rows < target_rows and not self._closed:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            taken: list[QueueItem] = []
            rows = 0
            while self._items and (not taken or rows + self._items[0][1].rows <= target_rows):
                _, item = self._items.popleft()
                taken.append(item)
                rows += item.rows
                self._rows -= item.rows
                self._bytes -= item.nbytes
            self._cond.notify_all()
            return taken

    def close(self) -> None:
        """No more puts; ``get_many`` drains what is left, then returns None."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
