"""A file-like view of one sink connection that pyarrow's IPC stream reader reads from.

Why not ``sock.makefile()``: the reader asks for exactly the bytes of each IPC message (4-byte marker, 4-byte
length, metadata, body), and a message header can claim hundreds of megabytes. Reading through this class lets the
collector

  * refuse a message larger than the batch byte cap before reading it (``oversized``), and never allocate what a
    peer only declared: room grows with the bytes that actually arrive, reserved from a budget shared by all
    connections (:class:`~kvfabric.ingest.budget.ByteBudget`);
  * refuse a stream whose first bytes are not the IPC continuation marker (``garbage``) without reading on;
  * bound every phase in time: the schema within ``handshake_timeout_s`` (``handshake_timeout``), each message
    within ``message_timeout_s`` of its first byte (``slow_message``: a peer trickling bytes or stalling inside a
    message), and the silence between messages to ``idle_timeout_s`` (closed as ``idle``, nothing lost);
  * close a quiet connection at a message boundary when the server needs its slot (``evicted``);
  * end a connection at a message boundary when the collector stops, or cut it after the drain deadline.

Invariant: a ``read(n)`` returns exactly ``n`` bytes unless the peer closed the connection (then fewer, and
:attr:`eof` is set); every other outcome is an exception. Only the connection's own thread calls :meth:`read`.
Deadlines are checked after every ``recv`` and every :data:`POLL_S` of silence, so a peer that sends one byte at a
time cannot outrun them.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

from kvfabric.ingest.budget import ByteBudget
from kvfabric.ingest.errors import (
    EVICTED,
    GARBAGE,
    HANDSHAKE_TIMEOUT,
    IDLE,
    OVERSIZED,
    SLOW_MESSAGE,
    BadStream,
    ConnectionClosed,
    ShutdownCut,
    ShutdownRequested,
)

IPC_CONTINUATION = b"\xff\xff\xff\xff"
POLL_S = 0.2
"""Socket timeout slice: how often a blocked read wakes up to look at deadlines and the stop flag."""
CHUNK = 1 << 20
"""Room is allocated (and budget reserved) at most this much ahead of the bytes that have arrived."""


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
        budget: ByteBudget | None = None,
        message_timeout_s: float = 30.0,
        idle_timeout_s: float = 300.0,
        on_poll: Callable[[], None] | None = None,
    ) -> None:
        self._sock = sock
        self._max_read = max_read_bytes
        now = time.monotonic()
        self._handshake_deadline = now + handshake_timeout_s
        self._handshake_timeout_s = handshake_timeout_s
        self._message_timeout_s = message_timeout_s
        self._idle_timeout_s = idle_timeout_s
        self._in_handshake = True
        self._stopping = stopping
        self._drain_deadline = drain_deadline  # shared one-element list, set by the server when it stops
        self._budget = budget
        self._reserved = 0
        self._on_poll = on_poll
        self.evict_requested = False  # set by the server (another thread) when it needs this connection's slot
        self.closed = False
        self.eof = False
        self.bytes_read = 0
        self.bytes_since_boundary = 0
        self.last_boundary = now  # monotonic time of the last whole message (or of the connect)
        self.message_started: float | None = None  # first byte of the message being read
        sock.settimeout(POLL_S)

    # -- state the connection loop drives -------------------------------------------------------------------
    @property
    def in_handshake(self) -> bool:
        return self._in_handshake

    @property
    def at_boundary(self) -> bool:
        return self.bytes_since_boundary == 0

    def end_handshake(self) -> None:
        """The schema arrived: from now on the idle and message deadlines apply instead of the handshake one."""
        self._in_handshake = False

    def mark_boundary(self) -> None:
        """A whole message was consumed; stopping here loses nothing. Its bytes go back to the budget."""
        self.bytes_since_boundary = 0
        self.message_started = None
        self.last_boundary = time.monotonic()
        self.release()

    def release(self) -> None:
        """Give every reserved byte back (at a boundary, and when the connection ends)."""
        if self._budget is not None and self._reserved:
            self._budget.release(self._reserved)
        self._reserved = 0

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

    def read(self, nbytes: int = -1) -> bytes | bytearray:
        if nbytes is None or nbytes < 0:
            raise ValueError("SocketSource only supports reads of an explicit size")
        if nbytes > self._max_read:
            raise BadStream(OVERSIZED, f"message of {nbytes} bytes exceeds the limit of {self._max_read}")
        if self._stopping.is_set() and self.at_boundary and time.monotonic() >= self._drain_deadline[0]:
            # A peer that never pauses still ends at the deadline, between two messages.
            raise ShutdownRequested()
        if nbytes <= CHUNK:
            buf = self._room(nbytes)
            got = self._fill(buf, 0)
            if got < nbytes:
                del buf[got:]
            return buf
        # A large message: room grows chunk by chunk as bytes arrive (a declared size costs nothing by itself).
        chunks: list[bytearray] = []
        total = 0
        while total < nbytes:
            chunk = self._room(min(CHUNK, nbytes - total))
            got = self._fill(chunk, total)
            total += got
            if got < len(chunk):
                del chunk[got:]
                chunks.append(chunk)
                break
            chunks.append(chunk)
        return b"".join(chunks)

    # -- internals ------------------------------------------------------------------------------------------
    def _room(self, nbytes: int) -> bytearray:
        """A buffer of ``nbytes``, reserved from the budget first (waiting for room within the deadlines)."""
        if self._budget is not None:
            while not self._budget.reserve(nbytes, POLL_S):
                self._check_deadlines(at_boundary=self.at_boundary, idle=True)
            self._reserved += nbytes
        return bytearray(nbytes)

    def _fill(self, buf: bytearray, offset: int) -> int:
        """recv into ``buf`` until full or end of stream; ``offset`` = bytes of this read already received."""
        view = memoryview(buf)
        got = 0
        size = len(buf)
        try:
            while got < size:
                at_boundary = self.at_boundary and got == 0 and offset == 0
                try:
                    n = self._sock.recv_into(view[got:], size - got)
                except TimeoutError:
                    self._check_deadlines(at_boundary=at_boundary, idle=True)
                    continue
                except (ConnectionResetError, BrokenPipeError):
                    n = 0
                if n == 0:
                    self.eof = True
                    break
                if self.bytes_read == 0 and offset + got + n >= 4 and bytes(view[:4]) != IPC_CONTINUATION:
                    raise BadStream(
                        GARBAGE, f"stream does not start with the Arrow IPC marker (got {bytes(view[:4])!r})"
                    )
                if self.message_started is None:
                    self.message_started = time.monotonic()
                got += n
                self.bytes_read += n
                self.bytes_since_boundary += n
                self._check_deadlines(at_boundary=False, idle=False)
        finally:
            view.release()
        return got

    def _check_deadlines(self, *, at_boundary: bool, idle: bool) -> None:
        """Enforce the handshake/message/idle deadlines, eviction and the stop protocol (see module docstring)."""
        now = time.monotonic()
        if idle and self._on_poll is not None:
            self._on_poll()
        if self._stopping.is_set():
            if at_boundary:
                raise ShutdownRequested()
            if now >= self._drain_deadline[0]:
                raise ShutdownCut()
        if self._in_handshake:
            if now >= self._handshake_deadline:
                raise BadStream(
                    HANDSHAKE_TIMEOUT,
                    f"no complete schema within {self._handshake_timeout_s:g} s ({self.bytes_read} bytes received)",
                )
            if self.evict_requested:  # no stream accepted yet, so nothing of it can be lost
                raise ConnectionClosed(EVICTED, "closed before its schema to make room for another connection")
            return
        if at_boundary:
            if self.evict_requested:
                raise ConnectionClosed(EVICTED, "closed while idle to make room for another connection")
            if now - self.last_boundary >= self._idle_timeout_s:
                raise ConnectionClosed(IDLE, f"closed after {self._idle_timeout_s:g} s without a message")
        elif self.message_started is not None and now - self.message_started >= self._message_timeout_s:
            raise BadStream(
                SLOW_MESSAGE,
                f"a message was not complete {self._message_timeout_s:g} s after its first byte "
                f"({self.bytes_since_boundary} bytes of it received)",
            )
