"""Fast block-level replay of a ``hash_ids`` trace, without vLLM: for policy sweeps and the offline optimum.

It models exactly what vLLM's prefix cache does with a trace, at vLLM's block granularity, and nothing else:

* every 512-token trace block is ``512 // block_size`` cache blocks whose identity is ``(hash_id, j)``; a prompt
  of ``input_length`` tokens has ``input_length // block_size`` full blocks (the partial tail is never cached);
* admission: the longest cached prefix, capped at ``(input_length - 1) // block_size`` blocks (vLLM always
  recomputes the last token), is hit; hit blocks are taken out of the candidates (``touch``), the rest are
  allocated (uncached free blocks first, then the policy's victims) and sealed; ``max_output_tokens`` of decode
  then seal private blocks nobody will ask for again (as in the real replay, whose outputs are made up);
* completion frees the request's blocks tail first, as ``KVCacheManager.free`` does;
* requests run one at a time (``concurrency=1``, the sequential replay of the traces' README) or in a window of
  ``concurrency`` requests, which pins the blocks of every request in the window.

Statistics are kept in the one :class:`~kvfabric.lifecycle.side_table.SideTable`, through the same operations the hook's
expander uses, and the policies and victim indexes are the very objects the hook uses in vLLM. Numbers quoted in
docs come from the real scheduler (:mod:`kvfabric.sim.replay`); this mode exists to sweep, and the docs show where
the two agree.

``policy="optimal"`` is Belady's MIN on block accesses with ties broken towards deeper blocks: at every eviction
the free cached block whose next use is farthest goes. Blocks pinned by running requests are not candidates, so
the optimum runs under the same capacity the policies have.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvfabric.engine.families import FamilyTree
from kvfabric.lifecycle.side_table import SideTable
from kvfabric.policies import make_policy
from kvfabric.policies.admission import AnchorAdmissionGate
from kvfabric.policies.base import EvictionPolicy, PolicySettings, RequestInfo
from kvfabric.policies.index import VictimIndex
from kvfabric.policies.indexes import make_index
from kvfabric.policies.optimal import occurrences_of

TRACE_BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One row of a Mooncake-style trace."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """Read a ``hash_ids`` JSONL trace (``shared/traces/README.md``), in file order, at most ``limit`` rows."""
    rows: list[TraceRequest] = []
    with open(path) as fh:
        for line in fh:
            if limit is not None and len(rows) >= limit:
                break
            line = line.strip()
            if not line:
                continue
            r = json.loads(line)
            rows.append(
                TraceRequest(float(r["timestamp"]), int(r["input_length"]), int(r["output_length"]),
                             tuple(int(h) for h in r["hash_ids"]))
            )
    return rows


def block_keys(req: TraceRequest, block_size: int, trace_block_tokens: int = TRACE_BLOCK_TOKENS) -> list[int]:
    """Identities of the request's full cache blocks: ``hash_id * per + j`` (``per`` blocks per trace block of
    ``trace_block_tokens`` tokens; 512 in Mooncake traces, the block size itself for recorded runs)."""
    per = trace_block_tokens // block_size
    n = req.input_length // block_size
    ids = req.hash_ids
    if per == 1:
        return list(ids[:n])
    return [ids[m // per] * per + m % per for m in range(n)]


def unique_blocks(trace: Sequence[TraceRequest], block_size: int) -> int:
    """Distinct full cache blocks in the trace (the denominator of capacity fractions)."""
    seen: set[int] = set()
    for req in trace:
        seen.update(block_keys(req, block_size))
    return len(seen)


class _Owner:
    """Holds the statistics table the way the statistics keeper does (``.table``)."""

    def __init__(self, num_blocks: int) -> None:
        self.table = SideTable(num_blocks)


@dataclass
class OfflineResult:
    policy: str
    num_blocks: int
    block_size: int
    requests: int = 0
    prompt_tokens: int = 0
    prefix_hit_tokens: int = 0
    evicted_blocks: int = 0
    rebuilt_from_eviction_blocks: int = 0
    protected_evictions: int = 0
    shared_anchor_evictions: int = 0
    admission_limited_blocks: int = 0
    descents: int = 0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "mode": "offline",
            "policy": self.policy,
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "prefix_hit_tokens": self.prefix_hit_tokens,
            "prefix_hit_rate": self.prefix_hit_rate,
            "evicted_blocks": self.evicted_blocks,
            "rebuilt_from_eviction_blocks": self.rebuilt_from_eviction_blocks,
            "wasted_prefill_tokens": self.rebuilt_from_eviction_blocks * self.block_size,
            "protected_evictions": self.protected_evictions,
            "shared_anchor_evictions": self.shared_anchor_evictions,
            "admission_limited_blocks": self.admission_limited_blocks,
            "events_emitted": 0,
            "events_dropped": 0,
        }


class OfflineCache:
    """A prefix cache of ``num_blocks`` blocks (block 0 is vLLM's null block, never used) driven by a policy.

    Invariants (checked by the tests): a slot is a candidate in the index exactly when its ref count is 0 and it
    holds a key; ``key_of``/``slot_of`` are inverse maps of cached slots; every slot handed out loses its key first.
    """

    def __init__(
        self,
        num_blocks: int,
        policy: EvictionPolicy,
        block_size: int = 16,
        gate: AnchorAdmissionGate | None = None,
        family_depth: int | None = None,
    ) -> None:
        if num_blocks < 2:
            raise ValueError("num_blocks must be >= 2")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.policy = policy
        self.owner = _Owner(num_blocks)
        self.index: VictimIndex = make_index(policy, self.owner, num_blocks)
        self.gate = gate
        self.family_depth = family_depth
        # The hook's family rule on this replay's keys (docs/design.md §5): both replay modes group alike.
        self.families = FamilyTree() if family_depth is None else None
        self.key_of = [-1] * num_blocks
        self.slot_of: dict[int, int] = {}
        self.ref = [0] * num_blocks
        self.uncached_free: list[int] = list(range(num_blocks - 1, 0, -1))  # stack; slot 0 is the null block
        self.evicted_keys: set[int] = set()
        self.result = OfflineResult(policy.name, num_blocks, block_size)
        self._junk = 0

    @property
    def num_free(self) -> int:
        return len(self.uncached_free) + len(self.index)

    # ---- block operations ------------------------------------------------------------------------------------

    def _allocate(self, n: int) -> list[int]:
        """``n`` slots: uncached free ones first, then victims (which lose their keys first)."""
        if n > self.num_free:
            raise RuntimeError(f"cannot allocate {n} blocks: {self.num_free} free (pool too small for the window)")
        out: list[int] = []
        free = self.uncached_free
        while free and len(out) < n:
            out.append(free.pop())
        if len(out) < n:
            t = self.owner.table
            index = self.index
            res = self.result
            while len(out) < n:
                s = index.pop()
                assert s is not None
                k = self.key_of[s]
                if t.protected[s]:
                    res.protected_evictions += 1
                if t.share[s] >= 2:
                    res.shared_anchor_evictions += 1
                self.policy.on_evicted(t, s, index.now)
                del self.slot_of[k]
                self.key_of[s] = -1
                if k >= 0:
                    self.evicted_keys.add(k)
                res.evicted_blocks += 1
                t.reset(s)
                out.append(s)
        self.index.tick(n)
        for s in out:
            self.ref[s] = 1
        return out

    def _uncache(self, s: int) -> None:
        """Drop slot ``s``'s key (a duplicate is being sealed elsewhere); a free slot becomes uncached free."""
        k = self.key_of[s]
        if k == -1:
            return
        if self.slot_of.get(k) == s:
            del self.slot_of[k]
        self.key_of[s] = -1
        self.owner.table.reset(s)
        if self.ref[s] == 0 and self.index.discard(s):
            self.uncached_free.append(s)

    def _seal(self, s: int, k: int, parent_slot: int, depth: int, rid: str, family: str | None) -> None:
        old = self.slot_of.get(k)
        if old is not None and old != s:
            self._uncache(old)  # vLLM would keep a duplicate; we keep one copy (an orphan nobody can reach)
        self.slot_of[k] = s
        self.key_of[s] = k
        t = self.owner.table
        if parent_slot >= 0 and self.key_of[parent_slot] >= 0:
            t.seal(s, k, self.key_of[parent_slot], parent_slot, depth, family, rid, self.index.now)
        else:
            t.seal(s, k, None, -1, depth, family, rid, self.index.now)
        if k in self.evicted_keys:
            self.evicted_keys.discard(k)
            self.result.rebuilt_from_eviction_blocks += 1

    def family_of(self, keys: Sequence[int], info: RequestInfo | None) -> str | None:
        """The family :meth:`admit` gives a request, as the hook would (docs/design.md §5): its hint, else the key
        the family rule names (a fixed depth, or the block below the widest branch point: the chain then enters
        the tree, so this is called once per request)."""
        if info is not None and info.family:
            return info.family  # (a named request stays out of the tree, as in the hook)
        if not keys:
            return None
        tree = self.families
        return str(keys[tree.add(keys) if tree is not None else min(self.family_depth or 0, len(keys) - 1)])

    def admit(self, rid: str, keys: Sequence[int], input_length: int, output_tokens: int,
              info: RequestInfo | None = None) -> tuple[list[int], int]:
        """Admit one request; returns its slots (pinned until :meth:`finish`) and its hit blocks."""
        bs = self.block_size
        max_hit = min(len(keys), (input_length - 1) // bs)
        slot_of = self.slot_of
        hit = 0
        while hit < max_hit and keys[hit] in slot_of:
            hit += 1
        if info is not None:
            # Before allocating: the policy judges ghosts (blocks it evicted that this request wants again).
            self.policy.on_request_started(info, hit, len(keys), itertools.islice(keys, hit, None), keys)
        t = self.owner.table
        index = self.index
        now = index.now
        slots: list[int] = []
        for m in range(hit):
            s = slot_of[keys[m]]
            if self.ref[s] == 0:
                index.discard(s)
            self.ref[s] += 1
            t.touch(s, rid, now)
            slots.append(s)
        family = self.family_of(keys, info)
        total_blocks = -(-(input_length + output_tokens) // bs)
        new = self._allocate(total_blocks - hit)
        slots.extend(new)
        n_full = len(keys)
        # Which new full prompt blocks get cached: all, unless the admission gate narrows it.
        cache_upto = n_full
        if self.gate is not None and hit < n_full:
            hinted = info is not None and (info.session is not None or info.family is not None)
            limit = self.gate.decide(rid, family, hinted)
            if limit is not None and limit < n_full:
                cache_upto = max(hit, limit)
                self.result.admission_limited_blocks += n_full - cache_upto
        for m in range(hit, cache_upto):
            self._seal(slots[m], keys[m], slots[m - 1] if m > 0 else -1, m, rid, family)
        if cache_upto == n_full:
            # Decode: output tokens complete private blocks no later request will ask for.
            for m in range(n_full, (input_length + output_tokens) // bs):
                self._junk += 1
                self._seal(slots[m], -self._junk, slots[m - 1] if m > 0 else -1, m, rid, family)
        res = self.result
        res.requests += 1
        res.prompt_tokens += input_length
        res.prefix_hit_tokens += hit * bs
        return slots, hit

    def finish(self, slots: Sequence[int], info: RequestInfo | None = None) -> None:
        """Free a request's slots tail first (``KVCacheManager.free``); ``info`` is the context policies see."""
        t = self.owner.table
        now = self.index.now
        candidates: list[int] = []
        for pos in range(len(slots) - 1, -1, -1):
            s = slots[pos]
            self.ref[s] -= 1
            t.release(s, now)
            if self.ref[s] > 0:
                continue
            if self.key_of[s] == -1:
                self.uncached_free.append(s)
                continue
            candidates.append(s)
        # One call for the free's candidates, in the same order, as the hook makes it. Releasing the whole request
        # first changes no key: a release writes only its own block's ``last_use``.
        self.index.add_reported(candidates, info)


def simulate(
    trace: Sequence[TraceRequest],
    policy: str | EvictionPolicy,
    num_blocks: int,
    *,
    block_size: int = 16,
    max_output_tokens: int | None = 1,
    concurrency: int = 1,
    anchor_blocks: int = 0,
    settings: PolicySettings | None = None,
    progress: Iterable[Any] | None = None,
    trace_block_tokens: int = TRACE_BLOCK_TOKENS,
) -> dict[str, Any]:
    """Replay ``trace`` sequentially through an :class:`OfflineCache`; returns the replay's JSON fields.

    ``anchor_blocks > 0`` turns the admission gate on (as ``KVFABRIC_ADMISSION_ANCHOR_BLOCKS``). ``progress``, if
    given, is an iterator advanced once per request (e.g. a tqdm bar's ``update`` via ``iter``). ``settings``
    reach the policy (e.g. the learned policy's ``model_path``). ``trace_block_tokens``: tokens per hash id of
    ``trace`` (a recorded run replays with its own block size).
    """
    if trace_block_tokens % block_size:
        raise ValueError(f"block_size must divide {trace_block_tokens}")
    keys_all = [block_keys(r, block_size, trace_block_tokens) for r in trace]
    outputs = [r.output_length if max_output_tokens is None else min(max(1, r.output_length), max_output_tokens)
               for r in trace]
    return replay_chains(keys_all, [r.input_length for r in trace], outputs, policy, num_blocks,
                         block_size=block_size, concurrency=concurrency, anchor_blocks=anchor_blocks,
                         settings=settings, progress=progress, max_output_tokens=max_output_tokens)


def replay_chains(
    chains: Sequence[Sequence[int]],
    input_lengths: Sequence[int],
    output_tokens: Sequence[int],
    policy: str | EvictionPolicy,
    num_blocks: int,
    *,
    block_size: int = 16,
    concurrency: int = 1,
    anchor_blocks: int = 0,
    settings: PolicySettings | None = None,
    progress: Iterable[Any] | None = None,
    max_output_tokens: int | None = None,
) -> dict[str, Any]:
    """The replay of :func:`simulate` on ready-made block identities: request ``i`` has the full prompt blocks
    ``chains[i]`` (prefix-chained identities, as :func:`block_keys` makes or as digests recorded by the hook),
    a prompt of ``input_lengths[i]`` tokens and ``output_tokens[i]`` tokens of decode."""
    if isinstance(policy, EvictionPolicy):
        pol = policy
    else:
        oracle = None
        if policy == "optimal":
            # A use is a position a request can hit: vLLM always recomputes the prompt's last token, so a block
            # ending at or past it is sealed again but never hit (counting it as a use misleads the optimum).
            oracle = occurrences_of(keys[: max(0, (n - 1) // block_size)]
                                    for keys, n in zip(chains, input_lengths, strict=True))
        pol = make_policy(policy, settings, oracle=oracle, block_size=block_size)
    gate = AnchorAdmissionGate(anchor_blocks) if anchor_blocks > 0 else None
    cache = OfflineCache(num_blocks, pol, block_size, gate)
    window: list[tuple[int, list[int]]] = []

    def finish_oldest() -> None:
        i, slots = window.pop(0)
        cache.finish(slots, RequestInfo(f"r{i}", position=i))

    for i, keys in enumerate(chains):
        slots, _ = cache.admit(f"r{i}", keys, input_lengths[i], output_tokens[i], RequestInfo(f"r{i}", position=i))
        window.append((i, slots))
        while len(window) >= concurrency:
            finish_oldest()
        if progress is not None:
            next(progress, None)  # type: ignore[call-overload]
    while window:
        finish_oldest()
    result = cache.result
    result.descents = cache.index.descents
    out_dict = result.as_dict()
    out_dict["descents"] = result.descents
    out_dict["concurrency"] = concurrency
    out_dict["max_output_tokens"] = max_output_tokens
    out_dict["admission_anchor_blocks"] = anchor_blocks
    describe = pol.describe()
    if len(describe) > 1:
        out_dict["policy_state"] = describe
    return out_dict
