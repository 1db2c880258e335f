"""Victim indexes: the data structures that order eviction candidates for a policy (the cache side of the split).

An index holds the *cached free* blocks (ref count 0, hash set) by block id. It never owns the blocks, it only
orders them; the caller (the hook's free queue, or the offline replay) keeps the truth about which blocks are free.

Operations and costs, ``n`` = candidates held:

=================  =====================  ==================================
operation          :class:`SegmentedIndex`  :class:`HeapIndex`
=================  =====================  ==================================
``add(b)``         O(1)                   O(log n)
``discard(b)``     O(1)                   O(1) (lazy deletion)
``pop()``          O(1) amortised         O(log n) amortised
=================  =====================  ==================================

Invariants:
  * a block is held at most once; ``discard`` of a block not held is a no-op; ``pop`` returns each held block
    once and forgets it;
  * **descendants before ancestors**: ``pop`` never returns a block while a child of it (a block sealed with it
    as parent, still holding that parent's hash) is held. Keys are clamped at ``add`` (a child never outranks a
    held parent) and ``pop`` descends from the chosen block to a held leaf below it, so the rule holds exactly
    even when a policy's keys are not monotone along a chain;
  * the logical clock ``now`` advances by one per block handed out (:meth:`tick`); it is what policies see.

The descent is O(1) per step and, with keys that are monotone along chains (every built-in policy's), it almost
never goes further than one step: a parent becomes a candidate after its children and with a key at least theirs.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import OrderedDict

from kvfabric.policies.base import EvictionPolicy, RequestInfo, TableOwner


class VictimIndex(ABC):
    """Common bookkeeping: membership, keys, parent links for the descendants-first rule, the clock."""

    def __init__(self, policy: EvictionPolicy, owner: TableOwner, num_blocks: int) -> None:
        self.policy = policy
        self.owner = owner
        self.num_blocks = num_blocks
        self.now = 0
        self.size = 0
        self.held = [False] * num_blocks
        self.keys: list[float] = [0.0] * num_blocks
        # Held children of each block (by block id), and the parent each held block is linked to (-1: none).
        self.kids: list[set[int] | None] = [None] * num_blocks
        self.link = [-1] * num_blocks
        self.descents = 0  # pops that had to walk below the chosen block (diagnostics)
        policy.bind(num_blocks)
        policy.bind_index(self)

    def __len__(self) -> int:
        return self.size

    def __contains__(self, b: int) -> bool:
        return self.held[b]

    def tick(self, n: int = 1) -> None:
        """``n`` blocks were handed out: the logical clock policies see."""
        self.now += n

    def _parent(self, t: object, b: int) -> int:
        """The block holding ``b``'s parent content, if it still does (its hash is ``b``'s parent hash)."""
        p = t.parent_block[b]  # type: ignore[attr-defined]
        if p < 0 or p == b:
            return -1
        ph = t.parent[b]  # type: ignore[attr-defined]
        if ph is None or t.hash[p] != ph:  # type: ignore[attr-defined]
            return -1  # the parent was evicted (and maybe reused) since: the link is dead
        return p

    def add(self, b: int, ctx: RequestInfo | None = None) -> float:
        """Block ``b`` became a cached free candidate (freed by the request ``ctx``, if any). Returns its key
        (already clamped under its parent's)."""
        held = self.held
        if held[b]:
            return self.keys[b]
        t = self.owner.table
        key = self.policy.key(t, b, self.now, ctx)
        # The parent link (inlined _parent: this is the per-block hot path).
        p = t.parent_block[b]
        if p >= 0 and (p == b or t.parent[b] is None or t.hash[p] != t.parent[b]):
            p = -1
        if p >= 0:
            if held[p] and self.keys[p] < key:
                key = self.keys[p]  # a child never outranks its held parent; ties go deeper-first (arrival order)
            kids = self.kids[p]
            if kids is None:
                self.kids[p] = {b}
            else:
                kids.add(b)
            self.link[b] = p
        held[b] = True
        self.keys[b] = key
        self.size += 1
        self._insert(b, key)
        return key

    def discard(self, b: int) -> bool:
        """Block ``b`` left the candidates (touched again, or no longer cached). Returns whether it was held."""
        if not self.held[b]:
            return False
        self.held[b] = False
        self.size -= 1
        p = self.link[b]
        if p >= 0:
            kids = self.kids[p]
            if kids is not None:
                kids.discard(b)
            self.link[b] = -1
        self._remove(b)
        return True

    def pop(self) -> int | None:
        """Take the next victim (a held leaf), or None when nothing is held."""
        b = self._peek()
        if b is None:
            return None
        kids = self.kids[b]
        if kids:
            self.descents += 1
            while kids:
                b = next(iter(kids))
                kids = self.kids[b]
        self.discard(b)
        return b

    def clear(self) -> None:
        for b in range(self.num_blocks):
            if self.held[b]:
                self.discard(b)

    @abstractmethod
    def _insert(self, b: int, key: float) -> None: ...

    @abstractmethod
    def _remove(self, b: int) -> None: ...

    @abstractmethod
    def _peek(self) -> int | None:
        """The held block with the lowest key (ties: earliest added), without removing it."""


class SegmentedIndex(VictimIndex):
    """FIFO segments (``key`` is the segment number, 0 evicted first): O(1) everything.

    With one segment this is exactly vLLM's LRU order for cached blocks (arrival order = free order, a request's
    blocks tail first).
    """

    def __init__(self, policy: EvictionPolicy, owner: TableOwner, num_blocks: int) -> None:
        super().__init__(policy, owner, num_blocks)
        self.segments: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(max(1, policy.num_segments))]
        self.segment_of = [0] * num_blocks
        self._last = len(self.segments) - 1

    def _insert(self, b: int, key: float) -> None:
        s = int(key)
        s = 0 if s < 0 else (self._last if s > self._last else s)
        self.segment_of[b] = s
        self.segments[s][b] = None

    def _remove(self, b: int) -> None:
        del self.segments[self.segment_of[b]][b]

    def _peek(self) -> int | None:
        for seg in self.segments:
            if seg:
                return next(iter(seg))
        return None

    def segment_sizes(self) -> list[int]:
        return [len(s) for s in self.segments]


class HeapIndex(VictimIndex):
    """A binary heap of ``(key, arrival, block)`` with lazy deletion: O(log n) add/pop, O(1) discard.

    Stale entries (discarded or re-added blocks) are skipped at the top and the heap is rebuilt when they
    outnumber live ones, so memory stays O(n) and every operation's amortised cost stays O(log n).
    """

    def __init__(self, policy: EvictionPolicy, owner: TableOwner, num_blocks: int) -> None:
        super().__init__(policy, owner, num_blocks)
        self.heap: list[tuple[float, int, int]] = []
        self.entry = [0] * num_blocks  # arrival number of the live entry of each block (0: none)
        self.arrivals = 0

    def _insert(self, b: int, key: float) -> None:
        self.arrivals += 1
        self.entry[b] = self.arrivals
        heapq.heappush(self.heap, (key, self.arrivals, b))
        if len(self.heap) > 2 * self.size + 1024:
            self._compact()

    def _remove(self, b: int) -> None:
        self.entry[b] = 0

    def _peek(self) -> int | None:
        heap = self.heap
        entry = self.entry
        while heap:
            _, arrival, b = heap[0]
            if entry[b] == arrival:
                return b
            heapq.heappop(heap)
        return None

    def _compact(self) -> None:
        entry = self.entry
        self.heap = [e for e in self.heap if entry[e[2]] == e[1]]
        heapq.heapify(self.heap)


def make_index(policy: EvictionPolicy, owner: TableOwner, num_blocks: int) -> VictimIndex:
    """The structure a policy asks for (its ``structure`` class attribute)."""
    if policy.structure == "segments":
        return SegmentedIndex(policy, owner, num_blocks)
    if policy.structure == "heap":
        return HeapIndex(policy, owner, num_blocks)
    raise ValueError(f"policy {policy.name!r} asks for an unknown structure {policy.structure!r}")
