"""Victims: the policy's eviction order, handed out by vLLM's own free list (docs/design.md §3).

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

Invariants (``tests/engine/test_steering.py`` checks them through vLLM's real BlockPool under random operations):
  * the null block is never queued, hashed or freed (it is never sealed, so the index never takes it);
  * a block is in the free list exactly when its ref count is 0; along vLLM's own paths the index only holds
    blocks that are in the list (and every candidate is re-validated before it is handed out);
  * ``popleft_n(n)`` returns ``n`` blocks whenever ``n`` blocks are free: protection is an order, never a veto;
  * every block handed out still goes through vLLM's ``get_new_blocks``, which removes its hashes before reuse;
  * descendants leave before ancestors (the index's rule) where the policy reorders;
  * cost per allocation: O(log n) (heap) or O(1) (segments), never a scan of the list.

Statistics: a policy reads block statistics from a :class:`~kvfabric.lifecycle.keeper.StatisticsKeeper`, which
applies the recorder's call records as they are made (the same side-table code the forwarder runs), with
``last_use`` on the index's logical clock.

Request context: the engine's one ``KVCacheManager.free`` wrapper enters steering's observer
(:class:`~kvfabric.engine.steering.attach.PolicyContext`), which puts the freeing request's
:class:`~kvfabric.policies.base.RequestInfo` where :meth:`Steering.freed` finds it when that free's ``FREED``
record arrives; the index passes it to the policy's key.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable
from operator import attrgetter
from typing import Any

from kvfabric.contract import records as R
from kvfabric.contract import schema as S
from kvfabric.engine import compiled
from kvfabric.engine.steering.hold import CacheAwareHold
from kvfabric.lifecycle.keeper import StatisticsKeeper
from kvfabric.policies.admission import AnchorAdmissionGate
from kvfabric.policies.base import EvictionPolicy, RequestInfo
from kvfabric.policies.index import VictimIndex

log = logging.getLogger("kvfabric.engine")


class Steering:
    """What steering attached to one pool: the policy, its index and statistics, the gate, the hold; counters."""

    def __init__(self, recorder: Any, policy: EvictionPolicy | None, index: VictimIndex | None,
                 keeper: StatisticsKeeper | None) -> None:
        self.recorder = recorder
        self.policy = policy
        self.index = index
        self.keeper = keeper
        self.gate: AnchorAdmissionGate | None = None  # (its vLLM seam: steering.admission.AdmissionSeam)
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
            if ids and self.reports:
                # Reported only: what reads scores and flags (event rows, ``eviction_candidates_ranked``) is the
                # expander, which keeps them in its own side table.
                scores, flags = index.policy.report(index.owner.table, ids, keys, index.now)
                self.recorder.note((R.SCORED, ids, scores, flags))
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
    parents or None). The compiled :data:`freed_candidates` (``kvfabric/engine/_recorder.c``) is the same function
    in one pass (tested)."""
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


freed_candidates = compiled.freed_candidates if compiled.freed_candidates is not None else freed_candidates_py
"""A free's candidates: the compiled copy where built, else :func:`freed_candidates_py`."""


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
            st.recorder.report_victims(chosen)
    return out


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
        st.recorder.report_victims([b])
    return blk


QUEUE_HOOKS: dict[str, Callable[..., Any]] = {
    "popleft": _popleft,
    "popleft_n": _popleft_n,
}
"""The methods :func:`hook_queue` binds onto the queue instance, by the name vLLM calls."""
