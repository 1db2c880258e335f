"""Attaching steering to one pool: what ``settings`` asks for (policy, admission gate, cache-aware hold).

``build_hook`` (:mod:`kvfabric.engine.install`) calls :func:`attach_steering` only when ``settings.steers``: a
policy other than ``lru``, the admission gate, or cache-aware scheduling. Plain ``lru`` never reaches this module,
so vLLM's own order is untouched in that mode (docs/design.md §3). Everything attached here runs on vLLM's scheduler
thread; it reaches the recorder only through the Recorder's methods.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from kvfabric.contract import records as R
from kvfabric.contract import schema as S
from kvfabric.engine.config import HookSettings
from kvfabric.engine.hints import request_info
from kvfabric.engine.probes import hash_attribute
from kvfabric.engine.steering.admission import AdmissionSeam
from kvfabric.engine.steering.hold import CacheAwareHold
from kvfabric.engine.steering.victims import Steering, freed_candidates, freed_candidates_py, hook_queue
from kvfabric.lifecycle.keeper import StatisticsKeeper
from kvfabric.policies import make_policy
from kvfabric.policies.admission import AnchorAdmissionGate
from kvfabric.policies.base import EvictionPolicy, RequestInfo
from kvfabric.policies.index import VictimIndex
from kvfabric.policies.indexes import make_index

log = logging.getLogger("kvfabric.engine")


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


class PolicyContext:
    """Steering's observer of ``KVCacheManager.free`` (entered by the engine's one free wrapper): while vLLM frees
    a request's blocks, ``steering.ctx`` is that request's :class:`~kvfabric.policies.base.RequestInfo`."""

    __slots__ = ("info_of", "steering")

    def __init__(self, steering: Steering, info_of: Callable[[Any], RequestInfo]) -> None:
        self.steering = steering
        self.info_of = info_of

    def enter(self, request: Any) -> RequestInfo | None:
        steering = self.steering
        prev = steering.ctx
        try:
            steering.ctx = _ending_info(request, self.info_of)
        except Exception:
            steering.failed("free observer")
            steering.ctx = None
        return prev

    def leave(self, prev: RequestInfo | None) -> None:
        self.steering.ctx = prev


def _observe_policy(recorder: Any, steering: Steering, block_size: int,
                    info_of: Callable[[Any], RequestInfo]) -> None:
    """Per-request policy observers: admission (ghost judgement, on the recorder's admission path, which
    ``allocate_slots`` takes only for requests with nothing computed) and the context of a free."""
    policy = steering.policy
    assert policy is not None

    def observe_admission(request: Any, hit_tokens: int) -> None:
        try:
            hit = hit_tokens // block_size
            hashes = request.block_hashes
            policy.on_request_started(info_of(request), hit, len(hashes), _iter_digests(hashes, hit))
        except Exception:
            steering.failed("admission observer")

    if type(policy).on_request_started is not EvictionPolicy.on_request_started:
        recorder.observe_admissions(observe_admission)  # a policy that learns from admissions
    recorder.observe_frees(PolicyContext(steering, info_of))


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
        policy = make_policy(settings.policy, settings, block_size=block_size)
    index = None
    keeper = None
    if policy is not None:
        num_blocks = int(pool.num_gpu_blocks)
        null_block = int(getattr(getattr(pool, "null_block", None), "block_id", 0) or 0)
        clock: list[VictimIndex] = []
        keeper = StatisticsKeeper(num_blocks, lambda: clock[0].now, null_block, policy.reads)
        index = make_index(policy, keeper, num_blocks, native=settings.native)
        clock.append(index)
        recorder.follow_statistics(keeper)
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
        _observe_policy(recorder, steering, block_size, info_of)
    if settings.admission_gate_on:
        steering.gate = AnchorAdmissionGate(settings.admission_anchor_blocks)
        recorder.gate_with(AdmissionSeam(steering.gate))
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
