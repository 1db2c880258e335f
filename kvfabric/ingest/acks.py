"""The collector's side of protocol 2 (kvfabric/contract/protocol.py): acknowledgements written back to one connection.

Invariants:
  * nothing here ever blocks: frames are written with non-blocking ``os.write`` on the connection's socket (its fd
    is non-blocking because the connection reads with a timeout); what the kernel does not take waits in a small
    outbox that the connection thread retries every poll;
  * ``COMMITTED`` values are coalesced (only the newest matters), so a peer that does not read its
    acknowledgements costs one integer, not a growing queue; ``REFUSED`` frames are few (one per refused batch)
    and bounded by :data:`MAX_OUTBOX`: past it the peer is cut (``acks_not_read``);
  * frames leave in the order the events happened: a ``REFUSED seq`` is never overtaken by a ``COMMITTED`` of a
    later batch (the sink would otherwise count the refused batch as committed);
  * after :meth:`AckChannel.close` (called by the connection thread before it closes the socket, under the same
    lock) nothing touches the file descriptor again, so a recycled descriptor can never receive a stray frame.
"""

from __future__ import annotations

import os
import socket
import threading

from kvfabric.contract import protocol as P

MAX_OUTBOX = 64 * 1024


class AckChannel:
    """Acknowledgements for one protocol-2 connection (see module docstring)."""

    def __init__(self, sock: socket.socket) -> None:
        self._fd = sock.fileno()
        self._lock = threading.Lock()
        self._out = bytearray()
        self._committed: int | None = None  # newest COMMITTED value not yet in the outbox
        self._last_sent_committed = -1
        self._closed = False
        self.stalled = False  # the outbox outgrew MAX_OUTBOX: the peer does not read
        self.broken = False  # the peer closed its end

    def hello(self, last_seq: int) -> None:
        with self._lock:
            self._out += P.encode_ack(P.HELLO, last_seq)
            self._flush_locked()

    def refused(self, seq: int) -> None:
        with self._lock:
            self._encode_committed_locked()
            self._out += P.encode_ack(P.REFUSED, seq)
            self._flush_locked()

    def committed(self, seq: int) -> None:
        """Every batch of this connection up to ``seq`` is accounted for (called by the writer after COMMIT)."""
        with self._lock:
            if seq > max(self._last_sent_committed, self._committed if self._committed is not None else -1):
                self._committed = seq
            self._flush_locked()

    def flush(self) -> None:
        """Retry what the kernel did not take (the connection thread calls this every poll)."""
        with self._lock:
            self._flush_locked()

    def close(self) -> None:
        with self._lock:
            self._closed = True

    def _encode_committed_locked(self) -> None:
        if self._committed is not None:
            self._out += P.encode_ack(P.COMMITTED, self._committed)
            self._last_sent_committed = self._committed
            self._committed = None

    def _flush_locked(self) -> None:
        if self._closed:
            return
        if not self._send_locked():
            return
        if self._committed is not None:  # only once the outbox drained: a non-reading peer costs one integer
            self._encode_committed_locked()
            self._send_locked()
        if len(self._out) > MAX_OUTBOX:
            self.stalled = True

    def _send_locked(self) -> bool:
        """Write as much of the outbox as the kernel takes; True when it is empty."""
        while self._out:
            try:
                n = os.write(self._fd, self._out)
            except (BlockingIOError, InterruptedError):
                return False
            except OSError:  # the peer went away: the connection thread sees the end of stream itself
                self.broken = True
                self._out.clear()
                return False
            del self._out[:n]
        return True
