"""A file-like view of one sink connection that pyarrow's IPC stream reader reads from.

Why not ``sock.makefile()``: the reader asks for exactly the bytes of each IPC message (4-byte marker, 4-byte
length, metadata, body), and a message header can claim gigabytes. Reading through this class lets the collector

  * refuse a message larger than the batch byte cap *before* allocating it (``oversized``),
  * refuse a stream whose first bytes are not the IPC continuation marker (``garbage``) without reading on,
  * bound the handshake (schema within ``handshake_timeout_s``; ``handshake_timeout``) while letting an accepted
    stream stay idle for as long as it likes,
  * end a connection at a message boundary when the collector stops, or cut it after the drain deadline.

Invariant: a ``read(n)`` returns exactly ``n`` bytes unless the peer closed the connection (then fewer, and
:attr:`eof` is set); every other outcome is an exception. Only the connection's own thread calls :meth:`read`.
"""

from __future__ import annotations

import socket
import threading
import time

from kvfabric.ingest.errors import (
    GARBAGE,
    HANDSHAKE_TIMEOUT,
    OVERSIZED,
    BadStream,
    ShutdownCut,
    ShutdownRequested,
)

IPC_CONTINUATION = b"\xff\xff\xff\xff"
POLL_S = 0.2
"""Socket timeout slice: how often a blocked read wakes up to look at deadlines and the stop flag."""


class SocketSource:
    """Blocking reads of exact sizes from a connected socket, with caps and deadlines (see module docstring)."""

    def __init__(
        self,
        sock: socket.socket,
        *,
        max_read_bytes: int,
        handshake_timeout_s: float,
        stopping: threading.Event,
        drain_deadline: list[float],
    ) -> None:
        self._sock = sock
        self._max_read = max_read_bytes
        self._handshake_deadline = time.monotonic() + handshake_timeout_s
        self._handshake_timeout_s = handshake_timeout_s
        self._in_handshake = True
        self._stopping = stopping
        self._drain_deadline = drain_deadline  # shared one-element list, set by the server when it stops
        self.closed = False
        self.eof = False
        self.bytes_read = 0
        self.bytes_since_boundary = 0
        sock.settimeout(POLL_S)

    # -- state the connection loop drives -------------------------------------------------------------------
    def end_handshake(self) -> None:
        """The schema arrived: from now on the peer may stay idle indefinitely."""
        self._in_handshake = False

    def mark_boundary(self) -> None:
        """A whole message was consumed; stopping here loses nothing."""
        self.bytes_since_boundary = 0

    # -- the file protocol pyarrow uses ---------------------------------------------------------------------
    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def writable(self) -> bool:
        return False

    def tell(self) -> int:
        return self.bytes_read

    def close(self) -> None:
        self.closed = True

    def read(self, nbytes: int = -1) -> bytearray:
        if nbytes is None or nbytes < 0:
            raise ValueError("SocketSource only supports reads of an explicit size")
        if nbytes > self._max_read:
            raise BadStream(OVERSIZED, f"message of {nbytes} bytes exceeds the limit of {self._max_read}")
        if self._stopping.is_set() and self.bytes_since_boundary == 0 and time.monotonic() >= self._drain_deadline[0]:
            # A peer that never pauses still ends at the deadline, between two messages.
            raise ShutdownRequested()
        buf = bytearray(nbytes)
        view = memoryview(buf)
        got = 0
        while got < nbytes:
            try:
                n = self._sock.recv_into(view[got:], nbytes - got)
            except TimeoutError:
                self._on_idle(at_boundary=self.bytes_since_boundary == 0 and got == 0)
                continue
            except (ConnectionResetError, BrokenPipeError):
                n = 0
            if n == 0:
                self.eof = True
                break
            if self.bytes_read == 0 and got + n >= 4 and bytes(view[:4]) != IPC_CONTINUATION:
                raise BadStream(GARBAGE, f"stream does not start with the Arrow IPC marker (got {bytes(view[:4])!r})")
            got += n
        self.bytes_read += got
        self.bytes_since_boundary += got
        view.release()
        if got < nbytes:
            del buf[got:]
        return buf

    def _on_idle(self, *, at_boundary: bool) -> None:
        """Called every :data:`POLL_S` of silence: enforce the handshake deadline and the stop protocol."""
        now = time.monotonic()
        if self._stopping.is_set():
            if at_boundary:
                raise ShutdownRequested()
            if now >= self._drain_deadline[0]:
                raise ShutdownCut()
        if self._in_handshake and now >= self._handshake_deadline:
            raise BadStream(
                HANDSHAKE_TIMEOUT,
                f"no complete schema within {self._handshake_timeout_s:g} s ({self.bytes_read} bytes received)",
            )
