"""A single-producer, single-consumer byte ring in shared memory: how records leave vLLM's process.

The scheduler thread (producer) copies one message per step into the ring; the forwarder process (consumer)
polls it. Neither side makes a system call or takes a lock to pass a message: the producer writes the bytes, then
publishes its write position; the consumer reads up to that position, then publishes its read position. So the
scheduler thread never waits, and there is no second thread in vLLM's process.

Memory: an anonymous ``memfd`` (no file name, freed when both processes close it), ``HEADER + capacity`` bytes,
passed to the child by file descriptor. Header, native 8-byte words at 8-byte offsets (single aligned loads and
stores on x86-64 and aarch64, so neither side ever reads a torn counter):

====  ==========================  ==============================================================
word  written by                  meaning
====  ==========================  ==============================================================
0     producer                    bytes written so far (monotonic)
1     consumer                    bytes consumed so far (monotonic)
2     consumer                    events expanded from consumed messages (monotonic)
3     consumer                    events accounted for: delivered, or lost and reported (monotonic)
4     producer                    1 once the producer is closing: drain, then exit
5     consumer                    the consumer's pid while it runs
====  ==========================  ==============================================================

Messages are ``<u32 length><payload>``; one that would cross the end of the data area is preceded by a wrap
marker (or by nothing, when fewer than 4 bytes are left) and starts at offset 0. Ordering: x86-64 keeps stores in
program order (TSO), so a published position never runs ahead of its bytes. (On weakly ordered CPUs a reader
could see a position before the bytes; the consumer then fails to decode, counts the message lost and resyncs.)

Invariants: the producer never overwrites unconsumed bytes (a message that does not fit is refused, and the
caller counts it); the consumer never reads past the published write position.
"""

from __future__ import annotations

import mmap
import os
import struct

HEADER = 64
_WORD = struct.Struct("=Q")
_LEN = struct.Struct("=I")
_WRAP = 0xFFFFFFFF

W_WRITE, W_READ, W_EXPANDED, W_ACCOUNTED, W_CLOSING, W_CONSUMER = range(6)


class Ring:
    """One end of the ring (both ends use the same class; each writes only its own words)."""

    def __init__(self, fd: int, capacity: int) -> None:
        self.fd = fd
        self.capacity = capacity
        self.mm = mmap.mmap(fd, HEADER + capacity, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._write = self.word(W_WRITE)  # the producer's own copy of its position
        self._read = self.word(W_READ)  # the consumer's own copy of its position
        self.refused = 0  # messages that did not fit (producer side)

    @classmethod
    def create(cls, capacity: int) -> Ring:
        """A new ring, all zeros (the producer's end); its fd is inheritable by a child process."""
        fd = os.memfd_create("kvfabric-ring", 0)
        os.ftruncate(fd, HEADER + capacity)
        os.set_inheritable(fd, True)
        return cls(fd, capacity)

    def word(self, i: int) -> int:
        return _WORD.unpack_from(self.mm, 8 * i)[0]

    def set_word(self, i: int, value: int) -> None:
        _WORD.pack_into(self.mm, 8 * i, value)

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
        self.set_word(W_WRITE, w)  # publish: the bytes above are already in place
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
        w = self.word(W_WRITE)
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
        self.set_word(W_READ, r)
        return payload

    def close(self) -> None:
        try:
            self.mm.close()
        finally:
            try:
                os.close(self.fd)
            except OSError:
                pass
