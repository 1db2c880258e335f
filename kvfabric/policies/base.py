"""The policy interface shared by the engine (inside vLLM) and the offline replay.

A policy is small: a *key function* over a block's statistics (SGLang's split, ``evict_policy.py``). The cache side
owns the data structure that orders candidates (:mod:`kvfabric.policies.index`), so every policy gets the same
O(1) / O(log n) guarantees and the same safety rules for free.

Two worlds call the same policy objects:

* inside vLLM, :mod:`kvfabric.engine.steering` binds hand-out methods onto the pool's ``free_block_queue``
  instance and asks the index for victims; statistics come from the engine's
  :class:`~kvfabric.lifecycle.keeper.StatisticsKeeper` (a :class:`~kvfabric.lifecycle.side_table.SideTable`);
* offline, :mod:`kvfabric.sim.offline` replays block accesses with the same statistics, updated the same way.

Invariants every policy must respect (the index enforces the structural ones):
  * a key is a function of the block's statistics, of ``now`` and of the request context ``ctx`` (the request
    whose free made the block a candidate, or None: a free with no request), all passed explicitly; it is
    computed once when the block becomes a candidate (its last reference went) and never changes while the
    block waits, so ordering is a heap or a set of FIFO segments, never a scan. What a policy learns from the
    traffic (e.g. a credit moved by ghost hits) may change later keys, never a waiting block's;
  * keys should be monotone along a chain (a parent's statistics dominate its child's: every use of a child is a
    use of its parent), so that "descendants before ancestors" mostly holds by itself; the index enforces it
    exactly anyway;
  * a policy never refuses a victim: protection is an order, not a veto (``get_new_blocks(n)`` must never fail
    while ``n`` blocks are free).

``now`` is a logical clock owned by the index: the number of blocks handed out by the free queue so far. It
advances with cache churn rather than with wall time, so a policy's notion of "old" means "many allocations ago"
and needs no tuning to a machine's speed or a trace's time scale.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from kvfabric.lifecycle.side_table import ALL_COLUMNS


class BlockStats(Protocol):
    """What a policy may read about block ``b`` (lists indexed by block id).

    :class:`kvfabric.lifecycle.side_table.SideTable` is the one implementation (inside vLLM, in the forwarder and in the
    offline replay). Fields describe the block's *current* cached life (reset at eviction, set at sealing);
    ``last_use`` is on the same clock as the ``now`` a policy is given.
    """

    hash: list[int | None]
    parent: list[int | None]
    parent_block: list[int]
    depth: list[int | None]
    family: list[str | None]
    hits: list[int]
    share: list[int]
    branch: list[int]
    last_use: list[int]
    protected: list[bool]
    score: list[float | None]


class TableOwner(Protocol):
    """Anything holding the current statistics table as ``.table`` (the statistics keeper, the offline replay)."""

    table: Any


@dataclass(frozen=True)
class PolicySettings:
    """The knobs a policy may read (a subset of :class:`kvfabric.engine.config.HookSettings`)."""

    protect_min_hit_count: int = 1
    #: The ``learned`` policy's reuse model (``KVFABRIC_POLICY_MODEL``); None = the model shipped with the package.
    model_path: str | None = None
    #: Tokens per cache block (the pool's; :func:`kvfabric.policies.make_policy` sets it where it is known).
    block_size: int = 16
    #: ``tlru``'s TTFT budget ``xi``, in tokens of prefill a returning turn may recompute
    #: (``KVFABRIC_TLRU_THRESHOLD_TOKENS``).
    tlru_threshold_tokens: int = 2048
    #: ``tlru``'s estimate ``Q_hat`` of a next turn's new prompt tokens (``KVFABRIC_TLRU_NEXT_PROMPT_TOKENS``).
    tlru_next_prompt_tokens: int = 256

    @classmethod
    def from_hook_settings(cls, settings: Any) -> PolicySettings:
        return cls(protect_min_hit_count=int(getattr(settings, "protect_min_hit_count", 1)),
                   model_path=getattr(settings, "policy_model", None) or None,
                   tlru_threshold_tokens=int(getattr(settings, "tlru_threshold_tokens", cls.tlru_threshold_tokens)),
                   tlru_next_prompt_tokens=int(getattr(settings, "tlru_next_prompt_tokens",
                                                       cls.tlru_next_prompt_tokens)))


@dataclass(frozen=True)
class RequestInfo:
    """What a policy may know about a request (hints are optional; absent means "infer").

    ``session``: ``SamplingParams.extra_args["kvfabric_session"]``; ``session_end``: the client said this is the
    conversation's last turn (``kvfabric_session_end``); ``position``: the request's index in a replayed trace
    (only replays know it; the optimum's oracle uses it).
    """

    request_id: str
    family: str | None = None
    session: str | None = None
    session_end: bool = False
    position: int | None = None


class EvictionPolicy(ABC):
    """Base of every policy except ``lru`` (which attaches nothing at all).

    Subclasses set :attr:`name`, :attr:`structure` and implement :meth:`key`. ``structure`` is ``"segments"``
    (``key`` returns a small int, segment 0 is evicted first, FIFO inside a segment: O(1)) or ``"heap"``
    (``key`` returns a float, lowest first, ties in arrival order: O(log n)).
    """

    name: ClassVar[str]
    structure: ClassVar[str] = "heap"
    num_segments: ClassVar[int] = 1
    #: Whether the hook reports its ranking (``eviction_candidates_ranked``, ``retain_score``).
    ranked: ClassVar[bool] = True
    #: The :class:`BlockStats` columns the policy's :meth:`key`, :meth:`is_protected` and observers read. Inside
    #: vLLM the statistics keeper keeps only these (and the victim index's own) when they are all lean
    #: (:data:`kvfabric.lifecycle.side_table.LEAN_COLUMNS`): a column read but not declared may then be stale.
    #: ``tests/engine/test_policy_reads.py`` runs every built-in policy on a table that refuses undeclared columns.
    reads: ClassVar[frozenset[str]] = ALL_COLUMNS

    def __init__(self, settings: PolicySettings | None = None) -> None:
        self.settings = settings or PolicySettings()

    @abstractmethod
    def key(self, t: BlockStats, b: int, now: int, ctx: RequestInfo | None) -> float:
        """Eviction key of block ``b`` becoming a candidate at logical time ``now`` (lower = evicted sooner);
        ``ctx`` is the request whose free made it a candidate (None when vLLM frees with no request)."""

    def keys(self, t: BlockStats, ids: list[int], now: int, ctx: RequestInfo | None) -> list[float]:
        """The keys of blocks ``ids``, becoming candidates together (one free) at ``now``, in order: exactly
        ``[key(t, b, now, ctx) for b in ids]``. A policy on the hot path may override it with one loop."""
        key = self.key
        return [key(t, b, now, ctx) for b in ids]

    def retain_score(self, key: float, now: int) -> float:
        """The key as reported in events (``retain_score``, higher = keep). Default: the key itself."""
        return float(key)

    def is_protected(self, t: BlockStats, b: int, key: float, now: int) -> bool:
        """Whether the policy deliberately keeps ``b`` over plain-LRU candidates (reported, never a veto)."""
        return False

    def report(self, t: BlockStats, ids: list[int], keys: list[float],
               now: int) -> tuple[list[float], list[bool]] | tuple[float, bool]:
        """Retain scores and protection flags of blocks ``ids`` (at least one) just added with ``keys`` at ``now``:
        exactly :meth:`retain_score` and :meth:`is_protected` of each, as two lists, or, in the *uniform* form, one
        score and one flag that are each block's (a policy on the hot path may override it to say so without a
        loop; :func:`kvfabric.contract.records.expand_report` turns either form into lists)."""
        score = self.retain_score
        protected = self.is_protected
        return ([score(k, now) for k in keys],
                [protected(t, b, k, now) for b, k in zip(ids, keys, strict=True)])

    def bind(self, num_blocks: int) -> None:  # noqa: B027
        """Called once by the index with the pool size (policies with per-block state allocate it here)."""

    def bind_index(self, index: Any) -> None:  # noqa: B027
        """Called once by the index, after :meth:`bind`, with itself (read-only use: e.g. which blocks it holds)."""

    # ---- optional observers (per request, never per block on the hot path) --------------------------------

    def on_request_started(  # noqa: B027
        self,
        info: RequestInfo,
        hit_blocks: int,
        num_blocks: int,
        missed: Iterable[int] = (),
        digests: Sequence[int] | None = None,
    ) -> None:
        """A request was admitted: ``hit_blocks`` of its ``num_blocks`` full blocks were prefix-cache hits.

        ``missed`` iterates (lazily) the digests of the blocks right after the hit, in chain order; ``digests`` is
        the whole chain's digests (a lazy sequence in the hook). Called once per admission, before allocation."""

    def on_evicted(self, t: BlockStats, b: int, now: int) -> None:  # noqa: B027
        """Block ``b`` (still holding its statistics) is being evicted at ``now``."""

    def on_evicted_all(self, t: BlockStats, ids: list[int], now: int) -> None:
        """Blocks ``ids`` are being evicted together at ``now``: exactly :meth:`on_evicted` of each, in order. A
        policy on the hot path may override it with one loop."""
        on_evicted = self.on_evicted
        for b in ids:
            on_evicted(t, b, now)

    def describe(self) -> dict[str, Any]:
        """Settings worth recording with a run."""
        return {"policy": self.name}
