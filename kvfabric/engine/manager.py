"""Manager wrappers: instance attributes on one vLLM ``KVCacheManager`` that give pool calls their request.

``allocate_slots`` (every running request, every step) gets a wrapper with vLLM's exact signature
(:mod:`kvfabric.engine.signature`) that only sets the request in context; an admission attempt (nothing computed
yet) is observed and recorded. ``free`` is wrapped once, here, for every observer: the recorder's request context
and ``DONE`` record, and whatever entered :attr:`Recorder.free_observers` (steering's policy context).
Runs on vLLM's scheduler thread; manager calls do not nest.
"""

from __future__ import annotations

import functools
from typing import Any

from kvfabric.contract import records as R
from kvfabric.engine import signature
from kvfabric.engine.hints import owner
from kvfabric.engine.recorder import Recorder


def last_request(scheduler: Any) -> bool:
    """Whether the request being freed is the scheduler's last one (vLLM deletes a finished request from
    ``scheduler.requests`` right after freeing it; a preempted one stays). True without a scheduler."""
    requests = getattr(scheduler, "requests", None)
    return requests is None or len(requests) <= 1


def wrap_manager(manager: Any, r: Recorder) -> None:
    """Instance wrappers giving pool calls their request, and recording admissions (``prefix_lookup``) and ends.

    ``allocate_slots`` runs for every running request in every step: its wrapper has vLLM's exact signature
    (:mod:`kvfabric.engine.signature`) and only sets the request context; an admission attempt (nothing computed
    yet) takes :func:`admit`, which observes and records it."""
    allocate_slots = manager.allocate_slots
    free = manager.free
    hit_of = signature.argument_reader(allocate_slots, "num_new_computed_tokens", 0)

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
                # Whose the request is (tenant, LoRA): read here, once per admission attempt; the expander gives
                # its rows, and the blocks it seals, these.
                r.add((R.LOOKUP, r.clock(), r.step, request.request_id, r.family_of(request),
                       request.num_prompt_tokens, len(hashes), hit, hashes[hit // r.block_size:], *owner(request)))
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

    observers = r.free_observers  # (the recorder's own list: observers added later are seen)

    @functools.wraps(free)
    def kvfabric_free(request: Any, *args: Any, **kwargs: Any) -> Any:
        saved = [observer.enter(request) for observer in observers] if observers else None
        r.rid = request.request_id
        try:
            return free(request, *args, **kwargs)
        finally:
            r.rid = None
            if r.on:
                try:
                    if last_request(r.stepper):
                        r.handover_at = 0.0  # the engine may idle now: nothing is held back
                    r.add((R.DONE, request.request_id))
                    r.families.pop(request.request_id, None)
                except Exception:
                    r.failed("recording a request's end")
            if saved is not None:
                for observer, state in zip(reversed(observers), reversed(saved), strict=True):
                    observer.leave(state)

    manager.allocate_slots = signature.request_context_wrapper(allocate_slots, r, admit, "kvfabric_allocate_slots")
    manager.free = kvfabric_free
