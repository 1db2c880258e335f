"""A single-producer, single-consumer byte ring in shared memory: how records leave vLLM's process.

The scheduler thread (producer) copies one message per step into the ring; the forwarder process (consumer)
polls it. Neither side makes a system call or takes a lock to pass a message: the producer writes the bytes, then
publishes its write position; the consumer reads up to that position, then publishes its read position. So the
scheduler thread never waits, and there is no second thread in vLLM's process.

Memory: an anonymous ``memfd`` (no file name, freed when both processes close it), ``HEADER + capacity`` bytes,
passed to the child by file descriptor. Header, native 8-byte words at 8-byte offsets (single aligned loads and
stores, so neither side ever reads a torn counter), each loaded with acquire and stored with release ordering:

====  ==========================  ==============================================================
word  written by                  meaning
====  ==========================  ==============================================================
0     producer                    bytes written so far (monotonic); stored after those bytes
1     consumer                    bytes consumed so far (monotonic); stored after they are copied
2     consumer                    events expanded from consumed messages (monotonic)
3     consumer                    events accounted for: delivered, or lost and reported (monotonic)
4     producer                    1 once the producer is closing: drain, then exit
5     consumer                    the consumer's pid while it runs
6     consumer                    events handed to the destination: accounted for, or sent (written to
                                  the collector's socket) and not yet acknowledged; stored before the
                                  bytes leave. Word 6 minus word 3 bounds what a dead consumer may have
                                  had stored although its parent counts it lost (docs/reliability.md §1)
====  ==========================  ==============================================================

Messages are ``<u32 length><payload>``; one that would cross the end of the data area is preceded by a wrap
marker (or by nothing, when fewer than 4 bytes are left) and starts at offset 0.

Ordering: a position is stored with *release* ordering after the bytes it covers are written (the read position:
after they are copied out), and loaded with *acquire* ordering before those bytes are read (or overwritten). So a
consumer that sees a write position sees the bytes below it, and a producer that sees a read position never
overwrites bytes still being copied out, on any CPU. Two ways to get it (:data:`ORDERINGS`):

==========  ==============================================  ========================================================
ordering    header loads and stores                         used
==========  ==============================================  ========================================================
compiled    ``__atomic_load_n(ACQUIRE)`` and                wherever ``_ring.c`` is built (``KVFABRIC_NATIVE`` does
            ``__atomic_store_n(RELEASE)``, in ``_ring.c``   not apply: this is correctness, not speed)
python      ``struct``: CPython's native ``Q`` is one       otherwise, on x86-64 only: TSO keeps loads and stores in
            8-byte ``memcpy``, one aligned ``mov``          program order, which is all the ring needs
==========  ==============================================  ========================================================

Without the compiled part on a CPU other than x86-64 (aarch64, ppc64le: stores may become visible out of order),
:meth:`Ring.create` raises :class:`RingUnavailable` (an ``OSError``): the hook says so in one log line and sends
no events, rather than let a consumer read bytes that are not there yet. Tested on x86-64, both orderings, with a
producer and a consumer process on two cores (``tests/contract/test_ring.py``); on aarch64 the acquire/release
pairing is the C11 memory model's guarantee, not run.

Invariants: the producer never overwrites unconsumed bytes (a message that does not fit is refused, and the
caller counts it); the consumer never reads past the published write position; each word has one writer.
"""

from __future__ import annotations

import mmap
import os
import platform
import struct
from collections.abc import Callable

try:
    from kvfabric.contract._ring import load_acquire, store_release
except ImportError:  # (no C compiler at install time)
    load_acquire = store_release = None  # type: ignore[assignment]

HEADER = 64
_WORD = struct.Struct("=Q")
_LEN = struct.Struct("=I")
_WRAP = 0xFFFFFFFF

W_WRITE, W_READ, W_EXPANDED, W_ACCOUNTED, W_CLOSING, W_CONSUMER, W_SENT = range(7)

COMPILED = load_acquire is not None
"""Whether the install built the compiled ordering (``kvfabric/contract/_ring.c``)."""
TSO = platform.machine().lower() in ("x86_64", "amd64")
"""Whether this CPU keeps loads and stores in program order with atomic 8-byte words (x86-64): the Python
ordering is correct here, and only here."""
ORDERINGS = ("compiled", "python")


class RingUnavailable(OSError):
    """No ordering this machine can pass messages with (see the module docstring); the hook sends no events."""


def _python_load(mm: mmap.mmap, offset: int) -> int:
    return _WORD.unpack_from(mm, offset)[0]


def _python_store(mm: mmap.mmap, offset: int, value: int) -> None:
    _WORD.pack_into(mm, offset, value)


def ordering_for(requested: str | None = None) -> str:
    """The ordering a ring uses: ``requested`` (tests pin one), else the compiled one where built, else Python's;
    :class:`RingUnavailable` when that one is not correct (or not built) here."""
    ordering = requested or ("compiled" if COMPILED else "python")
    if ordering == "compiled" and not COMPILED:
        raise RingUnavailable("the ring's compiled part (kvfabric/contract/_ring.c) is not built")
    if ordering == "python" and not TSO:
        raise RingUnavailable(
            f"the ring's Python ordering is not correct on {platform.machine()} (not x86-64: plain stores may be "
            "seen out of order) and its compiled part (kvfabric/contract/_ring.c) is needed: reinstall KVFabric with a "
            "C compiler")
    if ordering not in ORDERINGS:
        raise ValueError(f"ordering {ordering!r} is not one of {ORDERINGS}")
    return ordering


class Ring:
    """One end of the ring (both ends use the same class; each writes only its own words).

    ``ordering``: ``"compiled"`` or ``"python"`` (see the module docstring); None picks as :func:`ordering_for`.
    """

    def __init__(self, fd: int, capacity: int, ordering: str | None = None) -> None:
        self.ordering = ordering_for(ordering)
        self._load: Callable[[mmap.mmap, int], int]
        self._store: Callable[[mmap.mmap, int, int], None]
        if self.ordering == "compiled":
            self._load, self._store = load_acquire, store_release  # type: ignore[assignment]
        else:
            self._load, self._store = _python_load, _python_store
        self.fd = fd
        self.capacity = capacity
        self.mm = mmap.mmap(fd, HEADER + capacity, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._write = self.word(W_WRITE)  # the producer's own copy of its position
        self._read = self.word(W_READ)  # the consumer's own copy of its position
        self.refused = 0  # messages that did not fit (producer side)

    @classmethod
    def create(cls, capacity: int, ordering: str | None = None) -> Ring:
        """A new ring, all zeros (the producer's end); its fd is inheritable by a child process.
        :class:`RingUnavailable` (before any fd is made) where no ordering is correct."""
        ordering = ordering_for(ordering)
        fd = os.memfd_create("kvfabric-ring", 0)
        try:
            os.ftruncate(fd, HEADER + capacity)
            os.set_inheritable(fd, True)
            return cls(fd, capacity, ordering)
        except BaseException:
            os.close(fd)
            raise

    def word(self, i: int) -> int:
        """Header word ``i``, loaded with acquire ordering."""
        return self._load(self.mm, 8 * i)

    def set_word(self, i: int, value: int) -> None:
        """Header word ``i``, stored with release ordering (only by the end that owns it)."""
        self._store(self.mm, 8 * i, value)

    # ---- producer --------------------------------------------------------------------------------------------

    def write(self, payload: bytes) -> bool:
        """Append one message; False (nothing written) when it does not fit in the free space."""
        n = len(payload)
        cap = self.capacity
        need = 4 + n
        w = self._write
        off = w % cap
        room = cap - off
        pad = room if room < need else 0
        if need + pad > cap - (w - self.word(W_READ)):
            self.refused += 1
            return False
        mm = self.mm
        if pad:
            if room >= 4:
                _LEN.pack_into(mm, HEADER + off, _WRAP)
            w += pad
            off = 0
        _LEN.pack_into(mm, HEADER + off, n)
        mm[HEADER + off + 4 : HEADER + off + 4 + n] = payload
        w += need
        self._write = w
        self.set_word(W_WRITE, w)  # publish (release): the bytes above are seen first
        return True

    def used(self) -> int:
        """Bytes written and not yet consumed."""
        return self._write - self.word(W_READ)

    # ---- consumer --------------------------------------------------------------------------------------------

    def take_over_reading(self) -> None:
        """Become the consumer (the producer, after its consumer exited, reads what is left to count it)."""
        self._read = self.word(W_READ)

    def read(self) -> bytes | None:
        """The next message, or None when the ring is empty. Publishes the new read position."""
        w = self.word(W_WRITE)  # acquire: the bytes below w are in place
        r = self._read
        if r >= w:
            return None
        cap = self.capacity
        mm = self.mm
        off = r % cap
        room = cap - off
        if room < 4:
            r += room
            off = 0
        else:
            (n,) = _LEN.unpack_from(mm, HEADER + off)
            if n == _WRAP:
                r += room
                off = 0
        (n,) = _LEN.unpack_from(mm, HEADER + off)
        payload = bytes(mm[HEADER + off + 4 : HEADER + off + 4 + n])
        r += 4 + n
        self._read = r
        self.set_word(W_READ, r)  # release: the copy above is done before the producer may overwrite
        return payload

    def close(self) -> None:
        try:
            self.mm.close()
        finally:
            try:
                os.close(self.fd)
            except OSError:
                pass
