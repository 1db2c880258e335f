"""Steering: the parts of the hook that change vLLM's decisions (eviction order, admission, scheduling order).

``install()`` calls :func:`attach_steering` only when ``settings.steers``: a policy other than ``lru``, the
admission gate, or cache-aware scheduling. Plain ``lru`` never reaches this module, so vLLM's own order is
untouched in that mode (docs/design.md §3).

Eviction order: the class of the pool's ``free_block_queue`` *instance* is swapped for a subclass of vLLM's
``FreeKVCacheBlockQueue`` (:func:`policy_queue_class`). The doubly linked list stays the single truth about which
blocks are free, in vLLM's order; the policy's :class:`~kvfabric.policies.index.VictimIndex` holds the cached
free blocks in eviction order beside it. ``popleft_n`` (the only call ``get_new_blocks`` makes) hands out:

1. uncached free blocks from the head of the list (vLLM prepends them there), then
2. the policy's victims, each unlinked in O(1) through the list's own ``remove``, then
3. if the index ran dry (a prefix-cache reset, blocks released by ``unpin_blocks``), whatever is at the head.

Readers of the list itself (``get_all_free_blocks``, ``iter_blocks_after`` as used by vLLM's simple CPU offload)
still see vLLM's LRU order, not the policy's: the list is never reordered, only unlinked from.

Invariants (``tests/test_steering*.py`` checks them through vLLM's real BlockPool under random operations):
  * the null block is never queued, hashed or freed (it never enters the list, so the index never sees it);
  * a block is in the free list exactly when its ref count is 0; the index only holds blocks that are in the list
    and hashed (every candidate is re-validated before it is handed out);
  * ``popleft_n(n)`` returns ``n`` blocks whenever ``n`` blocks are free: protection is an order, never a veto;
  * every block handed out still goes through vLLM's ``get_new_blocks``, which removes its hashes before reuse;
  * descendants leave before ancestors (the index's rule) where the policy reorders;
  * cost per allocation: O(log n) (heap) or O(1) (segments), never a scan of the list.

Admission: :class:`~kvfabric.policies.admission.AnchorAdmissionGate` on ``tracker.admission_gate``; install.py
passes its mask to ``cache_full_blocks``.

Cache-aware scheduling (``KVFABRIC_CACHE_AWARE_SCHEDULING=1``, off by default): a waiting request whose next
uncached block is being prefilled right now by a running request is held back (skipped for this step) until that
request has sealed the shared blocks, so it hits them instead of computing them a second time. See
:class:`CacheAwareHold`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from typing import Any

from kvfabric import schema as S
from kvfabric.config import HookSettings
from kvfabric.hook.tracker import LifecycleTracker
from kvfabric.policies import make_policy
from kvfabric.policies.admission import AnchorAdmissionGate
from kvfabric.policies.base import EvictionPolicy, RequestInfo
from kvfabric.policies.index import VictimIndex, make_index

log = logging.getLogger("kvfabric.hook")

_QUEUE_CLASSES: dict[type, type] = {}


def request_info(request: Any) -> RequestInfo:
    """Request hints from ``SamplingParams.extra_args``.

    Keys: ``kvfabric_family``, ``kvfabric_session``, ``kvfabric_session_end``; vLLM 0.33's own ``session_id``
    stands in for a missing ``kvfabric_session``.
    """
    params = getattr(request, "sampling_params", None)
    extra = getattr(params, "extra_args", None) or {}
    session = extra.get("kvfabric_session")
    if session is None:
        session = getattr(request, "session_id", None)  # vLLM 0.33 carries one of its own
    family = extra.get("kvfabric_family")
    return RequestInfo(
        request_id=str(getattr(request, "request_id", "")),
        family=None if family is None else str(family),
        session=None if session is None else str(session),
        session_end=bool(extra.get("kvfabric_session_end", False)),
    )


class Steering:
    """What steering attached to one pool: the policy, its index, the gate, the hold; plus counters."""

    def __init__(self, tracker: LifecycleTracker, policy: EvictionPolicy | None, index: VictimIndex | None) -> None:
        self.tracker = tracker
        self.policy = policy
        self.index = index
        self.gate: AnchorAdmissionGate | None = None
        self.hold: CacheAwareHold | None = None
        self.victims = 0  # blocks the policy chose
        self.protected_victims = 0  # of which the policy had marked protected (it had nothing else left)
        self.fallbacks = 0  # blocks taken from the head because the index had none (reset, unpinned blocks)
        self.stale = 0  # index entries found no longer free or no longer cached (skipped)
        self.errors = 0
        #: Whether events go out (lifecycle recording on): retain scores and protection are kept for them.
        self.reports = bool(tracker.settings.lifecycle)
        # The policy's eviction observer, or None when it keeps the base class's no-op (saves a call per victim).
        self.on_evicted = (
            policy.on_evicted
            if policy is not None and type(policy).on_evicted is not EvictionPolicy.on_evicted
            else None
        )

    def failed(self, where: str) -> None:
        """A steering observer failed: count it, log once; vLLM's own call is never affected."""
        self.errors += 1
        if self.errors == 1:
            log.exception("kvfabric: steering %s failed; eviction falls back to vLLM's order where needed", where)


def policy_queue_class(base: type) -> type:
    """A subclass of ``base`` (vLLM's ``FreeKVCacheBlockQueue``) whose victims come from a policy's index."""
    cls = _QUEUE_CLASSES.get(base)
    if cls is not None:
        return cls

    class PolicyFreeBlockQueue(base):  # type: ignore[misc, valid-type]
        """vLLM's free list plus a victim index over its cached blocks (see the module docstring)."""

        _kv_steering: Steering
        _kv_blocks: list[Any]

        # -- additions --------------------------------------------------------------------------------------

        def _kv_add(self, blk: Any) -> None:
            st = self._kv_steering
            index = st.index
            if index is None or blk.block_hash is None:
                return
            try:
                b = blk.block_id
                key = index.add(b)
                if st.reports:
                    # Only events carry these (block_evicted's retain_score/protected): skip them when none go out.
                    policy = st.policy
                    t = st.tracker.table
                    t.score[b] = policy.retain_score(key, index.now)  # type: ignore[union-attr]
                    t.protected[b] = policy.is_protected(t, b, key, index.now)  # type: ignore[union-attr]
            except Exception:
                st.failed("add")

        def append(self, block: Any) -> None:
            super().append(block)
            self._kv_add(block)

        def append_n(self, blocks: list[Any]) -> None:
            super().append_n(blocks)
            for blk in blocks:
                self._kv_add(blk)

        def prepend_n(self, blocks: list[Any]) -> None:
            # vLLM prepends only uncached blocks; a cached one (not a vLLM path today) still becomes a candidate.
            super().prepend_n(blocks)
            for blk in blocks:
                if blk.block_hash is not None:
                    self._kv_add(blk)

        # -- removals ---------------------------------------------------------------------------------------

        def remove(self, block: Any) -> None:
            super().remove(block)
            index = self._kv_steering.index
            if index is not None:
                index.discard(block.block_id)

        def popleft(self) -> Any:
            if self.num_free_blocks <= 0:
                return super().popleft()  # raises vLLM's own error
            return self.popleft_n(1)[0]

        def popleft_n(self, n: int) -> list[Any]:
            if n <= 0:
                return []
            assert self.num_free_blocks >= n  # vLLM's own precondition (get_new_blocks checks it first)
            st = self._kv_steering
            index = st.index
            head = self.fake_free_list_head
            tail = self.fake_free_list_tail
            unlink = base.remove
            out: list[Any] = []
            # 1. Uncached blocks first: vLLM keeps them at the head, and reusing them evicts nothing.
            while len(out) < n:
                blk = head.next_free_block
                if blk is None or blk is tail or blk.block_hash is not None:
                    break
                unlink(self, blk)
                if index is not None:
                    index.discard(blk.block_id)
                out.append(blk)
            # 2. The policy's victims.
            chosen = 0
            top_score: float | None = None
            any_protected = False
            if len(out) < n and index is not None:
                blocks = self._kv_blocks
                t = st.tracker.table
                reports = st.reports
                on_evicted = st.on_evicted
                try:
                    while len(out) < n:
                        b = index.pop()
                        if b is None:
                            break
                        blk = blocks[b]
                        # Re-validate: only a block that is in the list, hashed and unreferenced may go.
                        if blk.prev_free_block is None or blk.block_hash is None or blk.ref_cnt != 0:
                            st.stale += 1
                            continue
                        unlink(self, blk)
                        out.append(blk)
                        chosen += 1
                        if reports:
                            score = t.score[b]
                            if score is not None and (top_score is None or score > top_score):
                                top_score = score
                            if t.protected[b]:
                                any_protected = True
                                st.protected_victims += 1
                        if on_evicted is not None:
                            on_evicted(t, b, index.now)
                except Exception:
                    st.failed("victim choice")
            # 3. Whatever is left, in vLLM's order (never fail while n blocks are free).
            while len(out) < n:
                blk = head.next_free_block
                assert blk is not None and blk is not tail, "free list shorter than num_free_blocks"
                unlink(self, blk)
                if index is not None:
                    index.discard(blk.block_id)
                st.fallbacks += 1
                out.append(blk)
            if index is not None:
                index.tick(n)
            if chosen:
                st.victims += chosen
                if st.reports and st.policy is not None and st.policy.ranked:
                    tr = st.tracker
                    tr.guard(tr.on_candidates_ranked, chosen, top_score, any_protected)
            return out

    PolicyFreeBlockQueue.__name__ = f"KVFabricPolicy{base.__name__}"
    PolicyFreeBlockQueue.__qualname__ = PolicyFreeBlockQueue.__name__
    _QUEUE_CLASSES[base] = PolicyFreeBlockQueue
    return PolicyFreeBlockQueue


def _iter_digests(hashes: Any, start: int) -> Iterator[int]:
    """64-bit digests of ``hashes[start:]``, computed lazily (policies stop at the first one they do not know)."""
    for i in range(start, len(hashes)):
        h = S.hash64(hashes[i])
        if h is None:
            return
        yield h


def _wrap_manager_for_policy(manager: Any, steering: Steering, block_size: int) -> None:
    """Per-request policy observers: admission (ghost judgement) and free (session hints around the free)."""
    allocate_slots = manager.allocate_slots
    free = manager.free
    policy = steering.policy
    assert policy is not None

    @functools.wraps(allocate_slots)
    def kvfabric_policy_allocate_slots(request: Any, num_new_tokens: int, *args: Any, **kwargs: Any) -> Any:
        if request.num_computed_tokens == 0:
            try:
                hit_tokens = kwargs.get("num_new_computed_tokens", args[0] if args else 0) or 0
                hit = hit_tokens // block_size
                hashes = request.block_hashes
                policy.on_request_started(request_info(request), hit, len(hashes), _iter_digests(hashes, hit))
            except Exception:
                steering.failed("admission observer")
        return allocate_slots(request, num_new_tokens, *args, **kwargs)

    @functools.wraps(free)
    def kvfabric_policy_free(request: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            info = request_info(request)
            if info.session_end:
                # A preempted request is freed too, and will be back: only a finished one ends its session.
                is_finished = getattr(request, "is_finished", None)
                if callable(is_finished) and not is_finished():
                    info = RequestInfo(info.request_id, info.family, info.session, False)
            policy.on_request_finished(info, ())
        except Exception:
            steering.failed("free observer")
        try:
            return free(request, *args, **kwargs)
        finally:
            policy.on_request_freed()

    manager.allocate_slots = kvfabric_policy_allocate_slots
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
    pool: Any,
    tracker: LifecycleTracker,
    settings: HookSettings,
    policy: EvictionPolicy | None = None,
    *,
    manager: Any = None,
) -> Steering:
    """Attach what ``settings`` asks for (policy, gate, cache-aware scheduling) to one scheduler's pool.

    ``policy`` overrides ``settings.policy`` (the replay uses it for the offline optimum). ``scheduler`` may be
    None when ``manager`` (a bare KVCacheManager, as in tests) is given: cache-aware scheduling then has nothing
    to attach to. The returned :class:`Steering` is also kept as ``pool._kvfabric_steering``.
    """
    if manager is None and scheduler is not None:
        manager = getattr(scheduler, "kv_cache_manager", None)
    block_size = int(getattr(scheduler, "block_size", 0) or tracker.block_size or getattr(pool, "hash_block_size", 16))
    if not tracker.enabled and not settings.lifecycle:
        # Policies read the side table, which the tracker keeps only while it runs; with lifecycle recording off
        # it runs for the statistics alone: no events, and only the observers that feed the fields policies read.
        _statistics_only(tracker)
    if policy is None and settings.policy != "lru":
        policy = make_policy(settings.policy, settings)
    index = None
    if policy is not None:
        index = make_index(policy, tracker, int(pool.num_gpu_blocks))
    steering = Steering(tracker, policy, index)
    if policy is not None and index is not None:
        queue = pool.free_block_queue
        # Candidates already in the queue (a hook installed on a warm pool) become known to the index.
        queue.__class__ = policy_queue_class(type(queue))
        queue._kv_steering = steering
        queue._kv_blocks = pool.blocks
        for blk in queue.get_all_free_blocks():
            queue._kv_add(blk)
        tracker.policy = policy
        if manager is not None:
            _wrap_manager_for_policy(manager, steering, block_size)
    if settings.admission_gate_on:
        steering.gate = AnchorAdmissionGate(settings.admission_anchor_blocks)
        tracker.admission_gate = steering.gate
    if settings.cache_aware_scheduling and scheduler is not None:
        steering.hold = CacheAwareHold(scheduler, pool, block_size)
        steering.hold.attach()
    pool._kvfabric_steering = steering
    log.info(
        "kvfabric: steering attached (policy=%s, admission_anchor_blocks=%s, cache_aware_scheduling=%s)",
        policy.name if policy is not None else "lru",
        settings.admission_anchor_blocks if steering.gate is not None else "off",
        steering.hold is not None,
    )
    return steering


def _statistics_only(tracker: LifecycleTracker) -> None:
    """Turn a tracker whose lifecycle recording is off into a lean keeper of the side-table fields policies read.

    The tracker's own statistics mode (``enabled`` on, ``recording`` off) would do: this only makes it cheaper.
    Policies and the victim index read ``hash``, ``parent``, ``parent_block``, ``depth``, ``hits``, ``share``,
    ``users``, ``branch``; events, families, timestamps and the evicted-hash memory (rebuilt detection) are not
    needed, so the observers that only produce those are replaced (instance attributes, this tracker only) by
    no-ops or lean versions. The kept fields follow exactly the tracker's semantics (``on_allocated`` resets a
    block that still had a digest: vLLM just evicted it; ``on_sealed`` sets the new life; ``on_touched`` counts
    a use).
    """
    tracker.enabled = True
    tracker.recording = False  # the tracker's own gate: no event leaves it

    def nothing(*args: Any) -> None:
        return None

    hash64 = S.hash64

    def on_allocated(blocks: Any) -> None:
        t = tracker.table
        hashes = t.hash
        for blk in blocks:
            if hashes[blk.block_id] is not None:
                t.reset(blk.block_id)

    def on_touched(blocks: Any) -> None:
        t = tracker.table
        req = tracker.current_request
        rid = None if req is None else req.request_id
        for blk in blocks:
            if blk.is_null:
                continue
            b = blk.block_id
            t.hits[b] += 1
            t.use(b, rid)

    def on_evicting(blk: Any) -> None:
        if blk.block_hash is not None:
            tracker.table.reset(blk.block_id)

    def on_sealed(request: Any, blocks: Any, start: int, end: int, block_mask: Any, hash_block_size: int,
                  block_size: int) -> None:
        t = tracker.table
        rid = request.request_id
        for i in range(start, end):
            blk = blocks[i]
            if blk.is_null or (block_mask is not None and not block_mask[i - start]) or blk.block_hash is None:
                continue
            b = blk.block_id
            h = hash64(blk.block_hash)
            parent_id = -1
            parent = None
            if i > 0:
                prev = blocks[i - 1]
                if not prev.is_null:
                    parent_id = prev.block_id
                    parent = t.hash[parent_id]
            t.hash[b] = h
            t.parent[b] = parent
            t.parent_block[b] = parent_id
            t.depth[b] = i
            t.hits[b] = 0
            t.share[b] = 1
            t.users[b] = (rid,)
            if parent_id >= 0:
                kids = t.children[parent_id]
                if kids is None:
                    t.children[parent_id] = {h}
                    t.branch[parent_id] += 1
                elif h not in kids:
                    kids.add(h)
                    t.branch[parent_id] += 1

    tracker.on_allocated = on_allocated  # type: ignore[method-assign]
    tracker.on_freed = nothing  # type: ignore[method-assign]
    tracker.on_admitted = nothing  # type: ignore[method-assign]
    tracker.on_touched = on_touched  # type: ignore[method-assign]
    tracker.on_evicting = on_evicting  # type: ignore[method-assign]
    tracker.on_sealed = on_sealed  # type: ignore[method-assign]
