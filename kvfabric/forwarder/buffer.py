"""The bounded in-memory event buffer between the forwarder's main loop and its sink thread.

Both run in the forwarder process: the main loop expands records and appends rows; the sink thread drains them.

Invariants:
  * ``append`` and ``extend`` are the only calls on the expanding path: one bound check and one ``deque.append``
    (or ``extend``, atomic under the GIL), no lock, no I/O, never raise;
  * at most ``capacity`` events are held; beyond that events are *counted* in ``dropped`` and discarded, so a slow
    or dead collector costs the main loop nothing but the count (the forwarder applies backpressure before this
    bound, so in practice the ring fills first and the engine counts what it cannot hand over);
  * ``drain`` pops from the other end of a ``deque`` (``append``/``popleft`` are atomic), so the sink thread takes
    rows while the main loop keeps appending, with no lock at all and no row lost between the two.
"""

from __future__ import annotations

import threading
from collections import deque


class EventBuffer:
    """Rows are tuples in :data:`kvfabric.contract.schema.EMIT_COLUMNS` order."""

    __slots__ = ("_rows", "capacity", "dropped", "total", "wake_at", "wakeup")

    def __init__(self, capacity: int, wake_at: int) -> None:
        self.capacity = capacity
        self.wake_at = wake_at  # the sink is woken when this many rows wait
        self._rows: deque[tuple] = deque()
        self.dropped = 0  # events lost because the buffer was full (monotonic)
        self.total = 0  # events ever offered (monotonic)
        self.wakeup = threading.Event()

    def append(self, row: tuple) -> None:
        self.total += 1
        rows = self._rows
        n = len(rows)
        if n >= self.capacity:
            self.dropped += 1
            return
        rows.append(row)
        if n + 1 == self.wake_at:
            self.wakeup.set()

    def extend(self, rows: list[tuple]) -> None:
        """``append`` for each of ``rows``, in one call (the forwarder's loop hands over a message's rows at once)."""
        n = len(rows)
        if not n:
            return
        self.total += n
        held = len(self._rows)
        room = max(0, self.capacity - held)
        if n > room:
            self.dropped += n - room
            rows = rows[:room]
        self._rows.extend(rows)
        if held < self.wake_at <= held + len(rows):
            self.wakeup.set()

    def drain(self, limit: int | None = None) -> list[tuple]:
        """Take the oldest buffered rows, at most ``limit`` (all when None; possibly none)."""
        rows = self._rows
        popleft = rows.popleft
        n = len(rows) if limit is None else min(limit, len(rows))
        return [popleft() for _ in range(n)]

    def __len__(self) -> int:
        return len(self._rows)
