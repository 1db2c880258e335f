"""Installation: :func:`build_hook` attaches KVFabric to one Scheduler's KVCacheManager and BlockPool, the one way
to build it (the plugin, the replay, the demo, the benchmarks and the tests all call it).

How (docs/design.md §3): instance attributes on the one pool object wrap its bound methods (:mod:`.pool`), so
every object already holding the pool keeps the same object, other pools (CPU offload, connectors) and vLLM's classes
are untouched, and vLLM's own method bodies run unchanged. The KVCacheManager gets instance attributes that wrap
``allocate_slots`` and ``free`` (:mod:`.manager`), only to give pool calls their request context and to see
admissions. The Scheduler's own methods are not wrapped: a record's step is vLLM's ``scheduler.current_step``.

This module wires the parts: the :class:`~kvfabric.engine.recorder.Recorder`, the outlet its records are handed to
(:mod:`.handover`), the stream's metadata, and steering (:mod:`.steering`) when a setting changes vLLM's decisions.

Invariants:
  * in ``lru`` mode (no gate, no cache-aware hold) steering is never attached, so nothing here changes which block
    vLLM picks or how ref counts move;
  * no I/O and no lock on vLLM's paths: records go to a list; the outlet copies bytes into shared memory.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import kvfabric
from kvfabric import settings as table
from kvfabric.contract import protocol as P
from kvfabric.contract import schema as S
from kvfabric.engine.config import HookSettings
from kvfabric.engine.handover import Outlet, make_outlet
from kvfabric.engine.manager import wrap_manager
from kvfabric.engine.pool import hook_pool
from kvfabric.engine.probes import vllm_version
from kvfabric.engine.recorder import Recorder
from kvfabric.engine.steering.attach import attach_steering

log = logging.getLogger("kvfabric.engine")


def host_name(explicit: str | None = None) -> str:
    """``explicit`` (else ``KVFABRIC_HOST``, read through the settings table) or the machine's host name: the
    stream's ``host`` (every event's ``host`` column)."""
    if explicit is None:
        explicit = str(table.read("KVFABRIC_HOST"))
    return explicit or socket.gethostname()


def dp_rank_of(scheduler: Any) -> int:
    """vLLM's data-parallel rank of the engine owning ``scheduler`` (0 without data parallelism or a scheduler).

    ``parallel_config.data_parallel_index`` where vLLM has it: it equals ``data_parallel_rank`` except for the
    dense models whose engines vLLM runs as independent ranks, where it resets ``data_parallel_rank`` to 0 on
    every engine but keeps the index (vllm/config/parallel.py)."""
    parallel = getattr(scheduler, "parallel_config", None)
    if parallel is None:
        vllm_config = getattr(scheduler, "vllm_config", None)
        parallel = getattr(vllm_config, "parallel_config", None)
    for name in ("data_parallel_index", "data_parallel_rank"):
        rank = getattr(parallel, name, None)
        if isinstance(rank, int) and rank >= 0:
            return rank
    return 0


def engine_id(scheduler: Any, explicit: str | None = None, host: str | None = None) -> str:
    """``explicit`` (else ``KVFABRIC_ENGINE_ID``, read through the settings table, which checks the collector's
    label limits) or ``<host>/dp<rank>`` (``host``: else :func:`host_name`): stable across restarts so metric
    labels stay bounded."""
    if explicit is None:
        explicit = str(table.read("KVFABRIC_ENGINE_ID"))
    if explicit:
        return explicit
    return f"{host or host_name()}/dp{dp_rank_of(scheduler)}"


def evicted_memory_for(num_blocks: int) -> int:
    """Default bound on the evicted digests the expander remembers: 64 turnovers of the pool, at least 65,536 and
    at most 1,000,000 (~250 bytes each). Rebuilt detection past it falls to the collector's exact SQL; a fixed
    million would keep a small pool's forwarder growing for an hour before it plateaus."""
    return max(65_536, min(1_000_000, 64 * num_blocks))


def stream_metadata(
    settings: HookSettings, *, engine: str, policy: str, block_size: int, num_blocks: int, null_block: int = 0,
    dp_rank: int = 0,
) -> dict[str, str]:
    """The metadata every event stream starts with (docs/design.md §4); the one place it is written. Besides the
    keys of :mod:`kvfabric.contract.schema` (the host, ``settings.host`` or the machine's, and ``dp_rank``: every
    row's ``host`` and ``dp_rank``), it names this process (pid) and KVFabric's version, which the collector shows
    in its list of engines (kvfabric/contract/protocol.py)."""
    return {
        S.META_HOST: host_name(settings.host),
        S.META_DP_RANK: str(dp_rank),
        P.META_PID: str(os.getpid()),
        P.META_KVFABRIC_VERSION: kvfabric.__version__,
        S.META_SCHEMA_VERSION: str(S.SCHEMA_VERSION),
        S.META_ENGINE: engine,
        S.META_RUN_ID: settings.run_id,
        S.META_VLLM_VERSION: vllm_version(),
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
        """Event rows expanded so far (in-process outlets only; see :class:`~kvfabric.engine.handover.LocalOutlet`)."""
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
                               num_blocks=num_blocks, null_block=null_block, dp_rank=dp_rank_of(scheduler))
    recorder = Recorder(settings, recording=settings.lifecycle, block_size=block_size, clock=clock or time.time_ns)
    out = make_outlet(outlet, settings, metadata)
    installation = Installation(recorder, out, metadata, num_blocks, block_size)
    hook_pool(pool, recorder, settings.native)
    recorder.connect(installation.flush)
    wrap_manager(manager, recorder)
    if settings.steers or policy is not None:
        # Policies, the admission gate and cache-aware scheduling change vLLM's decisions; plain lifecycle
        # recording (lru, no gate) never reaches this line, so it cannot change them.
        kwargs = {} if info_of is None else {"info_of": info_of}
        installation.steering = attach_steering(scheduler, manager, installation, settings, policy, **kwargs)
    if scheduler is not None:
        if hasattr(scheduler, "current_step"):
            recorder.connect(installation.flush, stepper=scheduler)
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
    return build_hook(manager, settings, scheduler=scheduler,
                      engine=engine_id(scheduler, settings.engine_id, host_name(settings.host)))
