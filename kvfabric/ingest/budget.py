"""The memory all connections together may hold in partly received messages.

A message header may declare up to the batch byte cap (256 MiB by default); the collector never allocates what a
peer merely *declares*: a connection reserves bytes from this budget just before it allocates room for bytes that
are arriving, and gives them back once the message is whole (it is then a record batch, bounded by the writer
queue). A peer that cannot get budget waits, and is cut when its message deadline passes, so peers that start
messages and stall cannot keep the budget forever.
"""

from __future__ import annotations

import threading


class ByteBudget:
    """A counter of reserved bytes with an upper bound; ``reserve`` waits at most ``timeout`` for room."""

    def __init__(self, limit: int) -> None:
        if limit <= 0:
            raise ValueError("the byte budget must be positive")
        self.limit = limit
        self._held = 0
        self._cond = threading.Condition()

    @property
    def held(self) -> int:
        return self._held

    def reserve(self, nbytes: int, timeout: float) -> bool:
        """Take ``nbytes`` if the total stays within the limit, waiting up to ``timeout`` s; False if not."""
        with self._cond:
            if self._held + nbytes > self.limit:
                self._cond.wait(timeout)
                if self._held + nbytes > self.limit:
                    return False
            self._held += nbytes
            return True

    def release(self, nbytes: int) -> None:
        if nbytes <= 0:
            return
        with self._cond:
            self._held -= nbytes
            self._cond.notify_all()
