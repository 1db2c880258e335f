"""The built-in policies of docs/design.md §6, each a key function over block statistics.

``lru`` here exists for the offline replay and for tests (one FIFO segment = vLLM's own order); inside vLLM the
``lru`` policy attaches nothing at all.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

from kvfabric.policies.base import BlockStats, EvictionPolicy, RequestInfo


class LRUPolicy(EvictionPolicy):
    """vLLM's order: cached blocks leave in the order their last reference went (a request's tail first)."""

    name: ClassVar[str] = "lru"
    structure: ClassVar[str] = "segments"
    num_segments: ClassVar[int] = 1
    ranked: ClassVar[bool] = False
    reads: ClassVar[frozenset[str]] = frozenset()

    def key(self, t: BlockStats, b: int, now: int, ctx: RequestInfo | None) -> float:
        return 0


class FamilyProtectPolicy(EvictionPolicy):
    """vLLM's order, but a protected block is passed over while unprotected candidates exist.

    Protected: ``hit_count >= protect_min_hit_count`` or ``share_degree >= 2`` (docs/design.md §6). Two FIFO segments,
    O(1). A block's statistics only change while it is in use, so its segment, fixed when it becomes a candidate,
    stays right until it is used again.
    """

    name: ClassVar[str] = "family_protect"
    structure: ClassVar[str] = "segments"
    num_segments: ClassVar[int] = 2
    ranked: ClassVar[bool] = False
    reads: ClassVar[frozenset[str]] = frozenset({"hits", "share"})

    def key(self, t: BlockStats, b: int, now: int, ctx: RequestInfo | None) -> float:
        return 1 if (t.hits[b] >= self.settings.protect_min_hit_count or t.share[b] >= 2) else 0

    def is_protected(self, t: BlockStats, b: int, key: float, now: int) -> bool:
        return key >= 1

    def describe(self) -> dict[str, Any]:
        return {"policy": self.name, "protect_min_hit_count": self.settings.protect_min_hit_count}


#: Resolution of :class:`SharedAwarePolicy` scores: recency breaks ties only between equal quantised scores.
_SCORE_SCALE = float(1 << 40)


class SharedAwarePolicy(EvictionPolicy):
    """Rank candidates by a retain score from hit count, share degree, branch factor, depth; recency breaks ties.

    ``score = log2(1 + hits) + log2(share) + log2(1 + branch) / 2 - depth / (depth + 256)``, quantised to 1/8, then
    the block's recency: the key is ``score * 2**40 + now``. Every term is monotone along a chain (a parent has at
    least its child's hits, users and children, and is shallower), so ancestors outlive descendants.

    This is docs/design.md §6's ``shared_aware`` as specified, protection that never ages: it helps at tight capacity
    and is expected to lose to LRU at moderate capacity (the lesson that motivates ``session_aging``).
    """

    name: ClassVar[str] = "shared_aware"
    structure: ClassVar[str] = "heap"
    reads: ClassVar[frozenset[str]] = frozenset({"hits", "share", "branch", "depth"})

    @staticmethod
    def score(t: BlockStats, b: int) -> float:
        depth = t.depth[b] or 0
        s = (
            math.log2(1 + t.hits[b])
            + math.log2(max(1, t.share[b]))
            + 0.5 * math.log2(1 + t.branch[b])
            - depth / (depth + 256.0)
        )
        return math.floor(s * 8.0) / 8.0

    def key(self, t: BlockStats, b: int, now: int, ctx: RequestInfo | None) -> float:
        return self.score(t, b) * _SCORE_SCALE + now

    def retain_score(self, key: float, now: int) -> float:
        return math.floor(key / _SCORE_SCALE * 8.0) / 8.0

    def is_protected(self, t: BlockStats, b: int, key: float, now: int) -> bool:
        return t.hits[b] >= self.settings.protect_min_hit_count or t.share[b] >= 2


class _GhostSet:
    """Bounded memory of recently evicted digests: two generations of plain sets (cheaper than an OrderedDict).

    Holds between ``capacity / 2`` and ``capacity`` of the most recent insertions; O(1) insert, lookup, removal.
    """

    __slots__ = ("capacity", "current", "previous")

    def __init__(self, capacity: int) -> None:
        self.capacity = max(2, capacity)
        self.current: set[int] = set()
        self.previous: set[int] = set()

    def add(self, h: int) -> None:
        current = self.current
        current.add(h)
        if len(current) >= self.capacity // 2:
            self.previous = current
            self.current = set()

    def add_all(self, hs: list[int]) -> None:
        """:meth:`add` of each of ``hs``, in order."""
        half = self.capacity // 2
        current = self.current
        if len(current) + len(hs) < half:  # no generation turns over: one C call
            current.update(hs)
            return
        for h in hs:  # (a generation turns over on the way: rare)
            self.add(h)

    def pop(self, h: int) -> bool:
        """Remove ``h``; returns whether it was remembered."""
        if h in self.current:
            self.current.discard(h)
            return True
        if h in self.previous:
            self.previous.discard(h)
            return True
        return False

    def __len__(self) -> int:
        return len(self.current) + len(self.previous)


class AdaptiveAgingPolicy(EvictionPolicy):
    """LRU order plus a time credit for *proven* blocks, the credit learned online from ghost hits.

    Key: ``now + D`` for a proven block, ``now`` for an unproven one (``now`` = blocks handed out so far). With
    ``D = 0`` this is exactly vLLM's LRU; with ``D > 0`` a proven block outlives unproven blocks that were last
    used up to ``D`` allocations after it, and no longer: protection ages (docs/design.md §6), it is never permanent.

    *Proven*: reused while cached (``hit_count >= 1`` or ``share_degree >= 2``), or rebuilt soon after being
    evicted (its digest was still in the ghost memory when a request asked for it again: it was worth keeping).

    ``D`` is learned like ARC's target size (Megiddo & Modha, FAST'03), with both ghost lists kept at the
    granularity of cache blocks: a request that asks for blocks evicted while *unproven* says the credit is too
    large (D shrinks); one that asks for blocks evicted while *proven* says it is too small (D grows). Each
    ghost-hit block moves D by ``STEP`` allocations times ARC's balance ratio. D starts at 0, so the policy starts
    as LRU and only departs from it on evidence. Nothing here depends on a trace's time scale or size: ``now``
    counts allocations and the ghost memory is ``GHOST_FACTOR`` x the pool.

    Session hints (``SamplingParams.extra_args``), when the client gives them:
      * ``kvfabric_session`` without ``kvfabric_session_end``: the conversation is alive, so its private tail is its
        next turn's prefix: the request's new blocks count as proven;
      * ``kvfabric_session_end``: the conversation is over; its private blocks (one user, never hit) go first.
    Without hints, liveness is inferred from the chain itself: a session whose tail was evicted and is asked for
    again is rebuilt *as proven* (ghost hit), and blocks a continuing turn hit are proven by that hit.
    """

    name: ClassVar[str] = "adaptive_aging"
    structure: ClassVar[str] = "heap"
    #: ``hits`` alone stands for "reused while cached": a second user's use of a block is a hit (``share >= 2``
    #: implies ``hits >= 1``), so the lean side table (no ``share``) serves this policy.
    reads: ClassVar[frozenset[str]] = frozenset({"hash", "hits"})
    #: Ghost memory, in pools: how far back an eviction can still be judged (4 pools of allocations).
    GHOST_FACTOR: ClassVar[int] = 4
    #: Allocations the credit moves per ghost-hit block (ARC moves its target by 1 block; blocks here arrive a
    #: request at a time, so a few blocks per hit make the credit follow the workload within a turnover or two).
    STEP: ClassVar[float] = 4.0
    #: Key offset of blocks of ended sessions: below every live key, recency still orders them among themselves.
    DEAD: ClassVar[float] = -float(1 << 52)

    def __init__(self, settings: Any = None) -> None:
        super().__init__(settings)
        self.credit = 0.0
        self.num_blocks = 0
        self.proven_cls: list[bool] = []
        self.ghost_unproven = _GhostSet(2)
        self.ghost_proven = _GhostSet(2)
        self.promoted: set[int] = set()  # digests rebuilt after a ghost hit, proven when they become candidates
        self.ghost_hits = [0, 0]  # unproven, proven

    def bind(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.proven_cls = [False] * num_blocks
        self.ghost_unproven = _GhostSet(self.GHOST_FACTOR * num_blocks)
        self.ghost_proven = _GhostSet(self.GHOST_FACTOR * num_blocks)

    def key(self, t: BlockStats, b: int, now: int, ctx: RequestInfo | None) -> float:
        return self.keys(t, [b], now, ctx)[0]

    def keys(self, t: BlockStats, ids: list[int], now: int, ctx: RequestInfo | None) -> list[float]:
        # The hot path (once per free): the request context is the same for all of a free's blocks.
        ended = ctx is not None and ctx.session_end
        proven_cls = self.proven_cls
        credited = now + self.credit
        if ctx is not None and ctx.session is not None and not ended:
            for b in ids:  # a live conversation's blocks: the next turn's prefix
                proven_cls[b] = True
            return [credited] * len(ids)
        hits = t.hits
        # Never hit = one user only (the sealer's own use is not a touch, every other user's is): when the
        # conversation is over, its private blocks go first.
        other = self.DEAD + now if ended else float(now)
        out: list[float] = []
        append = out.append
        promoted = self.promoted if not ended else None  # (an ended session's rebuilt blocks are not credited)
        hashes = t.hash
        for b in ids:  # (one pass: the class is kept for the eviction observer and the report)
            if hits[b] > 0 or (promoted and hashes[b] in promoted):
                proven_cls[b] = True
                append(credited)
            else:
                proven_cls[b] = False
                append(other)
        return out

    def retain_score(self, key: float, now: int) -> float:
        """Allocations of life left before this block would go under pure LRU order (negative: overdue)."""
        return key - now

    def is_protected(self, t: BlockStats, b: int, key: float, now: int) -> bool:
        return bool(self.proven_cls[b]) and self.credit > 0

    def report(self, t: BlockStats, ids: list[int], keys: list[float],
               now: int) -> tuple[list[float], list[bool]] | tuple[float, bool]:
        # A free's blocks are usually of one class, with one key: then one score and one flag stand for all of
        # them (the base class's uniform form; C-level checks, no loop in Python).
        k0 = keys[0]
        uniform = keys.count(k0) == len(keys)
        if self.credit > 0:
            flags = list(map(self.proven_cls.__getitem__, ids))  # (bools: keys() writes them)
            if uniform and flags.count(flags[0]) == len(flags):
                return k0 - now, flags[0]
        elif uniform:
            return k0 - now, False
        else:
            flags = [False] * len(ids)
        return [k - now for k in keys], flags

    def on_request_started(self, info: RequestInfo, hit_blocks: int, num_blocks: int,
                           missed: Iterable[int] = (), digests: Sequence[int] | None = None) -> None:
        """Ghost hits: the digests the request needs right after its hit, while they are remembered evictions."""
        unproven, proven = self.ghost_unproven, self.ghost_proven
        for h in missed:
            # ARC's update: a ghost hit in the smaller list moves the credit by the ratio of the lists' sizes.
            if unproven.pop(h):
                self.ghost_hits[0] += 1
                ratio = len(proven) / len(unproven) if len(unproven) else 1.0
                self.credit = max(0.0, self.credit - self.STEP * max(1.0, ratio))
            elif proven.pop(h):
                self.ghost_hits[1] += 1
                ratio = len(unproven) / len(proven) if len(proven) else 1.0
                self.credit += self.STEP * max(1.0, ratio)
            else:
                break  # past the evicted run: nothing further back of this chain was in the cache recently
            self.promoted.add(h)

    def on_evicted(self, t: BlockStats, b: int, now: int) -> None:
        # (The one-block eviction, vLLM's usual one: no lists.)
        h = t.hash[b]
        if h is None:
            return
        if self.promoted:
            self.promoted.discard(h)
        (self.ghost_proven if self.proven_cls[b] else self.ghost_unproven).add(h)

    def on_evicted_all(self, t: BlockStats, ids: list[int], now: int) -> None:
        hashes = t.hash
        proven_cls = self.proven_cls
        # Each ghost list in one call, in eviction order (the two are independent of each other).
        proven = [h for b in ids if proven_cls[b] and (h := hashes[b]) is not None]
        unproven = [h for b in ids if not proven_cls[b] and (h := hashes[b]) is not None]
        if self.promoted:
            self.promoted.difference_update(proven, unproven)
        if proven:
            self.ghost_proven.add_all(proven)
        if unproven:
            self.ghost_unproven.add_all(unproven)

    def describe(self) -> dict[str, Any]:
        return {
            "policy": self.name,
            "credit": self.credit,
            "ghost_hits_unproven": self.ghost_hits[0],
            "ghost_hits_proven": self.ghost_hits[1],
        }
