"""Steering: the parts of the hook that change vLLM's decisions (eviction order, admission, scheduling order).

``install()`` calls :func:`attach_steering` only when ``settings.steers``: a policy other than ``lru``, the
admission gate, or cache-aware scheduling. Plain ``lru`` never reaches this module, so vLLM's own order is
untouched in that mode (docs/design.md §3).

Eviction order: the policy's :class:`~kvfabric.policies.index.VictimIndex` holds the cached free blocks in
eviction order beside vLLM's free list, which stays the single truth about which blocks are free, in vLLM's order.
The index follows the recorder's call records, as the statistics keeper does (applied on the scheduler thread right
after each call, before any other pool call can run): a ``FREED`` record's blocks whose ref count reached 0 and
that hold cached content become candidates, in the call's order (the order vLLM appends them to its list); a
``TOUCHED`` record's blocks are in use again and leave (vLLM unlinked them from its list). Only the hand-out is
hooked: the functions of :data:`QUEUE_HOOKS` are bound onto the pool's ``free_block_queue`` *instance*
(:func:`hook_queue`); vLLM's ``FreeKVCacheBlockQueue`` class is untouched. ``popleft_n`` (the only call
``get_new_blocks`` makes) hands out:

1. uncached free blocks from the head of the list (vLLM prepends them there), then
2. the policy's victims, each unlinked in O(1) through the list's own ``remove``, then
3. if the index ran dry (a prefix-cache reset, blocks released by ``unpin_blocks``), whatever is at the head.

Readers of the list itself (``get_all_free_blocks``, ``iter_blocks_after`` as used by vLLM's simple CPU offload)
still see vLLM's LRU order, not the policy's: the list is never reordered, only unlinked from.

Following records rather than hooking the list's ``append_n`` / ``prepend_n`` / ``remove`` is one call per vLLM
call instead of a Python frame per block (``remove`` runs once per touched block, from ``BlockPool.touch``); the
scheduler's time did not measurably change with it (the index's own work is the cost), but fewer of vLLM's methods
are replaced. Should some other path unlink a block, the index would hold a stale entry: ``popleft_n`` re-validates
every candidate (counted in ``stale``), and a stale entry of a block freed again is replaced when it comes back. If
the recorder stops (it failed), frees and touches are no longer seen, so the index is dropped and vLLM's order takes
over (:meth:`Steering.stop_index`).

Invariants (``tests/test_steering*.py`` checks them through vLLM's real BlockPool under random operations):
  * the null block is never queued, hashed or freed (it is never sealed, so the index never takes it);
  * a block is in the free list exactly when its ref count is 0; along vLLM's own paths the index only holds
    blocks that are in the list (and every candidate is re-validated before it is handed out);
  * ``popleft_n(n)`` returns ``n`` blocks whenever ``n`` blocks are free: protection is an order, never a veto;
  * every block handed out still goes through vLLM's ``get_new_blocks``, which removes its hashes before reuse;
  * descendants leave before ancestors (the index's rule) where the policy reorders;
  * cost per allocation: O(log n) (heap) or O(1) (segments), never a scan of the list.

Statistics: a policy reads block statistics from a :class:`~kvfabric.hook.lifecycle.StatisticsKeeper`, which
applies the recorder's call records as they are made (the same side-table code the forwarder runs), with
``last_use`` on the index's logical clock.

Request context: the free wrapper puts the freeing request's :class:`~kvfabric.policies.base.RequestInfo` where
:meth:`Steering.freed` finds it when that free's ``FREED`` record arrives, and the index passes it to the policy's
key.

Admission: :class:`~kvfabric.policies.admission.AnchorAdmissionGate` on ``recorder.gate``; install.py passes its
mask to ``cache_full_blocks``.

Cache-aware scheduling (``KVFABRIC_CACHE_AWARE_SCHEDULING=1``, off by default): a waiting request whose next
uncached block is being prefilled right now by a running request is held back (skipped for this step) until that
request has sealed the shared blocks, so it hits them instead of computing them a second time. See
:class:`CacheAwareHold`.
"""

from __future__ import annotations

import functools
import logging
import types
from collections.abc import Callable, Iterator
from operator import attrgetter
from typing import Any

from kvfabric import schema as S
from kvfabric.config import HookSettings
from kvfabric.hook import records as R
from kvfabric.hook.hints import request_info
from kvfabric.hook.install import hash_attribute
from kvfabric.hook.lifecycle import StatisticsKeeper
from kvfabric.policies import make_policy
from kvfabric.policies.admission import AnchorAdmissionGate
from kvfabric.policies.base import EvictionPolicy, RequestInfo
from kvfabric.policies.index import VictimIndex, make_index

log = logging.getLogger("kvfabric.hook")

class Steering:
    """What steering attached to one pool: the policy, its index and statistics, the gate, the hold; counters."""

    def __init__(self, recorder: Any, policy: EvictionPolicy | None, index: VictimIndex | None,
                 keeper: StatisticsKeeper | None) -> None:
        self.recorder = recorder
        self.policy = policy
        self.index = index
        self.keeper = keeper
        self.gate: AnchorAdmissionGate | None = None
        self.hold: CacheAwareHold | None = None
        self.ctx: RequestInfo | None = None  # the request whose blocks vLLM is freeing right now
        self.blocks: list[Any] = []  # the pool's blocks, by id
        #: Whether vLLM's ``KVCacheBlock.block_hash`` is a property over a ``_block_hash`` field (0.26, 0.33): read
        #: per block, the field costs an attribute load where the property costs a Python call.
        self.hash_field = False
        self.hash_attr = "block_hash"  # the attribute read for a block's hash: ``_block_hash`` where hash_field
        #: A free's candidates (:func:`freed_candidates_py`, or its compiled copy unless ``KVFABRIC_NATIVE=0``).
        self.candidates: Callable[..., tuple[list[int], list[int] | None]] = freed_candidates_py
        #: Whether the keeper follows no sealing (``StatisticsKeeper.sealless``): frees then name the candidates'
        #: content and give the index its parent links (:meth:`freed`).
        self.sealless = keeper is not None and keeper.sealless
        self.null_block = 0  # the pool's null block (never a parent)
        self.victims = 0  # blocks the policy chose
        self.fallbacks = 0  # blocks taken from the head because the index had none (reset, unpinned blocks)
        self.stale = 0  # index entries found no longer free or no longer cached (skipped)
        self.errors = 0
        #: Whether events go out (lifecycle recording on): new candidates' retain scores and protection flags are
        #: then reported (``SCORED``), for the expander to keep and write into event rows.
        self.reports = recorder.log is not None
        #: Whether victim choices are reported too (in the allocation's ``ALLOCATED`` record, which the expander
        #: summarises as ``eviction_candidates_ranked`` from those scores and flags: the policy ranks).
        self.ranked = self.reports and policy is not None and policy.ranked
        # The policy's eviction observers (of several blocks, of one block), or None when it keeps the base class's
        # no-ops (saves a call per eviction).
        self.on_evicted: Callable[[Any, list[int], int], None] | None = None
        self.on_evicted_one: Callable[[Any, int, int], None] | None = None
        if policy is not None and (type(policy).on_evicted is not EvictionPolicy.on_evicted
                                   or type(policy).on_evicted_all is not EvictionPolicy.on_evicted_all):
            all_ = self.on_evicted = policy.on_evicted_all
            self.on_evicted_one = (policy.on_evicted if type(policy).on_evicted is not EvictionPolicy.on_evicted
                                   else lambda t, b, now: all_(t, [b], now))

    def failed(self, where: str) -> None:
        """A steering step failed: count it, log once; vLLM's own call is never affected."""
        self.errors += 1
        if self.errors == 1:
            log.exception("kvfabric: steering %s failed; eviction falls back to vLLM's order where needed", where)

    def add(self, ids: list[int], parents: list[int] | None = None) -> None:
        """Blocks ``ids`` (cached, unreferenced, their content already known to the keeper: :meth:`freed` names it)
        became candidates together, in this order (``parents``: the block holding each one's parent content, -1:
        none, where known); their scores go out in one ``SCORED`` record when events are recorded."""
        index = self.index
        if index is None or not ids:
            return
        try:
            if any(map(index.held.__getitem__, ids)):
                # Blocks coming back to the list were not in it: an entry they still have is stale (see above).
                index.discard_all(ids)
            ids, keys = index.add_many(ids, self.ctx, parents)
            pending = self.recorder.log
            if ids and pending is not None:
                # Reported only: what reads scores and flags (event rows, ``eviction_candidates_ranked``) is the
                # expander, which keeps them in its own side table.
                scores, flags = index.policy.report(index.owner.table, ids, keys, index.now)
                pending.append((R.SCORED, ids, scores, flags))
        except Exception:
            self.failed("add")

    def freed(self, rec: tuple) -> None:
        """A ``FREED`` record (the keeper follows them here): blocks whose last reference went and that hold cached
        content (vLLM's own hash, the truth) become candidates (the null block never holds any).

        With a keeper that follows no sealing (``StatisticsKeeper.sealless``) the candidates' digests go to the
        keeper's table, and their parent links come from the free's order: inside ``KVCacheManager.free``
        (``ctx`` set), vLLM frees a request's blocks tail first, so each block's parent content is in the block
        after it, which the request held until now (so that block still holds it). Other frees (a sliding
        window's dropped blocks, unpinned ones) give no links. :func:`freed_candidates` does it in one pass."""
        if self.index is None:
            return
        try:
            keeper = self.keeper
            sealless = self.sealless and keeper is not None
            ids, parents = self.candidates(rec[4], rec[5], self.blocks, self.hash_attr, self.null_block,
                                            sealless and self.ctx is not None,
                                            keeper.table.hash if sealless else None,  # type: ignore[union-attr]
                                            S.hash64)
        except Exception:
            self.failed("add")
            return
        self.add(ids, parents)

    def touched(self, rec: tuple) -> None:
        """A ``TOUCHED`` record (the keeper follows them here): its blocks are in use again, no longer candidates."""
        index = self.index
        if index is None:
            return
        try:
            index.discard_all(rec[4])
        except Exception:
            self.failed("discard")
            self.stop_index()  # touched blocks may be left in it: it no longer tells what is free

    def stop_index(self) -> None:
        """The index can no longer be trusted (the recorder stopped, so touches go unseen; or a discard failed):
        drop it, and vLLM's own order hands out every block from now on. Counted as an error, logged once."""
        if self.index is None:
            return
        self.index = None
        self.errors += 1
        log.warning("kvfabric: steering's victim index stopped (%s); eviction follows vLLM's order",
                    "the recorder stopped" if not self.recorder.on else "a discard failed")


def freed_candidates_py(ids: list[int], refs: list[int], blocks: list[Any], field: str, null: int, chain: bool,
                        names: list[Any] | None, hash64: Callable[[Any], Any]) -> tuple[list[int], list[int] | None]:
    """The blocks of one free (``ids``, their ref counts after it ``refs``) that become candidates: unreferenced
    and holding cached content (vLLM's hash, attribute ``field`` of ``blocks[b]``, not None), in the free's order.
    With ``chain``, each one's parent block too: the id after it in the free (-1 for the last, and for the null
    block). Where ``names`` is given, ``names[b] = hash64(hash)`` for each candidate. Returns (candidates,
    parents or None). The compiled ``_order.freed_candidates`` is the same function in one pass (tested)."""
    read = attrgetter(field)
    out: list[int] = []
    parents: list[int] | None = [] if chain else None
    last = len(ids) - 1
    for i, (b, ref) in enumerate(zip(ids, refs, strict=True)):
        if ref:
            continue  # another request still holds it
        raw = read(blocks[b])
        if raw is None:
            continue  # not cached: reusing it evicts nothing
        if names is not None:
            names[b] = hash64(raw)
        out.append(b)
        if parents is not None:
            p = ids[i + 1] if i < last else -1
            parents.append(-1 if p == null else p)
    return out, parents


try:
    from kvfabric.policies._order import freed_candidates
except ImportError:  # (not built: see kvfabric/policies/native_index.py)
    freed_candidates = freed_candidates_py


def hook_queue(queue: Any, steering: Steering) -> None:
    """Make ``queue`` (vLLM's free list) hand out the policy's victims: the functions of :data:`QUEUE_HOOKS` are
    bound onto this one instance as attributes; they unlink through vLLM's own ``remove``. Not a
    subclass assigned to ``__class__``: on CPython 3.11 that turns the object's attributes into a plain dict, and
    vLLM's own list operations (``self.num_free_blocks`` ...) then run slower on every free, touch and allocation."""
    queue._kv_steering = steering
    for name, fn in QUEUE_HOOKS.items():
        setattr(queue, name, types.MethodType(fn, queue))


# ---- the free queue's methods (``self``: vLLM's FreeKVCacheBlockQueue instance; bound by hook_queue) ----
def _popleft(self: Any) -> Any:
    if self.num_free_blocks <= 0:
        return type(self).popleft(self)  # raises vLLM's own error
    return self.popleft_n(1)[0]

def _popleft_n(self: Any, n: int) -> list[Any]:
    if n <= 0:
        return []
    assert self.num_free_blocks >= n  # vLLM's own precondition (get_new_blocks checks it first)
    st = self._kv_steering
    if n == 1:
        blk = _evict_one(self, st)
        if blk is not None:
            return [blk]
    if st.index is not None and not st.recorder.on:
        st.stop_index()
    index = st.index
    head = self.fake_free_list_head
    tail = self.fake_free_list_tail
    unlink = type(self).remove
    out: list[Any] = []
    # 1. Uncached blocks first: vLLM keeps them at the head, and reusing them evicts nothing. (The index
    # holds cached blocks only, but a connector may have dropped a waiting block's hash: forget it too.)
    while len(out) < n:
        blk = head.next_free_block
        if blk is None or blk is tail or blk.block_hash is not None:
            break
        unlink(self, blk)
        out.append(blk)
    if index is not None and out:
        try:
            held = index.held
            for blk in out:
                if held[blk.block_id]:
                    index.discard(blk.block_id)
        except Exception:
            st.failed("discard")
    # 2. The policy's victims.
    chosen: list[int] = []
    if len(out) < n and index is not None:
        blocks = st.blocks
        on_evicted = st.on_evicted
        try:
            t = index.owner.table
            while len(out) < n:
                got = index.pop_n(n - len(out))
                if not got:
                    break
                taken: list[int] = []
                for b in got:
                    blk = blocks[b]
                    # Re-validate: only a block that is in the list (so unreferenced) may go. (One that lost
                    # its hash meanwhile may go too: it is free, and its reuse evicts nothing.)
                    if blk.prev_free_block is None or blk.ref_cnt != 0:
                        st.stale += 1
                        continue
                    unlink(self, blk)
                    out.append(blk)
                    taken.append(b)
                if on_evicted is not None and taken:
                    on_evicted(t, taken, index.now)
                chosen += taken
        except Exception:
            st.failed("victim choice")
    # 3. Whatever is left, in vLLM's order (never fail while n blocks are free).
    while len(out) < n:
        blk = head.next_free_block
        assert blk is not None and blk is not tail, "free list shorter than num_free_blocks"
        unlink(self, blk)
        if index is not None:
            try:
                index.discard(blk.block_id)
            except Exception:
                st.failed("discard")
        st.fallbacks += 1
        out.append(blk)
    if index is not None:
        index.now += n  # the index's clock (``tick``), inline: a call per allocation shows in the scheduler's time
    if chosen:
        st.victims += len(chosen)
        if st.ranked:
            _report_victims(st.recorder, chosen)
    return out


def _report_victims(r: Any, chosen: list[int]) -> None:
    """The allocation in progress evicted ``chosen`` by the policy's choice: its ``ALLOCATED`` record says so."""
    if r.victims is None:
        r.victims = chosen
    else:  # (a second hand-out within one allocation)
        r.victims += chosen


def _evict_one(self: Any, st: Steering) -> Any | None:
    """The usual hand-out of one block (vLLM allocates a decoding request's blocks one at a time) when no uncached
    block is at the head: the policy's victim, taken as :func:`_popleft_n` takes victims but without its lists.
    None where :func:`_popleft_n` must decide (no index, an uncached head, a stale victim, a failure); a stale entry
    popped here is counted and gone, and the general path takes the next one."""
    index = st.index
    if index is None or not st.recorder.on:
        return None
    blk = self.fake_free_list_head.next_free_block
    if blk is None or blk is self.fake_free_list_tail or (blk._block_hash if st.hash_field else blk.block_hash) is None:
        return None
    try:
        b = index.pop()
        if b is None:
            return None
        blk = st.blocks[b]
        if blk.prev_free_block is None or blk.ref_cnt != 0:  # (re-validated, as in _popleft_n)
            st.stale += 1
            return None
        type(self).remove(self, blk)
    except Exception:
        st.failed("victim choice")
        return None
    now = index.now
    index.now = now + 1
    st.victims += 1
    if st.on_evicted_one is not None:
        try:
            st.on_evicted_one(index.owner.table, b, now)
        except Exception:
            st.failed("victim choice")
    if st.ranked:
        _report_victims(st.recorder, [b])
    return blk


QUEUE_HOOKS: dict[str, Callable[..., Any]] = {
    "popleft": _popleft,
    "popleft_n": _popleft_n,
}
"""The methods :func:`hook_queue` binds onto the queue instance, by the name vLLM calls."""


def _iter_digests(hashes: Any, start: int) -> Iterator[int]:
    """64-bit digests of ``hashes[start:]``, computed lazily (policies stop at the first one they do not know)."""
    for i in range(start, len(hashes)):
        h = S.hash64(hashes[i])
        if h is None:
            return
        yield h


def _ending_info(request: Any, info_of: Callable[[Any], RequestInfo]) -> RequestInfo:
    """The freeing request's context. A preempted request is freed too, and will be back: only a finished one
    ends its session."""
    info = info_of(request)
    if info.session_end:
        is_finished = getattr(request, "is_finished", None)
        if callable(is_finished) and not is_finished():
            info = RequestInfo(info.request_id, info.family, info.session, False, info.position)
    return info


def _wrap_manager_for_policy(manager: Any, steering: Steering, block_size: int,
                             info_of: Callable[[Any], RequestInfo]) -> None:
    """Per-request policy observers: admission (ghost judgement, on the recorder's admission path, which
    ``allocate_slots`` takes only for requests with nothing computed) and the context of a free."""
    free = manager.free
    policy = steering.policy
    assert policy is not None

    def observe_admission(request: Any, hit_tokens: int) -> None:
        try:
            hit = hit_tokens // block_size
            hashes = request.block_hashes
            policy.on_request_started(info_of(request), hit, len(hashes), _iter_digests(hashes, hit))
        except Exception:
            steering.failed("admission observer")

    @functools.wraps(free)
    def kvfabric_policy_free(request: Any, *args: Any, **kwargs: Any) -> Any:
        prev = steering.ctx
        try:
            steering.ctx = _ending_info(request, info_of)
        except Exception:
            steering.failed("free observer")
            steering.ctx = None
        try:
            return free(request, *args, **kwargs)
        finally:
            steering.ctx = prev

    if type(policy).on_request_started is not EvictionPolicy.on_request_started:
        steering.recorder.fresh_observers.append(observe_admission)  # a policy that learns from admissions
    manager.free = kvfabric_policy_free


class CacheAwareHold:
    """Hold back a waiting request while a running request prefills the blocks it is about to need.

    Rule, for a fresh waiting request R and each running request P still in its prompt: let ``g`` be the number of
    P's blocks already hashed (sealed, including this step's chunk). If R's block ``g`` is P's block ``g`` (equal
    chained hashes: the whole prefix up to ``g`` is shared) and no cached copy of it exists, R would compute blocks
    P is about to produce, so R is skipped for this step (vLLM's own "skip" path: it keeps its place in the queue).
    O(running prefills) per waiting request, no scan of blocks. R is released as soon as P passes the point where
    they diverge, finishes its prompt, or stops running, so a hold lasts at most one prefill.
    """

    def __init__(self, scheduler: Any, pool: Any, block_size: int) -> None:
        self.scheduler = scheduler
        self.pool = pool
        self.block_size = block_size
        self.held_steps = 0  # (request, step) pairs held
        self.held_requests: set[str] = set()
        self.errors = 0
        self._managers = self._single_type_managers(scheduler)

    @staticmethod
    def _single_type_managers(scheduler: Any) -> list[Any]:
        coord = getattr(getattr(scheduler, "kv_cache_manager", None), "coordinator", None)
        return list(getattr(coord, "single_type_managers", ()) or ())

    def _sealed_blocks(self, p: Any) -> int:
        for m in self._managers:
            n = getattr(m, "num_cached_block", None)
            if n is not None:
                return int(n.get(p.request_id, 0))
        return p.num_computed_tokens // self.block_size

    def should_hold(self, request: Any) -> bool:
        if request.num_computed_tokens != 0:
            return False
        r_hashes = request.block_hashes
        if not r_hashes:
            return False
        bs = self.block_size
        for p in self.scheduler.running:
            if p is request or p.num_computed_tokens >= p.num_prompt_tokens:
                continue
            g = self._sealed_blocks(p)
            if g >= len(r_hashes) or g >= p.num_prompt_tokens // bs or g >= len(p.block_hashes):
                continue
            if r_hashes[g] != p.block_hashes[g]:
                continue
            if self.pool.get_cached_block(r_hashes[g], [0]) is not None:
                continue  # another copy is cached already: nothing to wait for
            return True
        return False

    def attach(self) -> None:
        original = self.scheduler._handle_blocked_waiting_request

        @functools.wraps(original)
        def kvfabric_handle_blocked_waiting_request(request: Any) -> bool:
            ready = original(request)
            if not ready:
                return ready
            try:
                if self.should_hold(request):
                    self.held_steps += 1
                    self.held_requests.add(request.request_id)
                    return False
            except Exception:
                self.errors += 1
                if self.errors == 1:
                    log.exception("kvfabric: cache-aware scheduling failed; requests are no longer held")
            return True

        self.scheduler._handle_blocked_waiting_request = kvfabric_handle_blocked_waiting_request


def attach_steering(
    scheduler: Any,
    manager: Any,
    installation: Any,
    settings: HookSettings,
    policy: EvictionPolicy | None = None,
    *,
    info_of: Callable[[Any], RequestInfo] = request_info,
) -> Steering:
    """Attach what ``settings`` asks for (policy, gate, cache-aware scheduling) to one manager's pool.

    ``policy`` overrides ``settings.policy`` (the replay's optimum). ``scheduler`` may be None (a bare
    KVCacheManager, as in tests): cache-aware scheduling then has nothing to attach to. ``info_of`` reads a
    request's context (the replay adds its trace position). The returned :class:`Steering` is also kept as
    ``pool._kvfabric_steering``.
    """
    pool = manager.block_pool
    recorder = installation.recorder
    block_size = installation.block_size
    if policy is None and settings.policy != "lru":
        policy = make_policy(settings.policy, settings)
    index = None
    keeper = None
    if policy is not None:
        num_blocks = int(pool.num_gpu_blocks)
        null_block = int(getattr(getattr(pool, "null_block", None), "block_id", 0) or 0)
        clock: list[VictimIndex] = []
        keeper = StatisticsKeeper(num_blocks, lambda: clock[0].now, null_block, policy.reads)
        index = make_index(policy, keeper, num_blocks, native=settings.native)
        clock.append(index)
        recorder.keeper = keeper
    steering = Steering(recorder, policy, index, keeper)
    if policy is not None and index is not None and keeper is not None:
        queue = pool.free_block_queue
        steering.blocks = pool.blocks
        steering.hash_attr = hash_attribute(pool.blocks)
        steering.hash_field = steering.hash_attr == "_block_hash"
        steering.candidates = freed_candidates if settings.native else freed_candidates_py
        steering.null_block = null_block
        hook_queue(queue, steering)
        keeper.follow(R.FREED, steering.freed)
        keeper.follow(R.TOUCHED, steering.touched)
        # Cached blocks already free (a hook installed on a warm pool) become candidates, in the list's order.
        # (Taken as one free of them, by no request: the same selection, naming and order as any free's.)
        free_now = [blk.block_id for blk in queue.get_all_free_blocks()]
        steering.freed((R.FREED, 0, 0, None, free_now, [0] * len(free_now)))
        _wrap_manager_for_policy(manager, steering, block_size, info_of)
    if settings.admission_gate_on:
        steering.gate = AnchorAdmissionGate(settings.admission_anchor_blocks)
        recorder.gate = steering.gate
    if settings.cache_aware_scheduling and scheduler is not None:
        steering.hold = CacheAwareHold(scheduler, pool, block_size)
        steering.hold.attach()
    pool._kvfabric_steering = steering
    log.info(
        "kvfabric: steering attached (policy=%s, index=%s, admission_anchor_blocks=%s, cache_aware_scheduling=%s)",
        policy.name if policy is not None else "lru",
        type(index).__name__ if index is not None else "none",
        settings.admission_anchor_blocks if steering.gate is not None else "off",
        steering.hold is not None,
    )
    return steering
