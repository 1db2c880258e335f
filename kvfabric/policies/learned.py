"""``learned``: LRU order plus an aging credit for the blocks a learned reuse model favours, guarded against LRU.

It is :class:`~kvfabric.policies.builtin.AdaptiveAgingPolicy`'s structure with the hand-written "proven" rule
replaced by a model fitted on recorded traffic (:mod:`kvfabric.policies.reuse_model`, written by
``kvfabric learn``), and an online guard against LRU (:mod:`kvfabric.policies.guard`):

* **classes**: when a block becomes a candidate, its class is computed from a few cheap features (the model names
  which): ``uses`` (requests that used this content, this cached life plus what the ghost memory remembers of
  earlier ones), ``role`` (the content existed before the freeing request, or it sealed it), ``seen`` (the share
  of the freeing request's prompt that was hit or recently evicted: first turn vs continuation), ``tail`` (the
  block's place from the prompt's end). O(1): a few list reads and one dict lookup per block.
* **favoured**: classes whose candidates were reused more often than the average candidate in the training
  traffic. A model that did not predict reuse better than the base rate on the held-out part of its own training
  traffic (``predictive`` false) falls back to adaptive_aging's rule: content used at least twice is favoured.
* **key**: ``now + departure`` for a favoured block, ``now`` otherwise (``now`` = blocks handed out so far): LRU
  order, except that a favoured block outlives unfavoured ones freed up to ``departure`` allocations after it.
* **credit D**, learned online exactly as ``adaptive_aging`` learns it (ARC's rule on two ghost memories of
  evicted digests, favoured and unfavoured): a request asking again for blocks evicted unfavoured shrinks D, for
  blocks evicted favoured grows it. D starts at 0: the policy starts as LRU and departs from it on evidence.
* **guard**: :class:`~kvfabric.policies.guard.LRUGuard` replays LRU's order beside the policy and counts, in
  blocks, its *mistakes* (requests for blocks it evicted while LRU would still hold them) and its *wins* (hits on
  blocks LRU would already have evicted); ``trust`` follows the net count and ``departure = trust * D`` (plus a
  small probe), so a model that loses to LRU is brought back to LRU's order. The departure shrinks by at most one
  allocation per allocation, so falling back never gives a block freed later a lower key than a favoured block
  freed earlier.
* **session hints** (``kvfabric_session`` / ``kvfabric_session_end``) as in ``adaptive_aging``: a live
  conversation's blocks are favoured, an ended conversation's private blocks go first.

Keys are monotone along a chain only approximately (a parent can be in an unfavoured class while its child is
favoured); the index enforces descendants-before-ancestors exactly anyway. Per-request state (the share of the
prompt seen, the guard's pending judgement) is kept for the last :attr:`LearnedPolicy.REQUEST_MEMORY` admissions;
a free whose request is unknown (none, or forgotten) classifies its blocks as if nothing of the prompt had been
seen.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

from kvfabric.policies.base import BlockStats, EvictionPolicy, PolicySettings, RequestInfo
from kvfabric.policies.guard import LRUGuard
from kvfabric.policies.reuse_model import FEATURES, ReuseModel, load_model


class _GhostMap:
    """Bounded memory of recently evicted digests with a value each: two generations of plain dicts.

    Holds between ``capacity / 2`` and ``capacity`` of the most recent insertions; O(1) insert, lookup, removal.
    """

    __slots__ = ("capacity", "current", "previous")

    def __init__(self, capacity: int) -> None:
        self.capacity = max(2, capacity)
        self.current: dict[int, Any] = {}
        self.previous: dict[int, Any] = {}

    def add(self, h: int, value: Any) -> None:
        self.current[h] = value
        if len(self.current) >= self.capacity // 2:
            self.previous = self.current
            self.current = {}

    def pop(self, h: int) -> Any:
        """Remove ``h``; returns its value, or None when it was not remembered."""
        v = self.current.pop(h, None)
        if v is None:
            v = self.previous.pop(h, None)
        return v

    def __len__(self) -> int:
        return len(self.current) + len(self.previous)


class LearnedPolicy(EvictionPolicy):
    """See the module docstring. ``model`` overrides ``settings.model_path`` (tests, the learner)."""

    name: ClassVar[str] = "learned"
    structure: ClassVar[str] = "heap"
    reads: ClassVar[frozenset[str]] = frozenset({"hash", "hits", "depth"})
    #: Ghost memory, in pools (as adaptive_aging).
    GHOST_FACTOR: ClassVar[int] = 4
    #: Allocations the credit moves per ghost-hit block (as adaptive_aging).
    STEP: ClassVar[float] = 4.0
    #: Key offset of blocks of ended sessions: below every live key.
    DEAD: ClassVar[float] = -float(1 << 52)
    #: Admissions whose prompt statistics are remembered for classifying their blocks when they are freed.
    REQUEST_MEMORY: ClassVar[int] = 4096

    def __init__(self, settings: PolicySettings | None = None, model: ReuseModel | None = None) -> None:
        super().__init__(settings)
        self.model = model if model is not None else load_model(self.settings.model_path)
        feats = self.model.features
        # Stride of each feature in the model's mixed-radix class index (0: the model does not use it).
        strides = {}
        stride = 1
        for f in reversed(feats):
            strides[f] = stride
            stride *= len(FEATURES[f])
        self._s_uses = strides.get("uses", 0)
        self._s_role = strides.get("role", 0)
        self._s_seen = strides.get("seen", 0)
        self._s_tail = strides.get("tail", 0)
        self.favoured_class = self.model.favoured_classes()
        self.credit = 0.0
        self.num_blocks = 0
        self.favoured: list[bool] = []
        self.ghost_unfavoured = _GhostMap(2)
        self.ghost_favoured = _GhostMap(2)
        self.carried: dict[int, int] = {}  # digest -> uses before its current cached life (rebuilt after a ghost hit)
        # request id -> [hit blocks, seen blocks, prompt blocks, pending guard mistakes]
        self.requests: dict[str, list[int]] = {}
        self.ghost_hits = [0, 0]  # unfavoured, favoured
        self.guard = LRUGuard(0)
        self.departure = 0.0  # the credit favoured blocks get now: the guard's share of D (updated per admission)
        self._departure_at = 0
        self.now = 0

    # ---- binding --------------------------------------------------------------------------------------------

    def bind(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.favoured = [False] * num_blocks
        self.ghost_unfavoured = _GhostMap(self.GHOST_FACTOR * num_blocks)
        self.ghost_favoured = _GhostMap(self.GHOST_FACTOR * num_blocks)
        self.guard = LRUGuard(num_blocks)

    def bind_index(self, index: Any) -> None:
        self.guard.held = index.held  # the guard needs to know which blocks are still candidates

    # ---- classification -------------------------------------------------------------------------------------

    def classify(self, t: BlockStats, b: int, ctx: RequestInfo | None) -> tuple[int, bool]:
        """(class index in the model, whether the freeing request hit this block). Also tells the guard about
        the new candidate (and settles the freeing request's pending mistakes at the last block of its hit)."""
        h = t.hash[b]
        carried = self.carried.get(h, 0) if h is not None else 0
        uses = t.hits[b] + 1 + carried
        depth = t.depth[b] or 0
        req = self.requests.get(ctx.request_id) if ctx is not None else None
        if req is None:
            hit = seen = num = 0
            old = uses > 1
        else:
            hit, seen, num, pending = req
            old = depth < seen
        won = self.guard.candidate(b, h, depth < hit)
        if req is not None and pending and depth == hit - 1:
            # LRU's hit reached as far as ours only if LRU had not evicted our last hit block: then the blocks we
            # evicted right after it, which LRU would still hold, were our mistakes.
            if not won:
                self.guard.mistake(pending)
            req[3] = 0
        idx = 0
        if self._s_uses:
            idx += (uses - 1 if uses <= 4 else (4 if uses < 8 else 5)) * self._s_uses
        if self._s_role and old:
            idx += self._s_role
        if self._s_seen and num > 0:
            idx += (0 if 4 * seen < num else (1 if 4 * seen < 3 * num else 2)) * self._s_seen
        if self._s_tail:
            idx += (2 if depth >= num else (0 if 16 * (num - 1 - depth) < num else 1)) * self._s_tail
        return idx, depth < hit

    # ---- the key --------------------------------------------------------------------------------------------

    def key(self, t: BlockStats, b: int, now: int, ctx: RequestInfo | None) -> float:
        idx, _ = self.classify(t, b, ctx)
        if ctx is not None and ctx.session_end and t.hits[b] == 0:  # never hit: one user (see adaptive_aging)
            self.favoured[b] = False
            return self.DEAD + now
        favoured = self.favoured_class[idx] or (ctx is not None and ctx.session is not None and not ctx.session_end)
        self.favoured[b] = favoured
        return now + self.departure if favoured else float(now)

    def retain_score(self, key: float, now: int) -> float:
        """Allocations of life left before this block would go under pure LRU order (negative: overdue)."""
        return key - now

    def is_protected(self, t: BlockStats, b: int, key: float, now: int) -> bool:
        return bool(self.favoured[b]) and self.departure > 0

    # ---- observers ------------------------------------------------------------------------------------------

    def on_request_started(self, info: RequestInfo, hit_blocks: int, num_blocks: int,
                           missed: Iterable[int] = (), digests: Sequence[int] | None = None) -> None:
        """Ghost hits (credit, guard, remembered uses) and the request's prompt statistics."""
        unfavoured, favoured = self.ghost_unfavoured, self.ghost_favoured
        guard = self.guard
        run = 0
        pending = 0
        lru_holds = True  # LRU would hold every block of the run so far (given it holds our hit)
        for h in missed:
            v = unfavoured.pop(h)
            if v is not None:
                self.ghost_hits[0] += 1
                ratio = len(favoured) / len(unfavoured) if len(unfavoured) else 1.0
                self.credit = max(0.0, self.credit - self.STEP * max(1.0, ratio))
            else:
                v = favoured.pop(h)
                if v is None:
                    break  # past the evicted run: nothing further back of this chain was cached recently
                self.ghost_hits[1] += 1
                ratio = len(unfavoured) / len(favoured) if len(favoured) else 1.0
                self.credit += self.STEP * max(1.0, ratio)
            uses, entry = v
            if guard.asked_again(entry) and lru_holds:
                pending += 1
            else:
                lru_holds = False
            self.carried[h] = uses
            run += 1
        if pending and hit_blocks == 0:
            guard.mistake(pending)  # no hit of ours to check LRU's prefix against: LRU would have hit from the root
            pending = 0
        requests = self.requests
        requests[info.request_id] = [hit_blocks, hit_blocks + run, num_blocks, pending]
        if len(requests) > self.REQUEST_MEMORY:
            del requests[next(iter(requests))]
        carried = self.carried
        if len(carried) > 2 * self.num_blocks + 1024:  # rebuilt digests whose request never sealed them
            for k in list(carried)[: len(carried) // 2]:
                del carried[k]
        # Falling back gradually: the departure shrinks by at most one allocation per allocation, so a favoured
        # block freed later never gets a lower key than one freed earlier (no inversion of recency among them).
        target = guard.departure(self.credit)
        if target >= self.departure:
            self.departure = target
        else:
            self.departure = max(target, self.departure - (self.now - self._departure_at))
        self._departure_at = self.now

    def on_evicted(self, t: BlockStats, b: int, now: int) -> None:
        self.now = now
        entry = self.guard.evicted(b)
        h = t.hash[b]
        if h is None:
            return
        uses = t.hits[b] + 1 + self.carried.pop(h, 0)
        (self.ghost_favoured if self.favoured[b] else self.ghost_unfavoured).add(h, (uses, entry))

    def describe(self) -> dict[str, Any]:
        return {
            "policy": self.name,
            "credit": self.credit,
            "ghost_hits_unfavoured": self.ghost_hits[0],
            "ghost_hits_favoured": self.ghost_hits[1],
            "model_features": list(self.model.features),
            "model_training": self.model.training.get("path") or self.model.training.get("run"),
            "model_predictive": self.model.predictive,
            **{f"guard_{k}": v for k, v in self.guard.describe().items()},
        }
