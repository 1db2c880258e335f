"""Other engines' eviction policies as KVFabric policies: the baselines KVFabric's own are measured against.

Each class is one rule, cited to its source, keyed over the same block statistics as the built-in policies and
ordered by the same victim indexes (:mod:`kvfabric.policies.index`), so a comparison differs in the rule only:

* ``lfu``, ``slru``, ``fifo``: SGLang's ``LFUStrategy``, ``SLRUStrategy`` and ``FIFOStrategy``
  (``python/sglang/srt/mem_cache/evict_policy.py``), whose priorities are read from the radix tree's nodes
  (``radix_cache.py``: ``hit_count`` is raised by one on every node an insert walks through, the inserting request's
  own new nodes included, so it counts the requests that cached or reused the content; ``last_access_time`` is set
  by every match and insert; ``creation_time`` when the node is made);
* ``tlru``: Tail-Optimized LRU (Zhang, Li, Moallemi, Peng, "Tail-Optimized Caching for LLM Inference",
  arXiv:2510.15152, NeurIPS 2025), as SGLang merged it (``TLRUStrategy``, sgl-project/sglang#34012) and as
  vllm-project/vllm#37825 proposes it: the part of a conversation its next turn could recompute within a TTFT
  budget is evicted first (*TEL-safe*), everything else in LRU order.

Where KVFabric's block-level interface forces a difference (every class's docstring says which):

* SGLang evicts radix-tree *leaves* (a node with no child left) by priority, one whole node (a run of tokens) at a
  time; here a node is one cache block, and the index evicts descendants before ancestors exactly (a parent that
  reaches the top while a child of it is a candidate is set aside until the child leaves, then ranks with its own
  key): the same order of blocks, but eviction stops at the block that satisfies the allocation instead of at the
  end of a node;
* SGLang's clock is wall time (``time.monotonic()``); here it is ``now`` (blocks handed out so far), ties broken by
  the order blocks became candidates, which is the order of their last release: the same order of events;
* a key is fixed when a block becomes a candidate (``base.py``). SGLang recomputes a leaf's priority at every
  eviction, but every field it reads changes only when the node is used, and a used block leaves the candidates
  and is keyed afresh when it comes back: the same decisions.

Hot path: one loop per free, O(1) per block; the indexes make each allocation O(1) (segments) or O(log n) (heap).
Per-block state a policy keeps itself (``fifo``'s creation time, ``tlru``'s history length) lives in lists sized
by :meth:`~kvfabric.policies.base.EvictionPolicy.bind`, never in the side table.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

from kvfabric.policies.base import BlockStats, EvictionPolicy, RequestInfo

#: ``lfu``'s key is ``min(hits, HITS_CAP) * _HITS_SCALE + now``: exact in a float64 while ``now < 2**36``
#: (6.9e10 allocations) and hits stay below the cap.
_HITS_SCALE = float(1 << 36)
HITS_CAP = (1 << 16) - 1


class LFUPolicy(EvictionPolicy):
    """SGLang's ``LFUStrategy``: the least *used* candidate first, the least recently used among equals.

    SGLang's priority is ``(hit_count, last_access_time)``. ``hit_count`` counts the inserts that walked through the
    node: the request that made it (1) and every later request that cached over it. KVFabric's ``hits`` counts the
    requests that found the block cached (the sealer's own use is not a hit), so ``hit_count = hits + 1`` once every
    user has finished, which is when a block becomes a candidate: the order is the same. ``last_access_time`` of a
    candidate is its last release, i.e. ``now`` and arrival order here.

    Differences: ``hits`` saturates at :data:`HITS_CAP` (65,535) so the key stays exact in a float; SGLang's count
    does not (its chunked-prefill re-inserts are not counted there, and a preempted vLLM request's re-admission
    hits are counted here). Keys are monotone along a chain (a parent has at least its child's hits and is released
    with or after it).
    """

    name: ClassVar[str] = "lfu"
    structure: ClassVar[str] = "heap"
    reads: ClassVar[frozenset[str]] = frozenset({"hits"})

    def key(self, t: BlockStats, b: int, now: int, ctx: RequestInfo | None) -> float:
        h = t.hits[b]
        return (h if h < HITS_CAP else HITS_CAP) * _HITS_SCALE + now

    def keys(self, t: BlockStats, ids: list[int], now: int, ctx: RequestInfo | None) -> list[float]:
        hits = t.hits
        cap = HITS_CAP
        scale = _HITS_SCALE
        return [(h if (h := hits[b]) < cap else cap) * scale + now for b in ids]

    def retain_score(self, key: float, now: int) -> float:
        """The uses SGLang would count (``hits + 1``): what LFU ranks by first."""
        return float(math.floor(key / _HITS_SCALE) + 1)

    def is_protected(self, t: BlockStats, b: int, key: float, now: int) -> bool:
        return t.hits[b] >= 1


class SLRUPolicy(EvictionPolicy):
    """SGLang's ``SLRUStrategy``: a probationary segment (used once) evicted wholly before a protected one.

    SGLang's priority is ``(hit_count >= protected_threshold, last_access_time)`` with ``protected_threshold = 2``
    (its default): content used by at least two requests is protected. With ``hit_count = hits + 1`` (see
    :class:`LFUPolicy`) that is ``hits >= 1``. Two FIFO segments, O(1): segment 0 (probationary) goes first, each
    in release order (= last access). ``share >= 2`` implies ``hits >= 1``, so this is ``family_protect`` at its
    default threshold; it is kept as its own name so tables name the peer they compare with.
    """

    name: ClassVar[str] = "slru"
    structure: ClassVar[str] = "segments"
    num_segments: ClassVar[int] = 2
    ranked: ClassVar[bool] = False
    reads: ClassVar[frozenset[str]] = frozenset({"hits"})
    #: SGLang's ``protected_threshold`` (uses, i.e. ``hit_count``), its default.
    PROTECTED_USES: ClassVar[int] = 2

    def key(self, t: BlockStats, b: int, now: int, ctx: RequestInfo | None) -> float:
        return 1 if t.hits[b] + 1 >= self.PROTECTED_USES else 0

    def keys(self, t: BlockStats, ids: list[int], now: int, ctx: RequestInfo | None) -> list[float]:
        hits = t.hits
        need = self.PROTECTED_USES - 1
        return [1 if hits[b] >= need else 0 for b in ids]

    def is_protected(self, t: BlockStats, b: int, key: float, now: int) -> bool:
        return key >= 1


class _LifeState(EvictionPolicy):
    """Per-block state kept by the policy for the block's current cached life.

    A life starts the first time the block becomes a candidate holding its content (``hash``) and ends when it is
    evicted (:meth:`on_evicted`) or found holding other content. Lists sized by :meth:`bind`, O(1) per block.
    """

    def __init__(self, settings: Any = None) -> None:
        super().__init__(settings)
        self.life: list[int | None] = []  # the content each block's state belongs to (None: no life)

    def bind(self, num_blocks: int) -> None:
        self.life = [None] * num_blocks

    def on_evicted(self, t: BlockStats, b: int, now: int) -> None:
        self.life[b] = None

    def on_evicted_all(self, t: BlockStats, ids: list[int], now: int) -> None:
        life = self.life
        for b in ids:
            life[b] = None


class FIFOPolicy(_LifeState):
    """SGLang's ``FIFOStrategy``: the oldest *content* first, however recently it was used.

    SGLang's priority is ``creation_time``, stamped when the node is inserted (after the creating request's
    prefill). No statistics column holds a block's creation, and the hook sees no sealing (steering keeps only what
    policies read), so the policy stamps it itself: the ``now`` at which the block first became a candidate in its
    cached life (when the request that sealed it, or the last one sharing it, let go), remembered until it is
    evicted. With requests one at a time (the sequential replay) the order is SGLang's exactly; with overlapping
    requests a long request's blocks count as younger than a short one's admitted after it. Ties (one request's
    blocks) go in release order, tail first, as SGLang's heap breaks them by ``last_access_time``; the index then
    keeps descendants before ancestors (a parent is older than its children: it is set aside until they leave).
    """

    name: ClassVar[str] = "fifo"
    structure: ClassVar[str] = "heap"
    reads: ClassVar[frozenset[str]] = frozenset({"hash"})

    def __init__(self, settings: Any = None) -> None:
        super().__init__(settings)
        self.born: list[int] = []

    def bind(self, num_blocks: int) -> None:
        super().bind(num_blocks)
        self.born = [0] * num_blocks

    def key(self, t: BlockStats, b: int, now: int, ctx: RequestInfo | None) -> float:
        return self.keys(t, [b], now, ctx)[0]

    def keys(self, t: BlockStats, ids: list[int], now: int, ctx: RequestInfo | None) -> list[float]:
        hashes = t.hash
        life = self.life
        born = self.born
        out: list[float] = []
        for b in ids:
            h = hashes[b]
            if life[b] != h or h is None:  # a new cached life: it is born now
                life[b] = h
                born[b] = now
            out.append(float(born[b]))
        return out

    def retain_score(self, key: float, now: int) -> float:
        """Minus the content's age in allocations (higher = younger = kept longer)."""
        return key - now


class TLRUPolicy(_LifeState):
    """Tail-Optimized LRU (arXiv:2510.15152): a conversation's TEL-safe tail first, then LRU.

    The rule (the paper's, in SGLang's ``TLRUStrategy`` and vLLM #37825): a conversation whose history is ``L``
    tokens and whose next prompt is expected to add ``Q_hat`` tokens needs only its first ``budget = max(L + Q_hat -
    xi, 0)`` tokens cached to keep its next prefill within a budget of ``xi`` tokens; a block starting at or past
    ``budget`` is *TEL-safe* (evicting it cannot push the next turn over the budget). TEL-safe candidates go first
    (segment 0), the rest after them (segment 1), each in LRU order: two FIFO segments, O(1).

    Here: a block at depth ``d`` starts at token ``d * block_size``; ``L`` is the *high-water* length (full blocks,
    times the block size) of the requests that released the block in its cached life, which does not shrink as the
    tail is evicted (SGLang's ``_tlru_history_len``, for the reason its comment gives: otherwise T-LRU walks a
    conversation down to nothing instead of stopping at ``budget``). A request's length is read from the free
    itself: a free lists a request's candidate blocks tail first, so a chain's first block is its deepest and
    ``L = depth + 1`` blocks. ``xi`` and ``Q_hat`` are :attr:`PolicySettings.tlru_threshold_tokens` and
    :attr:`PolicySettings.tlru_next_prompt_tokens` (``KVFABRIC_TLRU_THRESHOLD_TOKENS``,
    ``KVFABRIC_TLRU_NEXT_PROMPT_TOKENS``); with ``xi <= Q_hat`` nothing is TEL-safe and this is LRU.

    Differences: SGLang's high water counts every request that inserted through the node; inside vLLM the policy
    sees a block only when its *last* user releases it, so with overlapping requests a shorter last user can set a
    lower ``L`` than SGLang's (the same with requests one at a time). The paper's end-aware and length-aware
    variants (which need to know whether a conversation will return) are not implemented.
    """

    name: ClassVar[str] = "tlru"
    structure: ClassVar[str] = "segments"
    num_segments: ClassVar[int] = 2
    ranked: ClassVar[bool] = False
    reads: ClassVar[frozenset[str]] = frozenset({"hash", "depth"})

    def __init__(self, settings: Any = None) -> None:
        super().__init__(settings)
        self.history: list[int] = []  # high-water conversation length through each block, in blocks
        s = self.settings
        self.block_size = max(1, int(s.block_size))
        # budget(L) = max(L * block_size + Q_hat - xi, 0) tokens; TEL-safe iff depth * block_size >= budget.
        self.slack = int(s.tlru_next_prompt_tokens) - int(s.tlru_threshold_tokens)

    def bind(self, num_blocks: int) -> None:
        super().bind(num_blocks)
        self.history = [0] * num_blocks

    def key(self, t: BlockStats, b: int, now: int, ctx: RequestInfo | None) -> float:
        return self.keys(t, [b], now, ctx)[0]

    def keys(self, t: BlockStats, ids: list[int], now: int, ctx: RequestInfo | None) -> list[float]:
        hashes = t.hash
        depths = t.depth
        life = self.life
        history = self.history
        bs = self.block_size
        slack = self.slack
        out: list[float] = []
        length = 0
        prev = -1
        for b in ids:
            d = depths[b] or 0
            if d != prev - 1:  # a chain starts (a free lists it tail first): its deepest block gives its length
                length = d + 1
            prev = d
            h = hashes[b]
            if life[b] != h or h is None:
                life[b] = h
                history[b] = length
            elif length > history[b]:
                history[b] = length
            budget = history[b] * bs + slack
            out.append(0 if d * bs >= (budget if budget > 0 else 0) else 1)
        return out

    def is_protected(self, t: BlockStats, b: int, key: float, now: int) -> bool:
        return key >= 1

    def describe(self) -> dict[str, Any]:
        return {"policy": self.name, "tlru_threshold_tokens": self.settings.tlru_threshold_tokens,
                "tlru_next_prompt_tokens": self.settings.tlru_next_prompt_tokens, "block_size": self.block_size}


PEER_POLICIES: dict[str, type[EvictionPolicy]] = {
    "lfu": LFUPolicy,
    "slru": SLRUPolicy,
    "fifo": FIFOPolicy,
    "tlru": TLRUPolicy,
}
"""The peers by name (registered in :func:`kvfabric.policies.make_policy`)."""
