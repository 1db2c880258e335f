"""The lifecycle tracker: the side table of every KV block and the events of its life.

One tracker per ``BlockPool``. vLLM's ``KVCacheBlock`` has ``__slots__``, so everything KVFabric knows about a
block lives here, in parallel lists indexed by ``block_id`` (O(1), no per-block objects).

Invariants:
  * nothing here does I/O or takes a lock: events go to an :class:`EventBuffer` as plain tuples;
  * no method raises into vLLM: the hook calls every ``on_*`` through :meth:`guard`, which counts and logs (once)
    any internal error and disables recording rather than break the scheduler;
  * a block's side-table entry describes its *current* cached life: it is reset when the block is evicted (its
    hash removed) and set when it is sealed, so ``hit_count``/``share_degree`` count uses of one cached content;
  * ``evicted`` remembers at most ``settings.evicted_memory`` recently evicted digests (oldest forgotten first),
    which bounds memory and makes online rebuilt detection exact within that horizon (the collector can recompute
    it exactly in SQL over the whole history).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvfabric import schema as S
from kvfabric.config import HookSettings
from kvfabric.hook.buffer import EventBuffer

log = logging.getLogger("kvfabric.hook")

_MAX_USERS = 8  # distinct request ids remembered per block; beyond it share_degree counts changes of user


def request_family(request: Any, block_hashes: Sequence[Any], family_depth: int) -> str | None:
    """Family id of a request (docs/design.md §5).

    A hint wins: ``extra_args["kvfabric_family"]``, then a ``"<family>/<rest>"`` request-id convention; otherwise
    the digest of the block at depth ``min(F, len-1)`` of the request's chain. Requests shorter than one block
    have no family (None).
    """
    params = getattr(request, "sampling_params", None)
    extra = getattr(params, "extra_args", None) if params is not None else None
    if extra:
        hint = extra.get("kvfabric_family")
        if hint:
            return str(hint)
    rid = getattr(request, "request_id", "")
    if "/" in rid:
        return rid.split("/", 1)[0]
    if not block_hashes:
        return None
    h = S.hash64(block_hashes[min(family_depth, len(block_hashes) - 1)])
    return S.family_of_hash(h) if h is not None else None


class SideTable:
    """Per-block statistics, one list per field, indexed by block id (read by policies)."""

    __slots__ = (
        "branch",
        "children",
        "depth",
        "family",
        "hash",
        "hits",
        "last_ns",
        "parent",
        "parent_block",
        "protected",
        "score",
        "share",
        "users",
    )

    def __init__(self, num_blocks: int) -> None:
        self.hash: list[int | None] = [None] * num_blocks
        self.parent: list[int | None] = [None] * num_blocks
        self.depth: list[int | None] = [None] * num_blocks
        self.family: list[str | None] = [None] * num_blocks
        self.hits: list[int] = [0] * num_blocks
        self.share: list[int] = [0] * num_blocks
        self.users: list[tuple[str, ...]] = [()] * num_blocks
        self.branch: list[int] = [0] * num_blocks
        self.children: list[set[int] | None] = [None] * num_blocks
        self.last_ns: list[int] = [0] * num_blocks
        self.protected: list[bool] = [False] * num_blocks
        # Steering (kvfabric.policies): the policy's retain score when the block last became a candidate, and the
        # id of the block holding its parent when it was sealed (-1: root or unknown), so a policy can evict
        # descendants before ancestors without a hash lookup.
        self.score: list[float | None] = [None] * num_blocks
        self.parent_block: list[int] = [-1] * num_blocks

    def reset(self, b: int) -> None:
        self.hash[b] = None
        self.parent[b] = None
        self.depth[b] = None
        self.family[b] = None
        self.hits[b] = 0
        self.share[b] = 0
        self.users[b] = ()
        self.branch[b] = 0
        self.children[b] = None
        self.protected[b] = False
        self.score[b] = None
        self.parent_block[b] = -1

    def use(self, b: int, request_id: str | None) -> None:
        """Record a use of block ``b`` by ``request_id`` (share degree counts distinct users)."""
        if request_id is None:
            return
        users = self.users[b]
        if request_id in users:
            return
        self.share[b] += 1
        self.users[b] = (*users, request_id) if len(users) < _MAX_USERS else (*users[1:], request_id)


class LifecycleTracker:
    """Turns the hook's observations into events and keeps the side table."""

    def __init__(
        self,
        settings: HookSettings,
        num_blocks: int,
        block_size: int,
        engine: str,
        buffer: EventBuffer,
        clock: Callable[[], int] = time.time_ns,
    ) -> None:
        self.settings = settings
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.engine = engine
        self.run_id = settings.run_id
        self.policy_name = settings.policy
        self.buffer = buffer
        self.clock = clock
        self.table = SideTable(num_blocks)
        self.step = 0
        self.enabled = settings.lifecycle  # observers run (steering turns this on for statistics alone)
        self.recording = settings.lifecycle  # events are emitted (off: the side table is kept, nothing emitted)
        self.errors = 0
        # Request context, set by the KVCacheManager wrappers around the pool calls they make.
        self.current_request: Any = None
        self.families: dict[str, str | None] = {}
        # digest -> [evicted_ns, family, depth, regretted]; insertion order = eviction order.
        self.evicted: OrderedDict[int, list[Any]] = OrderedDict()
        self.regret_window_ns = int(settings.regret_window_s * 1e9)
        # Steering, attached by kvfabric.hook.steering when a policy other than lru or the gate is on.
        self.admission_gate: Any = None  # has .mask(tracker, request, blocks, start, end, vllm_mask) -> list[bool]
        self.policy: Any = None  # the EvictionPolicy driving the free queue, if any

    # ---- plumbing -------------------------------------------------------------------------------------------

    def guard(self, fn: Callable[..., None], *args: Any) -> None:
        """Run an ``on_*`` observer; never let an error reach vLLM."""
        if not self.enabled:
            return
        try:
            fn(*args)
        except Exception:  # a bug here must cost the scheduler nothing but this
            self.errors += 1
            if self.errors == 1:
                log.exception("kvfabric: lifecycle recording failed; recording is now off for this engine")
            self.enabled = False

    def _emit(
        self,
        event: str,
        request_id: str | None = None,
        block_id: int | None = None,
        block_hash: int | None = None,
        parent_hash: int | None = None,
        family: str | None = None,
        depth: int | None = None,
        ref_count: int | None = None,
        hit_count: int | None = None,
        share_degree: int | None = None,
        branch_factor: int | None = None,
        prompt_tokens: int | None = None,
        hit_tokens: int | None = None,
        retain_score: float | None = None,
        protected: bool | None = None,
        count: int | None = None,
        age_ns: int | None = None,
        ts_ns: int | None = None,
    ) -> None:
        if not self.recording:
            return
        self.buffer.append(
            (
                self.clock() if ts_ns is None else ts_ns,
                self.step,
                self.engine,
                self.run_id,
                event,
                request_id,
                block_id,
                block_hash,
                parent_hash,
                family,
                depth,
                ref_count,
                hit_count,
                share_degree,
                branch_factor,
                prompt_tokens,
                hit_tokens,
                retain_score,
                protected,
                self.policy_name,
                count,
                age_ns,
                None,
            )
        )

    def _emit_block(
        self, event: str, b: int, ref_count: int, request_id: str | None, ts: int, age_ns: int | None = None,
        reason: str | None = None,
    ) -> None:
        """One block event, built positionally: this runs once per block operation, so no keyword plumbing."""
        if not self.recording:
            return
        t = self.table
        self.buffer.append(
            (ts, self.step, self.engine, self.run_id, event, request_id, b, t.hash[b], t.parent[b], t.family[b],
             t.depth[b], ref_count, t.hits[b], t.share[b], t.branch[b], None, None, t.score[b], t.protected[b],
             self.policy_name, None, age_ns, reason)
        )

    def _request_id(self) -> str | None:
        req = self.current_request
        return None if req is None else req.request_id

    def family_of(self, request: Any) -> str | None:
        rid = request.request_id
        fam = self.families.get(rid, "")
        if fam == "":
            fam = request_family(request, request.block_hashes, self.settings.family_depth)
            if fam is not None or request.block_hashes:
                self.families[rid] = fam
        return fam

    # ---- observers (called by the hook, through guard) --------------------------------------------------------

    def on_step(self) -> None:
        self.step += 1

    def regret_candidates(self, request: Any, hit_tokens: int) -> list[list[Any]]:
        """Eviction records of blocks this lookup wants but missed (docs/design.md §5, regretful eviction).

        Taken *before* vLLM allocates, because allocation seals (and so rebuilds) those very blocks. The walk
        stopped at ``hit_tokens``; every wanted block from there on that was evicted within the window is a miss
        that eviction caused.
        """
        evicted = self.evicted
        hashes = request.block_hashes
        if not evicted or not hashes:
            return []
        horizon = self.clock() - self.regret_window_ns
        found = []
        for j in range(hit_tokens // self.block_size, len(hashes)):
            rec = evicted.get(S.hash64(hashes[j]))
            if rec is not None and not rec[3] and rec[0] >= horizon:
                found.append(rec)
        return found

    def on_admitted(self, request: Any, hit_tokens: int, regret: list[list[Any]]) -> None:
        """A request was admitted (allocate_slots succeeded with nothing computed before): ``prefix_lookup``."""
        regretful = 0
        for rec in regret:
            if not rec[3]:
                rec[3] = True  # each eviction regretted once
                regretful += 1
        self._emit(
            S.PREFIX_LOOKUP,
            request_id=request.request_id,
            family=self.family_of(request),
            depth=len(request.block_hashes),
            prompt_tokens=request.num_prompt_tokens,
            hit_tokens=hit_tokens,
            count=regretful,
        )

    def on_allocated(self, blocks: Sequence[Any]) -> None:
        """``get_new_blocks`` handed out ``blocks``. A block that still had a digest in the side table was cached:
        vLLM just evicted it to reuse it (our digest is its identity: vLLM's hash is already cleared)."""
        now = self.clock()
        rid = self._request_id()
        t = self.table
        last_ns = t.last_ns
        hashes = t.hash
        head = (now, self.step, self.engine, self.run_id, S.BLOCK_ALLOCATED, rid)
        tail = (None,) * 7 + (self.policy_name, None, None, None)
        append = self.buffer.append if self.recording else None
        for blk in blocks:
            b = blk.block_id
            if hashes[b] is not None:
                self._evicted(b, rid, now, S.EVICT_PRESSURE)
            last_ns[b] = now
            if append is not None:
                # A fresh block has no identity yet: only its id and ref count are known.
                append((*head, b, None, None, None, None, blk.ref_cnt, *tail))

    def _evicted(self, b: int, rid: str | None, now: int, reason: str) -> None:
        """Block ``b`` lost its cached content: emit ``block_evicted``, remember the digest, reset the entry."""
        t = self.table
        h = t.hash[b]
        self._emit_block(S.BLOCK_EVICTED, b, 0, rid, now, now - t.last_ns[b], reason)
        evicted = self.evicted
        evicted[h] = [now, t.family[b], t.depth[b], False]
        evicted.move_to_end(h)
        if len(evicted) > self.settings.evicted_memory:
            evicted.popitem(last=False)
        t.reset(b)

    def on_evicting(self, blk: Any) -> None:
        """A cached block is evicted outside ``get_new_blocks`` (``evict_blocks``, used by KV connectors); called
        before vLLM removes its hash."""
        if blk.block_hash is None:
            return
        b = blk.block_id
        if self.table.hash[b] is None:  # cached by a path we do not see: recover the digest
            self.table.hash[b] = S.hash64(blk.block_hash)
        self._evicted(b, self._request_id(), self.clock(), S.EVICT_CONNECTOR)

    def on_touched(self, blocks: Iterable[Any]) -> None:
        now = self.clock()
        rid = self._request_id()
        t = self.table
        for blk in blocks:
            if blk.is_null:
                continue
            b = blk.block_id
            t.hits[b] += 1
            t.use(b, rid)
            t.last_ns[b] = now
            self._emit_block(S.BLOCK_TOUCHED, b, blk.ref_cnt, rid, now)

    def on_freed(self, blocks: Sequence[Any], pool: Any) -> None:
        now = self.clock()
        rid = self._request_id()
        t = self.table
        for blk in blocks:
            if blk.is_null:
                continue
            owner = getattr(blk, "pool", None)
            if owner is not None and owner is not pool:
                continue  # freed through this pool but belonging to another: that pool's tracker sees it
            b = blk.block_id
            t.last_ns[b] = now
            event = S.BLOCK_FREED if blk.ref_cnt == 0 else S.REF_COUNT_CHANGED
            self._emit_block(event, b, blk.ref_cnt, rid, now)

    def on_sealed(
        self,
        request: Any,
        blocks: Sequence[Any],
        start: int,
        end: int,
        block_mask: Sequence[bool] | None,
        hash_block_size: int,
        block_size: int,
    ) -> None:
        """``cache_full_blocks`` ran: blocks[start:end] now carry hashes (unless null or masked out)."""
        now = self.clock()
        rid = request.request_id
        family = self.family_of(request)
        same_granularity = hash_block_size == block_size
        req_hashes = request.block_hashes
        t = self.table
        evicted = self.evicted
        for i in range(start, end):
            blk = blocks[i]
            if blk.is_null or (block_mask is not None and not block_mask[i - start]):
                continue
            if blk.block_hash is None:
                continue
            b = blk.block_id
            h = S.hash64(blk.block_hash)
            parent_id: int | None = None
            parent: int | None = None
            if i > 0:
                prev = blocks[i - 1]
                if not prev.is_null:
                    parent_id = prev.block_id
                    parent = t.hash[parent_id]
                if parent is None and same_granularity and i - 1 < len(req_hashes):
                    parent = S.hash64(req_hashes[i - 1])
            t.hash[b] = h
            t.parent[b] = parent
            t.depth[b] = i
            t.family[b] = family
            t.hits[b] = 0
            t.share[b] = 1
            t.users[b] = (rid,)
            t.last_ns[b] = now
            t.parent_block[b] = -1 if parent_id is None else parent_id
            if parent_id is not None:
                kids = t.children[parent_id]
                if kids is None:
                    t.children[parent_id] = {h}
                    t.branch[parent_id] += 1
                elif h not in kids:
                    kids.add(h)
                    t.branch[parent_id] += 1
            self._emit_block(S.BLOCK_SEALED, b, blk.ref_cnt, rid, now)
            rec = evicted.pop(h, None) if evicted else None
            if rec is not None:
                self._emit_block(S.BLOCK_REBUILT, b, blk.ref_cnt, rid, now, age_ns=now - rec[0])

    def on_admission_limited(self, request: Any, blocks_not_cached: int) -> None:
        self._emit(
            S.CACHE_ADMISSION_LIMITED,
            request_id=request.request_id,
            family=self.family_of(request),
            count=blocks_not_cached,
        )

    def on_candidates_ranked(self, count: int, retain_score: float | None, protected: bool) -> None:
        """A ranking policy chose victims: one event per ``get_new_blocks`` call (bounded), ``count`` victims,
        ``retain_score`` the highest score among them, ``protected`` whether it had to take a protected block."""
        self._emit(
            S.EVICTION_CANDIDATES_RANKED,
            request_id=self._request_id(),
            retain_score=retain_score,
            protected=protected,
            count=count,
        )

    def on_reset(self, ok: bool) -> None:
        if not ok:
            return
        self._emit(S.CACHE_RESET, count=self.num_blocks)
        self.table = SideTable(self.num_blocks)
        self.evicted.clear()

    def on_request_done(self, request_id: str) -> None:
        self.families.pop(request_id, None)

    def dropped_row(self, count: int) -> tuple:
        """A ``sink_dropped`` row for ``count`` lost events, built for the sink thread to send directly (it must
        not go through the buffer, which may be the very thing that is full)."""
        return (self.clock(), self.step, self.engine, self.run_id, S.SINK_DROPPED, *([None] * 14),
                self.policy_name, count, None, None)
