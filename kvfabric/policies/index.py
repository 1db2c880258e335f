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
    held parent), and a block that reaches the top while children of it are held is *deferred*: set aside, and
    put back in its place (same key, same arrival) when its last held child leaves. So the rule holds exactly
    even when a policy's keys are not monotone along a chain;
  * the logical clock ``now`` advances by one per block handed out (:meth:`tick`); it is what policies see.

Blocks arrive a call at a time (vLLM frees a request's blocks in one ``append_n``), so the index takes them the
same way: :meth:`~VictimIndex.add_many` asks the policy for all their keys in one call
(:meth:`~kvfabric.policies.base.EvictionPolicy.keys`), and :meth:`~VictimIndex.pop_n` hands out several victims
per call. A parent knows only how many of its children are held (a count, not a set: nothing is allocated per
block). Deferral is rare: vLLM frees a request's blocks tail first, and a block is freed only when its last user
lets go, a user holding the block's whole prefix; so a parent becomes a candidate after its children and, with keys
monotone along chains (every built-in policy's), ranks after them.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import OrderedDict, deque
from collections.abc import Sequence
from itertools import groupby
from operator import itemgetter

from kvfabric.contract.records import expand_report
from kvfabric.policies.base import BlockStats, EvictionPolicy, RequestInfo, TableOwner


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
        # The parent each held block is linked to (-1: none), how many held children link to each block, and
        # whether a held block is set aside (out of the ordering structure) until those children leave.
        self.link = [-1] * num_blocks
        self.nkids = [0] * num_blocks
        self.deferred = [False] * num_blocks
        self.descents = 0  # times a block reached the top with held children and was set aside (diagnostics)
        self.restores = 0  # deferred blocks put back (a run taken before one may no longer be in order)
        policy.bind(num_blocks)
        policy.bind_index(self)

    #: Whether the ordering structure must be told of blocks that leave it (:meth:`_remove_many`); one that
    #: deletes lazily (:class:`HeapIndex`) is not.
    REMOVES = True

    def __len__(self) -> int:
        return self.size

    def __contains__(self, b: int) -> bool:
        return self.held[b]

    def tick(self, n: int = 1) -> None:
        """``n`` blocks were handed out: the logical clock policies see."""
        self.now += n

    def add(self, b: int, ctx: RequestInfo | None = None) -> float:
        """Block ``b`` became a cached free candidate (freed by the request ``ctx``, if any). Returns its key
        (already clamped under its parent's); a block already held keeps its key."""
        if self.held[b]:
            return self.keys[b]
        return self.add_many([b], ctx)[1][0]

    def add_many(self, ids: list[int], ctx: RequestInfo | None = None,
                 parents: list[int] | None = None) -> tuple[list[int], list[float]]:
        """Blocks ``ids`` (distinct) became candidates together, in this order, freed by ``ctx``. Returns the
        blocks added (those of ``ids`` not held already, in order) and their keys, clamped under held parents'.

        ``parents``: the block holding each one's parent content (-1: none), when the caller knows it (the hook
        does, from the order of a request's free); otherwise the links come from the table (``parent_block``,
        checked against ``parent`` and ``hash``)."""
        held = self.held
        if any(map(held.__getitem__, ids)):
            if parents is not None:
                parents = [p for b, p in zip(ids, parents, strict=True) if not held[b]]
            ids = [b for b in ids if not held[b]]
        if not ids:
            return ids, []
        t = self.owner.table
        keys = self.policy.keys(t, ids, self.now, ctx)
        self._place(ids, keys, self._table_parents(t, ids) if parents is None else parents)
        return ids, keys

    def _place(self, ids: list[int], keys: list[float], parents: list[int]) -> None:
        """Hold blocks ``ids`` (none held) with ``keys`` (clamped here, in place, under held parents' keys) and
        ``parents`` (-1: none), in this order."""
        held = self.held
        own = self.keys
        link = self.link
        nkids = self.nkids
        for i, b in enumerate(ids):
            p = parents[i]
            if p >= 0:
                if held[p] and own[p] < keys[i]:
                    keys[i] = own[p]  # a child never outranks its held parent; ties go deeper-first
                link[b] = p
                nkids[p] += 1
            held[b] = True
            own[b] = keys[i]
        self.size += len(ids)
        self._insert_many(ids, keys)

    @staticmethod
    def _table_parents(t: BlockStats, ids: list[int]) -> list[int]:
        """The block holding each of ``ids``' parent content, from the table (-1: none). A dead link (the parent
        was evicted, and maybe reused, since: its hash is no longer the child's parent hash) is no link."""
        parent_block = t.parent_block
        parent = t.parent
        hashes = t.hash
        head = ids[1:]
        # The usual free: one request's blocks, tail first, each sealed right after the next one (so that one holds
        # its parent content: they are the same request's consecutive blocks). Only the chain's own parent, outside
        # this call, needs checking then.
        chain = bool(head) and [parent_block[b] for b in ids[:-1]] == head
        live = [p if p >= 0 and p != b and parent[b] is not None and hashes[p] == parent[b] else -1
                for b in (ids[-1:] if chain else ids) for p in (parent_block[b],)]
        return head + live if chain else live

    def add_reported(self, ids: list[int], ctx: RequestInfo | None = None) -> tuple[list[int], list[float],
                                                                                 list[bool]]:
        """:meth:`add_many`, then the policy's retain scores and protection flags of the blocks added, written to
        the table's ``score`` / ``protected`` (what eviction reports read). Returns (blocks added, scores, flags)."""
        ids, keys = self.add_many(ids, ctx)
        if not ids:
            return ids, [], []
        t = self.owner.table
        scores, flags = expand_report(ids, *self.policy.report(t, ids, keys, self.now))
        t.score_all(ids, scores, flags)
        return ids, scores, flags

    def discard(self, b: int) -> bool:
        """Block ``b`` left the candidates (touched again, or no longer cached). Returns whether it was held."""
        if not self.held[b]:
            return False
        self.discard_all((b,))
        return True

    def discard_all(self, ids: Sequence[int]) -> None:
        """:meth:`discard` of each of ``ids`` (blocks in use again: a prefix-cache hit touched them). One loop for
        the bookkeeping, one call for the ordering structure (this runs once per touch on vLLM's scheduler
        thread)."""
        held = self.held
        deferred = self.deferred
        link = self.link
        nkids = self.nkids
        removes = self.REMOVES
        placed: list[int] = []  # held blocks in the ordering structure (a deferred one is set aside from it)
        orphaned: list[int] = []  # deferred parents whose last held child left here: they go back, below
        gone = 0
        for b in ids:
            if not held[b]:
                continue
            held[b] = False
            gone += 1
            if deferred[b]:
                deferred[b] = False
            elif removes:
                placed.append(b)
            p = link[b]
            if p >= 0:  # (:meth:`_unlink`, without a call per touched block)
                link[b] = -1
                nkids[p] -= 1
                if not nkids[p] and deferred[p]:
                    orphaned.append(p)
        self.size -= gone
        if placed:
            self._remove_many(placed)
        for p in orphaned:
            if deferred[p] and not nkids[p]:  # (one discarded here too is no longer deferred)
                self._unlink_done(p)

    def _unlink(self, b: int) -> bool:
        """``b`` (linked to a parent) is no longer held: the parent has one held child fewer, and a deferred parent
        goes back in its place at none. Returns whether one did."""
        p = self.link[b]
        self.link[b] = -1
        self.nkids[p] -= 1
        if self.nkids[p] or not self.deferred[p]:
            return False
        self._unlink_done(p)
        return True

    def _unlink_done(self, p: int) -> None:
        """Deferred ``p``'s last held child left: it goes back in its place."""
        self.deferred[p] = False
        self.restores += 1
        self._restore(p)

    def pop(self) -> int | None:
        """Take the next victim (a held leaf), or None when nothing is held."""
        got = self.pop_n(1)
        return got[0] if got else None

    def pop_n(self, n: int) -> list[int]:
        """Take up to ``n`` victims, lowest key first (ties: earliest added), never a block with held children;
        fewer only when fewer are held.

        The structure hands out *runs* (:meth:`_take_run`): blocks it knows to come next in order, taken in one
        call. A victim's leaving may put a deferred parent back (its last held child left); the parent may rank
        before the rest of the run, so that rest goes back (:meth:`_put_back`) and the next run is taken afresh."""
        out: list[int] = []
        nkids = self.nkids
        held = self.held
        link = self.link
        deferred = self.deferred
        while len(out) < n:
            run = self._take_run(n - len(out))
            if not run:
                break
            for i, b in enumerate(run):
                if nkids[b]:
                    deferred[b] = True  # back in its place when its last held child leaves
                    self.descents += 1
                    continue
                held[b] = False
                out.append(b)
                if link[b] >= 0 and self._unlink(b):
                    self._put_back(run[i + 1:])
                    break
        self.size -= len(out)
        return out

    def clear(self) -> None:
        for b in range(self.num_blocks):
            if self.held[b]:
                self.discard(b)

    @abstractmethod
    def _insert_many(self, ids: list[int], keys: list[float]) -> None:
        """Put newly held blocks into the ordering structure, behind those already there (ties: arrival order)."""

    @abstractmethod
    def _remove_many(self, ids: list[int]) -> None:
        """Take held blocks ``ids`` out of the ordering structure."""

    @abstractmethod
    def _take_run(self, limit: int) -> list[int]:
        """Take the block with the lowest key (ties: earliest added) out of the ordering structure, and up to
        ``limit`` (>= 1) in all of those that come right after it in order, lowest first (the caller decides
        whether each leaves or is deferred); empty when the structure is empty."""

    def _put_back(self, run: list[int]) -> None:
        """Undo :meth:`_take_run` for ``run`` (a tail of what it returned, not yet handed out): same keys, same
        arrivals. Default: through :meth:`_restore` (what a deferred block takes)."""
        for b in run:
            self._restore(b)

    @abstractmethod
    def _restore(self, b: int) -> None:
        """Put deferred block ``b`` back in its place (its key and arrival unchanged)."""


class SegmentedIndex(VictimIndex):
    """FIFO segments (``key`` is the segment number, 0 evicted first): O(1) everything.

    With one segment this is exactly vLLM's LRU order for cached blocks (arrival order = free order, a request's
    blocks tail first). A deferred block, once restored, waits in a small heap by (segment, arrival) beside the
    segments, so it keeps its place exactly.
    """

    def __init__(self, policy: EvictionPolicy, owner: TableOwner, num_blocks: int) -> None:
        super().__init__(policy, owner, num_blocks)
        self.segments: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(max(1, policy.num_segments))]
        self.segment_of = [0] * num_blocks
        self._last = len(self.segments) - 1
        self.entry = [0] * num_blocks  # arrival number of each held block
        self.arrivals = 0
        self.restored: list[tuple[int, int, int]] = []  # (segment, arrival, block) of restored deferred blocks
        self.is_restored = [False] * num_blocks

    def _insert_many(self, ids: list[int], keys: list[float]) -> None:
        last = self._last
        segments = self.segments
        segment_of = self.segment_of
        entry = self.entry
        arrival = self.arrivals
        for b, key in zip(ids, keys, strict=True):
            s = int(key)
            s = 0 if s < 0 else (last if s > last else s)
            segment_of[b] = s
            segments[s][b] = None
            arrival += 1
            entry[b] = arrival
        self.arrivals = arrival

    def _remove_many(self, ids: list[int]) -> None:
        is_restored = self.is_restored
        segments = self.segments
        segment_of = self.segment_of
        for b in ids:
            if is_restored[b]:
                is_restored[b] = False  # its heap entry is skipped when it reaches the top
            else:
                del segments[segment_of[b]][b]

    def _take_run(self, limit: int) -> list[int]:
        # One block at a time: a segment's FIFO order can interleave with the restored blocks' heap.
        restored = self.restored
        while restored and not self.is_restored[restored[0][2]]:
            heapq.heappop(restored)
        for s, seg in enumerate(self.segments):
            if seg:
                b = next(iter(seg))
                if restored and restored[0][:2] < (s, self.entry[b]):
                    break
                seg.popitem(last=False)
                return [b]
        if restored:
            b = heapq.heappop(restored)[2]
            self.is_restored[b] = False
            return [b]
        return []

    def _restore(self, b: int) -> None:
        self.is_restored[b] = True
        heapq.heappush(self.restored, (self.segment_of[b], self.entry[b], b))

    def segment_sizes(self) -> list[int]:
        return [len(s) for s in self.segments]


class HeapIndex(VictimIndex):
    """Lowest ``(key, arrival)`` first: a few FIFO *lanes* for runs of non-decreasing keys, and a binary heap for
    the rest. O(log n) add/pop, O(1) discard.

    Keys usually arrive nearly sorted (a recency term ``now`` grows with every block handed out; a request's blocks
    share one key), so most blocks join the end of a lane: the lane whose last key is the largest one not above
    theirs (patience sorting; a lane keeps its keys in arrival order and non-decreasing, so its head is its
    minimum). At most :attr:`LANES` lanes exist; a block that fits none goes to the heap. ``pop`` takes the least
    of the lanes' heads and the heap's top.

    Deletion is lazy everywhere: a lane entry is one int, ``arrival * num_blocks + block``, and a heap entry carries
    the arrival too; an entry stands for its block only while the block is held with that arrival (``entry``), so
    a discard writes nothing here (most candidates are touched again before they could be evicted: a conversation's
    next turn) and stale entries are skipped when they reach a head. When, after an add, entries outnumber four times
    the pool (plus a constant), they are rebuilt away (:meth:`_compact`): memory stays O(pool), as the index's
    per-block lists are, and a rebuild visits few live entries per stale one it drops (at most a quarter of what it
    visits is live).
    """

    #: Lanes at most. Each one costs a comparison per add and per pop; keys with a recency term need two or three
    #: (e.g. protected and unprotected blocks), keys with no order between arrivals fall through to the heap.
    LANES = 4

    def __init__(self, policy: EvictionPolicy, owner: TableOwner, num_blocks: int) -> None:
        super().__init__(policy, owner, num_blocks)
        self.heap: list[tuple[float, int, int]] = []
        self.entry = [0] * num_blocks  # arrival number of each held block (what its live entry carries)
        self.arrivals = 0
        self.entries = 0  # entries in the lanes and the heap, live or stale
        self.lanes: list[deque[int]] = []  # entries ``arrival * num_blocks + block``, arrival order
        self.tails: list[float] = []  # the last key added to each lane (-inf: the lane is empty)

    def _insert_many(self, ids: list[int], keys: list[float]) -> None:
        entry = self.entry
        lanes = self.lanes
        tails = self.tails
        nb = self.num_blocks
        arrival = self.arrivals
        # A run of equal keys (a free's blocks of one class: often all of them) goes to one place.
        for key, run in groupby(zip(ids, keys, strict=True), _second):
            # Best fit: the lane whose last key is the largest one not above this key.
            lane = -1
            best = -_INF
            for i, tail in enumerate(tails):
                if best <= tail <= key and (lane < 0 or tail > best):
                    lane, best = i, tail
            if lane < 0 and len(lanes) < self.LANES:
                lanes.append(deque())
                tails.append(-_INF)
                lane = len(lanes) - 1
            if lane >= 0:
                append = lanes[lane].append
                for b, _ in run:
                    arrival += 1
                    entry[b] = arrival
                    append(arrival * nb + b)
                tails[lane] = key
            else:
                heap = self.heap
                for b, _ in run:
                    arrival += 1
                    entry[b] = arrival
                    heapq.heappush(heap, (key, arrival, b))
        self.entries += arrival - self.arrivals
        self.arrivals = arrival
        if self.entries > 4 * self.num_blocks + 64:
            self._compact()

    REMOVES = False  # (lazy: a block's entries no longer match once it left, and are skipped at the heads)

    def _remove_many(self, ids: list[int]) -> None:
        pass

    def _least_head(self) -> tuple[int, int, float, float]:
        """The held block with the lowest ``(key, arrival)`` at the heads (stale heads dropped on the way):
        (block, its lane or -1 for the heap, and the second least head's key and arrival, +inf when none); block -1
        when nothing is held."""
        heap = self.heap
        entry = self.entry
        held = self.held
        while heap and not (held[heap[0][2]] and entry[heap[0][2]] == heap[0][1]):
            heapq.heappop(heap)
            self.entries -= 1
        keys = self.keys
        nb = self.num_blocks
        best = -1
        lane = -1
        best_key = best_arrival = 0.0
        if heap:
            best_key, best_arrival, best = heap[0]
        bound_key = bound_arrival = _INF
        for i, seg in enumerate(self.lanes):
            while seg:
                a, b = divmod(seg[0], nb)
                if held[b] and entry[b] == a:
                    break
                seg.popleft()
                self.entries -= 1
            else:
                self.tails[i] = -_INF
                continue
            k = keys[b]
            if best < 0 or k < best_key or (k == best_key and a < best_arrival):
                if best >= 0:
                    bound_key, bound_arrival = best_key, best_arrival
                best, best_key, best_arrival, lane = b, k, a, i
            elif k < bound_key or (k == bound_key and a < bound_arrival):
                bound_key, bound_arrival = k, a
        return best, lane, bound_key, bound_arrival

    def pop(self) -> int | None:
        """:meth:`pop_n` of one, without its lists: the eviction path's usual call (vLLM allocates a decoding
        request's blocks one at a time). A head with held children takes :meth:`pop_n`'s way (it is deferred)."""
        best, lane, _, _ = self._least_head()
        if best < 0:
            return None
        if self.nkids[best]:
            return super().pop()
        if lane < 0:
            heapq.heappop(self.heap)
        else:
            seg = self.lanes[lane]
            seg.popleft()
            if not seg:
                self.tails[lane] = -_INF
        self.entries -= 1
        self.held[best] = False
        self.size -= 1
        if self.link[best] >= 0:
            self._unlink(best)  # (a deferred parent it puts back goes to the heap: nothing was taken after it)
        return best

    def _take_run(self, limit: int) -> list[int]:
        # The least head; from a lane, its following blocks too while they stay below every other head (a lane is
        # in order, so they come next).
        best, lane, bound_key, bound_arrival = self._least_head()
        if best < 0:
            return []
        if lane < 0:
            heapq.heappop(self.heap)
            self.entries -= 1
            return [best]
        held = self.held
        entry = self.entry
        keys = self.keys
        nb = self.num_blocks
        seg = self.lanes[lane]
        run = [best]
        seg.popleft()
        taken = 1
        while len(run) < limit and seg:
            a, b = divmod(seg[0], nb)
            if held[b] and entry[b] == a:
                k = keys[b]
                if k > bound_key or (k == bound_key and a > bound_arrival):
                    break
                run.append(b)
            seg.popleft()
            taken += 1
        self.entries -= taken
        if not seg:
            self.tails[lane] = -_INF
        return run

    def _restore(self, b: int) -> None:
        # To the heap, whatever it came from: its lane may have emptied and taken smaller keys since (rare path).
        self.entries += 1
        heapq.heappush(self.heap, (self.keys[b], self.entry[b], b))

    def _compact(self) -> None:
        """Drop stale entries (their blocks left, or came back with a new arrival)."""
        entry = self.entry
        held = self.held
        nb = self.num_blocks
        self.heap = [e for e in self.heap if held[e[2]] and entry[e[2]] == e[1]]
        heapq.heapify(self.heap)
        for i, seg in enumerate(self.lanes):
            live = deque(c for c in seg if held[c % nb] and entry[c % nb] == c // nb)
            self.lanes[i] = live
            if not live:
                self.tails[i] = -_INF
        self.entries = len(self.heap) + sum(map(len, self.lanes))


_INF = float("inf")
_second = itemgetter(1)
