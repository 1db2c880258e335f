"""Per-instance hooks on one Scheduler's KVCacheManager and BlockPool, and :func:`build_hook`, the one way to build
them (the plugin, the replay, the demo, the benchmarks and the tests all call it).

How (docs/design.md §3): instance attributes on the one pool object wrap its bound methods (:func:`hook_pool`), so
every object already holding the pool keeps the same object, other pools (CPU offload, connectors) and vLLM's classes
are untouched, and vLLM's own method bodies run unchanged. The KVCacheManager gets instance attributes that wrap
``allocate_slots`` and ``free``, only to give pool calls their request context and to see admissions.
The Scheduler's own methods are not wrapped: a record's step is vLLM's ``scheduler.current_step``.

What runs on vLLM's scheduler thread is a :class:`Recorder`: one compact record per vLLM call
(:mod:`kvfabric.hook.records`), appended to a list, handed to an outlet every 100 ms, every 4096 records and when
the last request ends (:meth:`Recorder.add`; the outlet is a shared-memory ring read by the forwarder process,
which expands records into events off vLLM's GIL). When a policy needs block statistics in-process, the steering
keeper applies the same records to its side table at once. The four frequent pool calls have compiled hooks
(:mod:`kvfabric.hook.compiled`) that make the same records where they are built; the Python hooks here are the
reference, the fallback (``KVFABRIC_NATIVE=0``, no compiler) and the path of every call those are not sure of.

Invariants:
  * vLLM's original method always runs, with the same arguments, and its result or exception is returned or
    raised unchanged; KVFabric's part runs in a ``try`` whose failure is counted, logged once, and turns the
    recorder off (vLLM carries on as if the hook were not there);
  * ``free_blocks`` materialises its iterable once (callers pass ``reversed(...)``) and hands vLLM the list;
  * in ``lru`` mode nothing here changes which block vLLM picks or how ref counts move;
  * no I/O and no lock on these paths: records go to a list; the outlet copies bytes into shared memory.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import socket
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import kvfabric
from kvfabric import protocol as P
from kvfabric import schema as S
from kvfabric.config import HookSettings
from kvfabric.hook import compiled, forwarding
from kvfabric.hook import records as R
from kvfabric.hook.hints import FamilyNamer
from kvfabric.hook.outlets import Outlet, make_outlet

log = logging.getLogger("kvfabric.hook")

HANDOVER_S = 0.1
"""Records are handed over by the first record made this long after the last hand-over (see :meth:`Recorder.add`);
the forwarder's own batches wait as long (``KVFABRIC_FLUSH_MS``, 100 by default)."""
HANDOVER_RECORDS = 4096
"""... or when this many wait."""


def _nothing() -> None:
    pass


def _last_request(scheduler: Any) -> bool:
    """Whether the request being freed is the scheduler's last one (vLLM deletes a finished request from
    ``scheduler.requests`` right after freeing it; a preempted one stays). True without a scheduler."""
    requests = getattr(scheduler, "requests", None)
    return requests is None or len(requests) <= 1


def _flatten_blocks(blocks: Any) -> Sequence[Any]:
    """``touch`` takes a list of blocks (0.33) or a tuple of per-group lists (older releases)."""
    if blocks and isinstance(blocks[0], (list, tuple)):
        return [b for group in blocks for b in group]
    return blocks


class Recorder:
    """The hook's state on the scheduler thread: the record list, the step, the request in context.

    ``on`` is False once anything in KVFabric failed (or when nothing asked for records): the wrappers then do
    nothing but call vLLM. ``keeper`` is steering's statistics keeper (a policy reads block statistics), applied to
    each record as it is made; ``log`` is None when events are not recorded (a policy alone).
    """

    __slots__ = ("block_size", "clock", "errors", "families", "fresh_observers", "gate", "handover", "handover_at",
                 "keeper", "log", "name_family", "on", "rid", "stepper", "victims")

    def __init__(self, settings: HookSettings, recording: bool, block_size: int,
                 clock: Callable[[], int] = time.time_ns) -> None:
        self.on = True
        self.block_size = block_size
        self.clock = clock
        self.log: list[tuple] | None = [] if recording else None
        self.keeper: Any = None
        self.gate: Any = None
        #: The scheduler whose ``current_step`` (advanced by vLLM at the start of each ``schedule()``) is the records'
        #: step; None for a bare KVCacheManager (step 0).
        self.stepper: Any = None
        #: Called as ``f(request, hit_tokens)`` when a request with nothing computed asks for slots (an admission
        #: attempt), before it is recorded; steering's policy observes admissions here. Each handles its own errors.
        self.fresh_observers: list[Callable[[Any, int], None]] = []
        #: Hands the records made so far to the outlet (the installation's ``flush``; it never raises).
        self.handover: Callable[[], None] = _nothing
        #: ``time.monotonic()`` from which the next record triggers a hand-over (0: the next one does).
        self.handover_at = 0.0
        self.rid: str | None = None  # the request whose KVCacheManager call is in progress (pool calls see it)
        #: The policy's victims in the allocation in progress (steering sets them when victim choices are reported;
        #: the allocation's record carries them), else None.
        self.victims: list[int] | None = None
        self.errors = 0
        #: The family rule of docs/design.md §5 for this engine (it holds the engine's prefix tree).
        self.name_family = FamilyNamer(settings.family_depth, settings.family_from_request_id)
        self.families: dict[str, str | None] = {}

    @property
    def step(self) -> int:
        """The scheduler step the current call belongs to (docs/design.md §4, column ``step``)."""
        stepper = self.stepper
        return 0 if stepper is None else stepper.current_step

    def failed(self, where: str, exc: BaseException | None = None) -> None:
        """KVFabric broke somewhere on vLLM's path: count, log once, stop recording; vLLM is not affected.
        ``exc``: the failure, where it is not the exception being handled (the compiled hooks pass theirs)."""
        self.errors += 1
        self.on = False
        if self.errors == 1:
            log.error("kvfabric: %s failed; KVFabric is now off for this engine (vLLM is unaffected)", where,
                      exc_info=exc if exc is not None else True)

    def add(self, record: tuple) -> None:
        """Apply ``record`` to the keeper (if a policy reads statistics) and log it (if recording).

        Hand-over happens here, from the recording call itself, not from a wrapper on a per-step scheduler method:
        on this path every extra Python frame per step shows in the scheduler's time, and a hand-over has a fixed
        cost (tens of µs in the scheduler's cold caches) that short steps would pay thousands of times a second. So
        the records go once HANDOVER_S has passed since the last hand-over, HANDOVER_RECORDS wait, or the engine's
        last request ended (``handover_at`` = 0 then, so the records before an engine idles go out at once).
        """
        keeper = self.keeper
        if keeper is not None:
            apply = keeper.handler(record[0])
            if apply is not None:
                apply(record)
        pending = self.log
        if pending is not None:
            pending.append(record)
            if len(pending) >= HANDOVER_RECORDS or time.monotonic() >= self.handover_at:
                self.handover()

    def family_of(self, request: Any) -> str | None:
        """The request's family (docs/design.md §5), computed once per request (one dict lookup after)."""
        rid = request.request_id
        fam = self.families.get(rid, "")
        if fam == "":
            hashes = request.block_hashes
            fam = self.name_family(request, hashes)
            if fam is not None or hashes:
                self.families[rid] = fam
        return fam

    def limited(self, request: Any, blocks: int) -> None:
        """The admission gate kept ``blocks`` of ``request``'s blocks out of the cache."""
        self.add((R.LIMITED, self.clock(), self.step, request.request_id, self.family_of(request), blocks))

    def take(self) -> list[tuple]:
        """The records made since the last call (the caller owns them)."""
        out = self.log
        self.handover_at = time.monotonic() + HANDOVER_S
        if not out:
            return []
        self.log = []
        return out


def hash_is_a_field_property(blocks: list[Any]) -> bool:
    """Whether ``block_hash`` of vLLM's blocks is a property that returns the ``_block_hash`` field (checked on a
    block both ways: without its hash, and with a sentinel set and restored). Where it is (vLLM 0.26, 0.33), the
    hook reads the field: per block, the property costs a Python call and the field an attribute load."""
    if not blocks:
        return False
    blk = blocks[0]
    if not isinstance(getattr(type(blk), "block_hash", None), property) or not hasattr(blk, "_block_hash"):
        return False
    saved = blk._block_hash
    try:
        sentinel = object()
        blk._block_hash = sentinel
        return blk.block_hash is sentinel
    except Exception:
        return False
    finally:
        blk._block_hash = saved


def hash_attribute(blocks: list[Any]) -> str:
    """The attribute of vLLM's blocks to read a block's hash from: ``_block_hash`` where ``block_hash`` is only a
    property over it (:func:`hash_is_a_field_property`), else ``block_hash``."""
    return "_block_hash" if hash_is_a_field_property(blocks) else "block_hash"


def hook_pool(pool: Any, r: Recorder, native: bool = False) -> None:
    """Record ``pool``'s calls in ``r``: instance attributes wrap the bound methods of this one pool object.

    Why instance attributes and not a subclass swapped into ``pool.__class__``: on CPython 3.11 assigning
    ``__class__`` turns the object's attribute storage into a plain dict, and every ``self.x`` in vLLM's own pool
    methods then takes the slower lookup (``get_usage`` slower: ``benchmarks/results/hook_layout.md``); the
    scheduler reads the pool many times per step. Adding attributes keeps the object's shared-key layout, so
    vLLM's code runs as fast as unhooked.

    With ``native`` (and the extension built: :mod:`kvfabric.hook.compiled`), the four frequent methods get
    compiled hooks that record as these Python ones do, and pass them every call they are not sure of. A
    ``SEALED`` record takes its hashes from the request (one slice) where vLLM gave each block the request's hash
    of its position: that hash and the block's differ only past their first 8 bytes (vLLM appends the group id),
    which is all a digest reads (``schema.hash64``).
    """
    # Blocks carry a .pool field (0.33+): a free may hand over other pools' blocks, which their own hook records.
    own = pool if bool(pool.blocks) and hasattr(pool.blocks[0], "pool") else None
    get_new_blocks = pool.get_new_blocks
    evict_blocks = pool.evict_blocks
    touch = pool.touch
    free_blocks = pool.free_blocks
    unpin_blocks = getattr(pool, "unpin_blocks", None)  # 0.33+; vLLM 0.26's pool has none
    cache_full_blocks = pool.cache_full_blocks
    move_block_hashes = getattr(pool, "move_block_hashes", None)
    reset_prefix_cache = pool.reset_prefix_cache
    hash_block_size = getattr(pool, "hash_block_size", None)
    hash_name = hash_attribute(pool.blocks)
    hash_field = hash_name == "_block_hash"  # (the Python hooks branch on it: an attribute load, not getattr)

    def kvfabric_get_new_blocks(num_blocks: int, *args: Any, **kwargs: Any) -> list[Any]:
        blocks = get_new_blocks(num_blocks, *args, **kwargs)
        if r.on:
            try:
                # (The victims steering chose inside this call ride in its record: no record of their own.)
                victims = r.victims
                r.victims = None
                r.add((R.ALLOCATED, r.clock(), r.step, r.rid, [b.block_id for b in blocks], victims))
            except Exception:
                r.failed("recording an allocation")
        return blocks

    def kvfabric_evict_blocks(block_ids: Any, *args: Any, **kwargs: Any) -> None:
        # Evictions by get_new_blocks are seen in the ALLOCATED record (the side table knows each block's digest);
        # this is the other door, used by KV connectors. Recorded before vLLM clears the hashes.
        if r.on:
            try:
                all_blocks = pool.blocks
                n = len(all_blocks)
                ids = [b for b in block_ids if 0 <= b < n]
                r.add((R.EVICTING, r.clock(), r.step, r.rid, ids, [all_blocks[b].block_hash for b in ids]))
            except Exception:
                r.failed("recording an eviction")
        evict_blocks(block_ids, *args, **kwargs)

    def record_refs(op: int, rid: str | None, blocks: Any, where: str, *, flatten: bool = False,
                    owner: Any = None) -> None:
        """One record of the blocks whose ref counts a call moved: their ids and ref counts after it (only of
        ``owner``'s blocks when given)."""
        try:
            if flatten:
                blocks = _flatten_blocks(blocks)
            if owner is not None:
                blocks = [b for b in blocks if b.pool is owner]
            r.add((op, r.clock(), r.step, rid, [b.block_id for b in blocks], [b.ref_cnt for b in blocks]))
        except Exception:
            r.failed(where)

    def kvfabric_touch(blocks: Any, *args: Any, **kwargs: Any) -> None:
        touch(blocks, *args, **kwargs)
        if r.on:
            record_refs(R.TOUCHED, r.rid, blocks, "recording a touch", flatten=True)

    def kvfabric_free_blocks(ordered_blocks: Iterable[Any], *args: Any, **kwargs: Any) -> None:
        blocks = list(ordered_blocks)
        free_blocks(blocks, *args, **kwargs)
        if r.on:
            record_refs(R.FREED, r.rid, blocks, "recording a free", owner=own)

    def kvfabric_unpin_blocks(blocks: Iterable[Any], *args: Any, **kwargs: Any) -> None:
        assert unpin_blocks is not None
        blocks = list(blocks)
        unpin_blocks(blocks, *args, **kwargs)
        if r.on:
            record_refs(R.FREED, None, blocks, "recording an unpin")

    def kvfabric_cache_full_blocks(
        request: Any,
        blocks: list[Any],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        gate = r.gate
        mask = kwargs.get("block_mask", args[0] if args else None)
        if gate is not None and r.on and num_cached_blocks < num_full_blocks:
            # The admission gate narrows vLLM's own mask (docs/design.md §3: a masked block is never cached).
            # Its mask() never raises: on any internal error vLLM's own mask stands.
            kwargs.pop("block_mask", None)
            args = ()
            mask = kwargs["block_mask"] = gate.mask(r, request, num_cached_blocks, num_full_blocks, mask)
        cache_full_blocks(request, blocks, num_cached_blocks, num_full_blocks, block_size, kv_cache_group_id,
                          *args, **kwargs)
        if num_cached_blocks >= num_full_blocks or not r.on:
            return
        try:
            start, end = num_cached_blocks, num_full_blocks
            parent_raw = None
            prev = None
            hashes = request.block_hashes if (hash_block_size or block_size) == block_size else None
            if start > 0:
                prev = blocks[start - 1].block_id
                if hashes is not None and start - 1 < len(hashes):
                    parent_raw = hashes[start - 1]
            sealed = blocks[start:end]
            ids = [b.block_id for b in sealed]
            if hashes is not None and mask is None and len(hashes) >= end:
                # (Every block got its position's hash; a null block's is dropped by the id, as vLLM skips it.)
                raws = hashes[start:end]
            else:  # (some blocks masked, or hashes of another block size: read what vLLM stored)
                raws = [b._block_hash for b in sealed] if hash_field else [b.block_hash for b in sealed]
            r.add((R.SEALED, r.clock(), r.step, request.request_id, r.family_of(request), start, prev, ids, raws,
                   parent_raw))
        except Exception:
            r.failed("recording a seal")

    def kvfabric_move_block_hashes(src_block: Any, dst_block: Any, *args: Any, **kwargs: Any) -> None:
        # The prefix cache keeps a private copy: src's identity moves to dst. Seen as an eviction of src's content
        # and a seal of it in dst would be wrong (no prefill is recomputed), so the move is recorded.
        assert move_block_hashes is not None
        move_block_hashes(src_block, dst_block, *args, **kwargs)
        if r.on:
            try:
                r.add((R.MOVED, r.clock(), r.step, r.rid, src_block.block_id, dst_block.block_id))
            except Exception:
                r.failed("recording a hash move")

    def kvfabric_reset_prefix_cache(*args: Any, **kwargs: Any) -> bool:
        ok = reset_prefix_cache(*args, **kwargs)
        if ok and r.on:
            try:
                r.add((R.RESET, r.clock(), r.step))
            except Exception:
                r.failed("recording a reset")
        return ok

    hooks = {
        "get_new_blocks": kvfabric_get_new_blocks,
        "evict_blocks": kvfabric_evict_blocks,
        "touch": kvfabric_touch,
        "free_blocks": kvfabric_free_blocks,
        "unpin_blocks": kvfabric_unpin_blocks,
        "cache_full_blocks": kvfabric_cache_full_blocks,
        "move_block_hashes": kvfabric_move_block_hashes,
        "reset_prefix_cache": kvfabric_reset_prefix_cache,
    }
    ops = {"get_new_blocks": R.ALLOCATED, "touch": R.TOUCHED, "free_blocks": R.FREED,
           "cache_full_blocks": R.SEALED}
    fast = native and compiled.Hook is not None
    for name, fn in hooks.items():
        original = getattr(pool, name, None)
        if original is None:  # not in this vLLM (unpin_blocks before 0.33): nothing to wrap
            continue
        fn.__wrapped__ = original  # type: ignore[attr-defined]  # its own name stays (profiles)
        if fast and name in ops:
            fn = compiled.Hook(name, original, fn, r, own, hash_name, hash_block_size, HANDOVER_RECORDS, ops[name])
        setattr(pool, name, fn)
    pool._kvfabric = r


def _wrap_manager(manager: Any, r: Recorder) -> None:
    """Instance wrappers giving pool calls their request, and recording admissions (``prefix_lookup``).

    ``allocate_slots`` runs for every running request in every step: its wrapper has vLLM's exact signature
    (:mod:`kvfabric.hook.forwarding`) and only sets the request context; an admission attempt (nothing computed
    yet) takes :func:`admit`, which observes and records it."""
    allocate_slots = manager.allocate_slots
    free = manager.free
    hit_of = forwarding.argument_reader(allocate_slots, "num_new_computed_tokens", 0)

    def admit(request: Any, *args: Any, **kwargs: Any) -> Any:
        recording = r.on
        try:
            hit = hit_of(request, *args, **kwargs) or 0
            for observe in r.fresh_observers:
                observe(request, hit)
            if recording:
                hashes = request.block_hashes
                # The hashes the lookup wanted past its hit (a C-level slice): the expander finds regretful
                # evictions among them before this allocation seals, and so rebuilds, them.
                r.add((R.LOOKUP, r.clock(), r.step, request.request_id, r.family_of(request),
                       request.num_prompt_tokens, len(hashes), hit, hashes[hit // r.block_size:]))
        except Exception:
            r.failed("recording a lookup")
            recording = False
        # Manager calls do not nest, so the context is set and cleared (no saving of a previous one).
        r.rid = request.request_id
        try:
            result = allocate_slots(request, *args, **kwargs)
        finally:
            r.rid = None
        if recording and r.on:
            try:
                if result is not None:
                    r.add((R.ADMITTED, r.clock(), r.step, request.request_id))
                else:
                    r.add((R.CANCELLED, request.request_id))
            except Exception:
                r.failed("recording an admission")
        return result

    @functools.wraps(free)
    def kvfabric_free(request: Any, *args: Any, **kwargs: Any) -> Any:
        r.rid = request.request_id
        try:
            return free(request, *args, **kwargs)
        finally:
            r.rid = None
            if r.on:
                try:
                    if _last_request(r.stepper):
                        r.handover_at = 0.0  # the engine may idle now: nothing is held back
                    r.add((R.DONE, request.request_id))
                    r.families.pop(request.request_id, None)
                except Exception:
                    r.failed("recording a request's end")

    manager.allocate_slots = forwarding.request_context_wrapper(allocate_slots, r, admit, "kvfabric_allocate_slots")
    manager.free = kvfabric_free


def engine_id(scheduler: Any, explicit: str | None = None) -> str:
    """``explicit`` (else ``KVFABRIC_ENGINE_ID``, read through the settings table, which checks the collector's
    label limits) or ``<host>/dp<rank>``: stable across restarts so metric labels stay bounded."""
    if explicit is None:
        from kvfabric import settings as table

        explicit = str(table.read("KVFABRIC_ENGINE_ID"))
    if explicit:
        return explicit
    rank = getattr(getattr(scheduler, "parallel_config", None), "data_parallel_rank", 0) or 0
    return f"{socket.gethostname()}/dp{rank}"


def _vllm_version() -> str:
    try:
        import vllm

        return str(getattr(vllm, "__version__", "unknown"))
    except Exception:
        return "unknown"


def evicted_memory_for(num_blocks: int) -> int:
    """Default bound on the evicted digests the expander remembers: 64 turnovers of the pool, at least 65,536 and
    at most 1,000,000 (~250 bytes each). Rebuilt detection past it falls to the collector's exact SQL; a fixed
    million would keep a small pool's forwarder growing for an hour before it plateaus."""
    return max(65_536, min(1_000_000, 64 * num_blocks))


def stream_metadata(
    settings: HookSettings, *, engine: str, policy: str, block_size: int, num_blocks: int, null_block: int = 0
) -> dict[str, str]:
    """The metadata every event stream starts with (docs/design.md §4); the one place it is written. Besides the
    keys of :mod:`kvfabric.schema`, it names this process (host, pid) and KVFabric's version, which the collector
    shows in its list of engines (kvfabric/protocol.py)."""
    return {
        P.META_HOST: socket.gethostname(),
        P.META_PID: str(os.getpid()),
        P.META_KVFABRIC_VERSION: kvfabric.__version__,
        S.META_SCHEMA_VERSION: str(S.SCHEMA_VERSION),
        S.META_ENGINE: engine,
        S.META_RUN_ID: settings.run_id,
        S.META_VLLM_VERSION: _vllm_version(),
        S.META_BLOCK_SIZE: str(block_size),
        S.META_NUM_BLOCKS: str(num_blocks),
        S.META_POLICY: policy,
        S.META_SETTINGS: json.dumps({**settings.as_metadata(), "policy": policy, "null_block": null_block,
                                     "evicted_memory": settings.evicted_memory or evicted_memory_for(num_blocks)}),
    }


class Installation:
    """What the hook attached to one pool: the recorder, the outlet its records go to, the steering (if any)."""

    def __init__(self, recorder: Recorder, outlet: Outlet, metadata: dict[str, str], num_blocks: int,
                 block_size: int, steering: Any = None) -> None:
        self.recorder = recorder
        self.outlet = outlet
        self.metadata = metadata
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.steering = steering
        self.flush_errors = 0

    @property
    def policy(self) -> str:
        return self.metadata[S.META_POLICY]

    def flush(self) -> None:
        """Hand the records made so far to the outlet (never raises)."""
        r = self.recorder
        try:
            records = r.take()
            if records:
                self.outlet.put(records)
        except Exception:
            self.flush_errors += 1
            r.failed("handing records to the outlet")

    def drain(self) -> list[tuple]:
        """Event rows expanded so far (in-process outlets only; see :class:`~kvfabric.hook.outlets.LocalOutlet`)."""
        self.flush()
        return self.outlet.drain()

    def close(self) -> None:
        """Flush and stop the outlet (bounded time)."""
        self.flush()
        self.outlet.close()


def build_hook(
    manager: Any,
    settings: HookSettings,
    *,
    scheduler: Any = None,
    block_size: int | None = None,
    engine: str = "local",
    policy: Any = None,
    outlet: str | Outlet | None = None,
    clock: Callable[[], int] | None = None,
    info_of: Callable[[Any], Any] | None = None,
) -> Installation | None:
    """Attach KVFabric to one KVCacheManager (and its scheduler, when given). Returns None (vLLM untouched) when
    there is no prefix-caching pool.

    ``policy`` overrides ``settings.policy`` with a policy object (the replay's optimum; its ``name`` labels the
    stream). ``outlet``: ``"local"`` expands records in-process (drain them with :meth:`Installation.drain`),
    an :class:`Outlet` is used as given, None follows ``settings.sink``. ``clock`` replaces ``time.time_ns`` for
    the events' timestamps (the replay's simulated clock). ``info_of`` reads a request's
    :class:`~kvfabric.policies.base.RequestInfo` for policies (default: its hints; the replay adds its position).
    """
    pool = getattr(manager, "block_pool", None)
    if pool is None or not getattr(pool, "enable_caching", True):
        log.info("kvfabric: no prefix-caching block pool; nothing installed")
        return None
    block_size = int(block_size or getattr(scheduler, "block_size", 0) or getattr(pool, "hash_block_size", 16))
    num_blocks = int(pool.num_gpu_blocks)
    null_block = int(getattr(getattr(pool, "null_block", None), "block_id", 0) or 0)
    policy_name = getattr(policy, "name", None) or settings.policy
    metadata = stream_metadata(settings, engine=engine, policy=policy_name, block_size=block_size,
                               num_blocks=num_blocks, null_block=null_block)
    recorder = Recorder(settings, recording=settings.lifecycle, block_size=block_size, clock=clock or time.time_ns)
    out = make_outlet(outlet, settings, metadata)
    installation = Installation(recorder, out, metadata, num_blocks, block_size)
    hook_pool(pool, recorder, settings.native)
    recorder.handover = installation.flush
    _wrap_manager(manager, recorder)
    if settings.steers or policy is not None:
        # Policies, the admission gate and cache-aware scheduling change vLLM's decisions; plain lifecycle
        # recording (lru, no gate) never reaches this line, so it cannot change them.
        from kvfabric.hook.steering import attach_steering

        kwargs = {} if info_of is None else {"info_of": info_of}
        installation.steering = attach_steering(scheduler, manager, installation, settings, policy, **kwargs)
    if scheduler is not None:
        if hasattr(scheduler, "current_step"):
            recorder.stepper = scheduler
        else:
            log.warning("kvfabric: this vLLM's scheduler has no current_step; events carry step 0")
        scheduler._kvfabric = installation
    manager._kvfabric = installation
    log.info(
        "kvfabric: hook installed (engine=%s, blocks=%d, block_size=%d, policy=%s, sink=%s)",
        engine, num_blocks, block_size, policy_name, out.describe(),
    )
    return installation


def install(scheduler: Any, settings: HookSettings) -> Installation | None:
    """The plugin's entry: attach the hook to a freshly built scheduler."""
    manager = getattr(scheduler, "kv_cache_manager", None)
    if manager is None:
        return None
    return build_hook(manager, settings, scheduler=scheduler, engine=engine_id(scheduler, settings.engine_id))
