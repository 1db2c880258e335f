"""Per-instance hooks on one Scheduler's KVCacheManager and BlockPool.

How (docs/design.md §3): the pool's class is swapped for a subclass made on the fly (``block_pool.__class__ = ...``), so
every object already holding the pool keeps the same object, other pools (CPU offload, connectors) are untouched,
and vLLM's own method bodies run unchanged via ``super()``. The KVCacheManager and the Scheduler get instance
attributes that wrap the bound methods the scheduler calls, only to give pool calls their request context.

Invariants:
  * vLLM's original method always runs, with the same arguments, and its result or exception is returned or
    raised unchanged; the observer runs after it (or, for evictions, just before the hash is cleared) through
    :meth:`LifecycleTracker.guard`, which never raises;
  * ``free_blocks`` materialises its iterable once (callers pass ``reversed(...)``) and hands vLLM the list;
  * in ``lru`` mode nothing here changes which block vLLM picks or how ref counts move.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import socket
from collections.abc import Iterable, Sequence
from typing import Any

from kvfabric import schema as S
from kvfabric.config import HookSettings
from kvfabric.hook.buffer import EventBuffer
from kvfabric.hook.sinks import Sink, make_sink
from kvfabric.hook.tracker import LifecycleTracker

log = logging.getLogger("kvfabric.hook")

_TRACKED_CLASSES: dict[type, type] = {}


def _flatten_blocks(blocks: Any) -> Sequence[Any]:
    """``touch`` takes a list of blocks (0.33) or a tuple of per-group lists (older releases)."""
    if blocks and isinstance(blocks[0], (list, tuple)):
        return [b for group in blocks for b in group]
    return blocks


def tracked_pool_class(base: type) -> type:
    """A subclass of ``base`` (vLLM's BlockPool or a subclass of it) that reports to ``self._kvfabric``."""
    cls = _TRACKED_CLASSES.get(base)
    if cls is not None:
        return cls

    class TrackedBlockPool(base):  # type: ignore[misc, valid-type]
        _kvfabric: LifecycleTracker

        def get_new_blocks(self, num_blocks: int, *args: Any, **kwargs: Any) -> list[Any]:
            blocks = super().get_new_blocks(num_blocks, *args, **kwargs)
            t = self._kvfabric
            t.guard(t.on_allocated, blocks)
            return blocks

        def evict_blocks(self, block_ids: Any, *args: Any, **kwargs: Any) -> None:
            # Evictions by get_new_blocks are seen in on_allocated (the side table knows each block's digest);
            # this is the other door, used by KV connectors.
            t = self._kvfabric
            for block_id in block_ids:
                if 0 <= block_id < len(self.blocks):
                    t.guard(t.on_evicting, self.blocks[block_id])
            super().evict_blocks(block_ids, *args, **kwargs)

        def touch(self, blocks: Any, *args: Any, **kwargs: Any) -> None:
            super().touch(blocks, *args, **kwargs)
            t = self._kvfabric
            t.guard(t.on_touched, _flatten_blocks(blocks))

        def free_blocks(self, ordered_blocks: Iterable[Any], *args: Any, **kwargs: Any) -> None:
            blocks = list(ordered_blocks)
            super().free_blocks(blocks, *args, **kwargs)
            t = self._kvfabric
            t.guard(t.on_freed, blocks, self)

        def cache_full_blocks(
            self,
            request: Any,
            blocks: list[Any],
            num_cached_blocks: int,
            num_full_blocks: int,
            block_size: int,
            kv_cache_group_id: int,
            *args: Any,
            **kwargs: Any,
        ) -> None:
            t = self._kvfabric
            gate = t.admission_gate
            if gate is not None and num_cached_blocks < num_full_blocks:
                # The admission gate narrows vLLM's own mask (docs/design.md §3: a masked block is never cached).
                mask = kwargs.pop("block_mask", args[0] if args else None)
                args = ()
                kwargs["block_mask"] = gate.mask(t, request, blocks, num_cached_blocks, num_full_blocks, mask)
            super().cache_full_blocks(
                request, blocks, num_cached_blocks, num_full_blocks, block_size, kv_cache_group_id, *args, **kwargs
            )
            if num_cached_blocks >= num_full_blocks:
                return
            mask = kwargs.get("block_mask", args[0] if args else None)
            hash_block_size = getattr(self, "hash_block_size", block_size)
            t.guard(t.on_sealed, request, blocks, num_cached_blocks, num_full_blocks, mask, hash_block_size, block_size)

        def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> bool:
            ok = super().reset_prefix_cache(*args, **kwargs)
            t = self._kvfabric
            t.guard(t.on_reset, ok)
            return ok

    TrackedBlockPool.__name__ = f"KVFabric{base.__name__}"
    TrackedBlockPool.__qualname__ = TrackedBlockPool.__name__
    _TRACKED_CLASSES[base] = TrackedBlockPool
    return TrackedBlockPool


def _wrap_manager(manager: Any, tracker: LifecycleTracker) -> None:
    """Instance wrappers giving pool calls their request, and recording admissions (``prefix_lookup``)."""
    allocate_slots = manager.allocate_slots
    free = manager.free

    @functools.wraps(allocate_slots)
    def kvfabric_allocate_slots(request: Any, num_new_tokens: int, *args: Any, **kwargs: Any) -> Any:
        fresh = request.num_computed_tokens == 0
        regret: list[Any] = []
        if fresh and tracker.enabled and tracker.evicted:
            hit = kwargs.get("num_new_computed_tokens", args[0] if args else 0)
            try:
                regret = tracker.regret_candidates(request, hit)
            except Exception:
                regret = []
        prev = tracker.current_request
        tracker.current_request = request
        try:
            result = allocate_slots(request, num_new_tokens, *args, **kwargs)
        finally:
            tracker.current_request = prev
        if result is not None and fresh:
            hit = kwargs.get("num_new_computed_tokens", args[0] if args else 0)
            tracker.guard(tracker.on_admitted, request, hit, regret)
        return result

    @functools.wraps(free)
    def kvfabric_free(request: Any, *args: Any, **kwargs: Any) -> Any:
        prev = tracker.current_request
        tracker.current_request = request
        try:
            return free(request, *args, **kwargs)
        finally:
            tracker.current_request = prev
            tracker.guard(tracker.on_request_done, request.request_id)

    manager.allocate_slots = kvfabric_allocate_slots
    manager.free = kvfabric_free


def _wrap_step(scheduler: Any, tracker: LifecycleTracker) -> None:
    schedule = scheduler.schedule

    @functools.wraps(schedule)
    def kvfabric_schedule(*args: Any, **kwargs: Any) -> Any:
        tracker.step += 1
        return schedule(*args, **kwargs)

    scheduler.schedule = kvfabric_schedule


def engine_id(scheduler: Any) -> str:
    """``KVFABRIC_ENGINE_ID`` or ``<host>/dp<rank>``: stable across restarts so metric labels stay bounded."""
    explicit = os.environ.get("KVFABRIC_ENGINE_ID", "").strip()
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


class Installation:
    """What the hook attached to one scheduler: its tracker and sink."""

    def __init__(self, tracker: LifecycleTracker, sink: Sink | None) -> None:
        self.tracker = tracker
        self.sink = sink

    def close(self) -> None:
        """Flush and stop the sink (bounded time)."""
        if self.sink is not None:
            self.sink.close()


def attach(
    manager: Any,
    settings: HookSettings,
    *,
    block_size: int | None = None,
    engine: str = "local",
    start_sink: bool = True,
) -> Installation | None:
    """Attach the hook to one KVCacheManager and its BlockPool. Returns None (vLLM untouched) when it cannot.

    ``start_sink=False`` records into the tracker's buffer only (tests and in-process replay drain it).
    """
    pool = getattr(manager, "block_pool", None)
    if pool is None or not getattr(pool, "enable_caching", True):
        log.info("kvfabric: no prefix-caching block pool; nothing installed")
        return None
    block_size = int(block_size or getattr(pool, "hash_block_size", 16))
    num_blocks = int(pool.num_gpu_blocks)
    buffer = EventBuffer(settings.buffer_events, settings.batch_events)
    tracker = LifecycleTracker(settings, num_blocks, block_size, engine, buffer)
    sink: Sink | None = None
    if settings.lifecycle and start_sink:
        metadata = {
            S.META_SCHEMA_VERSION: str(S.SCHEMA_VERSION),
            S.META_ENGINE: engine,
            S.META_RUN_ID: settings.run_id,
            S.META_VLLM_VERSION: _vllm_version(),
            S.META_BLOCK_SIZE: str(block_size),
            S.META_NUM_BLOCKS: str(num_blocks),
            S.META_POLICY: settings.policy,
            S.META_SETTINGS: json.dumps(settings.as_metadata()),
        }
        sink = make_sink(
            settings.sink, buffer, metadata, tracker.dropped_row, settings.batch_events, settings.flush_ms
        )
        sink.start()
    pool.__class__ = tracked_pool_class(type(pool))
    pool._kvfabric = tracker
    _wrap_manager(manager, tracker)
    installation = Installation(tracker, sink)
    manager._kvfabric = installation
    return installation


def install(scheduler: Any, settings: HookSettings) -> Installation | None:
    """Attach the hook to a freshly built scheduler (its KVCacheManager, BlockPool and step counter)."""
    manager = getattr(scheduler, "kv_cache_manager", None)
    if manager is None:
        return None
    engine = engine_id(scheduler)
    installation = attach(manager, settings, block_size=getattr(scheduler, "block_size", None), engine=engine)
    if installation is None:
        return None
    tracker = installation.tracker
    _wrap_step(scheduler, tracker)
    if settings.steers:
        # Policies, the admission gate and cache-aware scheduling change vLLM's decisions; plain lifecycle
        # recording (lru, no gate) never reaches this line, so it cannot change them.
        from kvfabric.hook.steering import attach_steering

        attach_steering(scheduler, manager.block_pool, tracker, settings)
    scheduler._kvfabric = installation
    log.info(
        "kvfabric: hook installed (engine=%s, blocks=%d, block_size=%d, policy=%s, sink=%s)",
        engine, tracker.num_blocks, tracker.block_size, settings.policy, settings.sink if settings.lifecycle else "off",
    )
    return installation
