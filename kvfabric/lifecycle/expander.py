"""The lifecycle expander: call records in, one event row per block operation out.

This is where a block's life story is written. It runs in the forwarder process (:mod:`kvfabric.forwarder`),
off vLLM's GIL, or in-process where a caller drains events itself (the replay, the tests: the engine's
``LocalOutlet``). It keeps the
:class:`~kvfabric.lifecycle.side_table.SideTable` (the same operations policies and the offline replay use), the bounded
memory of recently evicted digests (rebuilt and regretful evictions), and each live request's family.

:class:`~kvfabric.lifecycle.keeper.StatisticsKeeper` is the same logic without events, for steering inside vLLM
when a policy reads block statistics: one code path keeps the side table wherever it is kept.

Invariants:
  * records are applied in the order vLLM made the calls; each produces exactly the rows of docs/design.md §4,
    with the call's timestamp and step, in :data:`kvfabric.contract.schema.EMIT_COLUMNS` order;
  * a block that still holds a digest when ``get_new_blocks`` hands it out was cached: vLLM just evicted it to
    reuse it (our digest is its identity: vLLM's own hash is already gone), so ``block_evicted`` comes first;
  * ``evicted`` remembers at most ``evicted_memory`` digests (oldest forgotten first): rebuilt detection is exact
    within that horizon, and the collector can recompute it over the whole history in SQL;
  * a regretful eviction is counted once: the first admitted lookup within the window that wanted it;
  * ``host`` and ``dp_rank`` are the stream's (its metadata), on every row; ``tenant`` and ``lora`` are the
    request's (its ``LOOKUP`` record), on its request-level rows and its allocations, and a block's are those of
    the request that sealed it (vLLM's block hash includes both, so every request that hits the block has the
    same): on its sealed, rebuilt, touched, freed and evicted rows (an unsealed block's touched and freed rows
    take their request's); null where no request is known (a reset, a loss, a request whose lookup this expander
    did not see).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

from kvfabric.contract import records as R
from kvfabric.contract import schema as S
from kvfabric.contract.records import expand_report
from kvfabric.lifecycle.side_table import SideTable

hash64 = S.hash64
hash64_all = S.hash64_all

_NO_OWNER: tuple[None, None] = (None, None)
"""(tenant, lora) of a request that has neither, or of a row no request owns."""


class Expander:
    """Applies call records to the side table and emits event rows through ``emit`` (``list.append``-like)."""

    def __init__(
        self,
        *,
        num_blocks: int,
        emit: Callable[[tuple], Any],
        engine: str = "local",
        run_id: str = "default",
        policy: str = "lru",
        null_block: int = 0,
        evicted_memory: int = 1_000_000,
        regret_window_s: float = 60.0,
        host: str | None = None,
        dp_rank: int | None = None,
    ) -> None:
        self.num_blocks = num_blocks
        self.engine = engine
        self.run_id = run_id
        self.host = host
        self.dp_rank = dp_rank
        self.policy = policy
        self.emit = emit
        #: Whether rows are emitted: the keeper sets False, and the handlers then skip building them (the keeper
        #: runs on vLLM's scheduler thread, where a call per block that does nothing is still paid).
        self.rows = True
        #: Whether only the side table's lean columns are kept (:data:`~kvfabric.lifecycle.side_table.LEAN_COLUMNS`),
        #: with its lean operations: the keeper of a policy that reads nothing else sets it, and swaps in those
        #: handlers.
        self.lean = False
        self.sealless = False  # (see StatisticsKeeper)
        self.null_block = null_block
        self.evicted_memory = evicted_memory
        self.regret_window_ns = int(regret_window_s * 1e9)
        self.table = SideTable(num_blocks)
        # digest -> [evicted_ns, family, depth, regretted]; insertion order = eviction order.
        self.evicted: OrderedDict[int, list[Any]] = OrderedDict()
        # request id -> (regret candidates, family, prompt tokens, blocks, hit tokens) of its open lookup
        self.pending: dict[str, tuple[list[list[Any]], str | None, int, int, int]] = {}
        # request id -> (tenant, lora) of each live request (from its lookup until its DONE)
        self.owners: dict[str, tuple[str | None, str | None]] = {}
        # block id -> (tenant, lora) of the request that sealed the block (None: not sealed, or by an unknown one)
        self.block_owner: list[tuple[str | None, str | None] | None] = [None] * num_blocks
        # vLLM's ref count of each block as the records tell it (sealing calls carry none: it is this one)
        self.refs: list[int] = [0] * num_blocks
        self.events = 0  # rows emitted
        self.protected_evictions = 0  # pressure evictions of blocks the policy had marked protected (SCORED)
        self._handlers: dict[int, Callable[[tuple], None]] = {
            R.LOOKUP: self._lookup,
            R.ADMITTED: self._admitted,
            R.CANCELLED: self._cancelled,
            R.ALLOCATED: self._allocated,
            R.TOUCHED: self._touched,
            R.FREED: self._freed,
            R.SEALED: self._sealed,
            R.EVICTING: self._evicting,
            R.MOVED: self._moved,
            R.RESET: self._reset,
            R.DONE: self._done,
            R.LIMITED: self._limited,
            R.SCORED: self._scored,
            R.LOST: self._lost,
        }

    # ---- entry points ------------------------------------------------------------------------------------------

    def apply(self, records: Iterable[tuple]) -> None:
        handlers = self._handlers
        for rec in records:
            handlers[rec[0]](rec)

    def apply_one(self, record: tuple) -> None:
        self._handlers[record[0]](record)

    # ---- time and rows (the keeper overrides these) ------------------------------------------------------------

    def _stamp(self, ts: int) -> int:
        """The time a record's uses are written with (``last_use``): the event's wall clock here."""
        return ts

    def _row(self, ts: int, step: int | None, event: str, request_id: str | None = None, *,
             family: str | None = None, depth: int | None = None, prompt_tokens: int | None = None,
             hit_tokens: int | None = None, retain_score: float | None = None, protected: bool | None = None,
             count: int | None = None, owner: tuple[str | None, str | None] | None = None) -> None:
        """A row of no block; ``owner``: the request's (tenant, lora) (default: that of ``request_id``)."""
        if owner is None:
            owner = self.owners.get(request_id, _NO_OWNER)  # type: ignore[arg-type]
        self.events += 1
        self.emit((ts, step, self.engine, self.run_id, event, request_id, None, None, None, family, depth, None,
                   None, None, None, prompt_tokens, hit_tokens, retain_score, protected, self.policy, count, None,
                   None, self.host, self.dp_rank, *owner))

    def _block_row(self, ts: int, step: int, event: str, b: int, ref_count: int, request_id: str | None,
                   age_ns: int | None = None, reason: str | None = None) -> None:
        """A row of block ``b``, with the owner of its content; an unsealed block's (touched, freed) is the
        request's at hand. An evicted block's is never the evicting request's (``reason`` is set only there)."""
        t = self.table
        owner = self.block_owner[b]
        if owner is None:
            owner = _NO_OWNER if reason is not None else self.owners.get(request_id, _NO_OWNER)  # type: ignore[arg-type]
        self.events += 1
        self.emit((ts, step, self.engine, self.run_id, event, request_id, b, t.hash[b], t.parent[b], t.family[b],
                   t.depth[b], ref_count, t.hits[b], t.share[b], t.branch[b], None, None, t.score[b],
                   t.protected[b], self.policy, None, age_ns, reason, self.host, self.dp_rank, *owner))

    def _allocated_row(self, ts: int, step: int, b: int, request_id: str | None) -> None:
        # A fresh block has no identity yet: only its id, its ref count (1 after get_new_blocks) and the request
        # it was handed to (whose tenant and LoRA it now serves) are known.
        owner = self.owners.get(request_id, _NO_OWNER)  # type: ignore[arg-type]
        self.events += 1
        self.emit((ts, step, self.engine, self.run_id, S.BLOCK_ALLOCATED, request_id, b, None, None, None, None, 1,
                   None, None, None, None, None, None, None, self.policy, None, None, None, self.host, self.dp_rank,
                   *owner))

    def _forget(self, b: int, ts: int) -> None:
        """Remember block ``b``'s digest as evicted at ``ts`` (for rebuilt and regret detection)."""
        t = self.table
        h = t.hash[b]
        evicted = self.evicted
        evicted[h] = [ts, t.family[b], t.depth[b], False]  # type: ignore[index]
        evicted.move_to_end(h)  # type: ignore[arg-type]
        if len(evicted) > self.evicted_memory:
            evicted.popitem(last=False)

    def dropped_row(self, count: int, ts: int) -> tuple:
        """A ``sink_dropped`` row for ``count`` lost events."""
        return (ts, None, self.engine, self.run_id, S.SINK_DROPPED, *([None] * 14), self.policy, count, None, None,
                self.host, self.dp_rank, None, None)

    # ---- handlers ----------------------------------------------------------------------------------------------

    def _lookup(self, rec: tuple) -> None:
        _, ts, _step, rid, family, prompt, nblocks, hit, hashes, tenant, lora = rec
        self.owners[rid] = _NO_OWNER if tenant is None and lora is None else (tenant, lora)
        found: list[list[Any]] = []
        evicted = self.evicted
        if evicted and hashes:
            # Taken before vLLM allocates: allocation seals (and so rebuilds) these very blocks.
            horizon = ts - self.regret_window_ns
            for raw in hashes:
                entry = evicted.get(hash64(raw))  # type: ignore[arg-type]
                if entry is not None and not entry[3] and entry[0] >= horizon:
                    found.append(entry)
        self.pending[rid] = (found, family, prompt, nblocks, hit)

    def _admitted(self, rec: tuple) -> None:
        _, ts, step, rid = rec
        opened = self.pending.pop(rid, None)
        if opened is None:
            return  # its lookup was lost (counted where it was lost)
        found, family, prompt, nblocks, hit = opened
        regretful = 0
        for entry in found:
            if not entry[3]:
                entry[3] = True  # each eviction regretted once
                regretful += 1
        self._row(ts, step, S.PREFIX_LOOKUP, rid, family=family, depth=nblocks, prompt_tokens=prompt,
                  hit_tokens=hit, count=regretful)

    def _cancelled(self, rec: tuple) -> None:
        self.pending.pop(rec[1], None)  # (its owner stays: the request asks again, or is freed)

    def _evict(self, b: int, ts: int, step: int, rid: str | None, reason: str, ref: int = 0) -> None:
        """Block ``b`` lost its cached content: ``block_evicted``, the digest remembered, the entry reset."""
        t = self.table
        if self.rows:
            self._block_row(ts, step, S.BLOCK_EVICTED, b, ref, rid, ts - t.last_use[b], reason)
            self._forget(b, ts)
            self.block_owner[b] = None
        t.reset(b)

    def _allocated(self, rec: tuple) -> None:
        _, ts, step, rid, ids, victims = rec
        if victims and self.rows:
            self._ranked(ts, step, rid, victims)
        now = self._stamp(ts)
        t = self.table
        hashes = t.hash
        last_use = t.last_use
        refs = self.refs
        rows = self.rows
        protected = t.protected
        for b in ids:
            if hashes[b] is not None:
                if protected[b]:
                    self.protected_evictions += 1
                self._evict(b, ts, step, rid, S.EVICT_PRESSURE)
            last_use[b] = now
            refs[b] = 1
            if rows:
                self._allocated_row(ts, step, b, rid)

    def _touched(self, rec: tuple) -> None:
        _, ts, step, rid, ids, refs = rec
        now = self._stamp(ts)
        t = self.table
        null = self.null_block
        own = self.refs
        rows = self.rows
        for b, ref in zip(ids, refs, strict=True):
            if b == null:
                continue
            t.touch(b, rid, now)
            own[b] = ref
            if rows:
                self._block_row(ts, step, S.BLOCK_TOUCHED, b, ref, rid)

    def _freed(self, rec: tuple) -> None:
        _, ts, step, rid, ids, refs = rec
        now = self._stamp(ts)
        t = self.table
        null = self.null_block
        own = self.refs
        rows = self.rows
        for b, ref in zip(ids, refs, strict=True):
            if b == null:
                continue
            t.release(b, now)
            own[b] = ref
            if rows:
                self._block_row(ts, step, S.BLOCK_FREED if ref == 0 else S.REF_COUNT_CHANGED, b, ref, rid)

    def _sealed(self, rec: tuple) -> None:
        _, ts, step, rid, family, start, prev, ids, raws, parent_raw = rec
        now = self._stamp(ts)
        t = self.table
        evicted = self.evicted
        null = self.null_block
        refs = self.refs
        rows = self.rows
        prev_id = -1 if prev is None or prev == null else prev
        digests = hash64_all(raws)
        for j, b in enumerate(ids):
            h = digests[j]
            if h is None or b == null:  # masked (left uncached) or a null block: no life starts here
                prev_id = -1 if b == null else b
                continue
            parent: int | None = t.hash[prev_id] if prev_id >= 0 else None
            if parent is None and j == 0 and parent_raw is not None:
                parent = hash64(parent_raw)
            t.seal(b, h, parent, prev_id, start + j, family, rid, now)  # type: ignore[arg-type]
            prev_id = b
            if not rows:
                continue
            self.block_owner[b] = self.owners.get(rid)  # type: ignore[arg-type]
            ref = refs[b]
            self._block_row(ts, step, S.BLOCK_SEALED, b, ref, rid)
            entry = evicted.pop(h, None) if evicted else None  # type: ignore[arg-type]
            if entry is not None:
                self._block_row(ts, step, S.BLOCK_REBUILT, b, ref, rid, ts - entry[0])

    def _evicting(self, rec: tuple) -> None:
        _, ts, step, rid, ids, raws = rec
        t = self.table
        for b, raw in zip(ids, raws, strict=True):
            if raw is None:
                continue
            if t.hash[b] is None:  # cached by a path we did not see: recover the digest
                t.hash[b] = hash64(raw)
            # A connector may evict a block still in use: its ref count stays (vLLM only drops the hash).
            self._evict(b, ts, step, rid, S.EVICT_CONNECTOR, self.refs[b])

    def _moved(self, rec: tuple) -> None:
        # The content (and its statistics) now lives in dst; src keeps being written and holds nothing cached.
        _, _ts, _step, _rid, src, dst = rec
        t = self.table
        for name in ("hash", "parent", "depth", "family", "hits", "share", "users", "branch", "children",
                     "last_use", "protected", "score", "parent_block"):
            column = getattr(t, name)
            column[dst] = column[src]
        t.reset(src)
        if self.rows:
            self.block_owner[dst] = self.block_owner[src]
            self.block_owner[src] = None

    def _reset(self, rec: tuple) -> None:
        """Every cached block is dropped: one ``block_evicted`` (reason ``reset``) each, then ``cache_reset``.

        The digests are remembered like any eviction's: a block cached again after a reset had its prefill
        recomputed, so it counts as rebuilt (wasted prefill) like any other."""
        _, ts, step = rec
        for b in self.table.cached():
            self._evict(b, ts, step, None, S.EVICT_RESET)
        self._row(ts, step, S.CACHE_RESET, count=self.num_blocks)
        self.table.clear()
        if self.rows:
            self.block_owner = [None] * self.num_blocks

    def _done(self, rec: tuple) -> None:
        self.pending.pop(rec[1], None)
        self.owners.pop(rec[1], None)

    def _limited(self, rec: tuple) -> None:
        _, ts, step, rid, family, n = rec
        self._row(ts, step, S.CACHE_ADMISSION_LIMITED, rid, family=family, count=n)

    def _ranked(self, ts: int, step: int, rid: str | None, victims: list[int]) -> None:
        """An allocation's victims were the policy's choice: one ``eviction_candidates_ranked`` row, before the
        allocation evicts them. Their scores and flags came in ``SCORED`` records when they became candidates."""
        t = self.table
        scores = [sc for sc in map(t.score.__getitem__, victims) if sc is not None]
        self._row(ts, step, S.EVICTION_CANDIDATES_RANKED, rid, retain_score=max(scores) if scores else None,
                  protected=any(map(t.protected.__getitem__, victims)), count=len(victims))

    def _scored(self, rec: tuple) -> None:
        _, ids, scores, flags = rec  # (either form of EvictionPolicy.report)
        self.table.score_all(ids, *expand_report(ids, scores, flags))

    def _lost(self, rec: tuple) -> None:
        _, ts, count = rec
        self.events += 1
        self.emit(self.dropped_row(count, ts))


def expander_from_metadata(metadata: dict[str, str], emit: Any) -> Expander:
    """The expander for one stream, configured from its metadata (the forwarder gets nothing else)."""
    extra = json.loads(metadata.get(S.META_SETTINGS, "{}") or "{}")
    return Expander(
        num_blocks=int(metadata[S.META_NUM_BLOCKS]),
        emit=emit,
        engine=metadata[S.META_ENGINE],
        run_id=metadata[S.META_RUN_ID],
        policy=metadata[S.META_POLICY],
        null_block=int(extra.get("null_block", 0)),
        evicted_memory=int(extra.get("evicted_memory", 1_000_000)),
        regret_window_s=float(extra.get("regret_window_s", 60.0)),
        host=metadata.get(S.META_HOST) or None,
        dp_rank=int(metadata[S.META_DP_RANK]) if metadata.get(S.META_DP_RANK) else None,
    )
