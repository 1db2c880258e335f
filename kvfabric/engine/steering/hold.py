"""Cache-aware hold (``KVFABRIC_CACHE_AWARE_SCHEDULING=1``, off by default): a waiting request whose next uncached
block is being prefilled right now by a running request is held back (skipped for this step) until that request has
sealed the shared blocks, so it hits them instead of computing them a second time.

Runs on vLLM's scheduler thread, inside ``Scheduler._handle_blocked_waiting_request`` (an instance attribute wraps
it); the hold owns only its counters. A look that fails lets its request through (vLLM's own answer stands; the
first failure is logged). When vLLM shuts the scheduler down (or at exit, where the scheduler lives in the main
process), one line in vLLM's log says how many requests it held: an operator who turned it on learns whether the
traffic ever gave it anything to do. The same line is written each time the scheduler drains (no request left)
with counts that changed since it was last written, because vLLM may kill its EngineCore during teardown before
the scheduler's shutdown runs; the last line in the log is the total.
"""

from __future__ import annotations

import atexit
import functools
import logging
import re
from typing import Any

log = logging.getLogger("kvfabric.engine")
summary_log = logging.getLogger("vllm.kvfabric")  # vLLM's handler: shown at vLLM's default level
# Ids of requests held now; past this many, ids of requests the scheduler no longer knows (aborted while held) go,
# and the next prune waits until twice what stayed is held, so that many requests held at once cost one scan each.
HOLDING_PRUNE_AT = 4096
# The line written when the scheduler drains or vLLM shuts it down, and its reader (kvfabric ab reads the log).
SUMMARY = "KVFabric cache-aware scheduling held {requests:,} request(s) for {steps:,} scheduler step(s)"
SUMMARY_LINE = re.compile(r"KVFabric cache-aware scheduling held ([\d,]+) request\(s\) for ([\d,]+) scheduler step")


def parse_summary(text: str) -> dict[str, int] | None:
    """The last :data:`SUMMARY` line in ``text`` as ``{"requests", "steps"}``; None when there is none."""
    found = SUMMARY_LINE.findall(text)
    if not found:
        return None
    requests, steps = found[-1]
    return {"requests": int(requests.replace(",", "")), "steps": int(steps.replace(",", ""))}


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
        self.held_requests = 0  # holds: a request counts once per hold, however many steps the hold lasts
        self._holding: set[str] = set()  # requests held at their last look, released ones removed
        self._prune_at = HOLDING_PRUNE_AT
        self.errors = 0
        self._reported: tuple[int, int, int] | None = None  # the counts the last line said
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
                    if request.request_id not in self._holding:
                        self.held_requests += 1
                        self._holding.add(request.request_id)
                        if len(self._holding) > self._prune_at:
                            self._holding &= set(getattr(self.scheduler, "requests", {}) or ())
                            self._prune_at = max(HOLDING_PRUNE_AT, 2 * len(self._holding))
                    return False
                self._holding.discard(request.request_id)
            except Exception:
                self.errors += 1
                if self.errors == 1:
                    log.exception("kvfabric: cache-aware scheduling failed; this request is let through")
            return True

        self.scheduler._handle_blocked_waiting_request = kvfabric_handle_blocked_waiting_request
        # A drained scheduler writes the line too (only when the counts moved, the first time whatever they are, so
        # a hold that never held says so too): a client has all its answers only after this step's outputs, so the
        # line precedes any stop a benchmark sends once its requests are done.
        update = self.scheduler.update_from_output

        @functools.wraps(update)
        def kvfabric_update_from_output(*args: Any, **kwargs: Any) -> Any:
            out = update(*args, **kwargs)
            try:
                if not self.scheduler.has_unfinished_requests():
                    self.report()
            except Exception:  # (never into vLLM: the line waits for shutdown)
                pass
            return out

        self.scheduler.update_from_output = kvfabric_update_from_output
        # It is also written when vLLM shuts the scheduler down: vLLM's EngineCore is a child process that leaves
        # by os._exit (and may be killed during its teardown), so atexit alone would run only where the scheduler
        # lives in the main process (kvfabric replay), where it stands in for a shutdown nobody calls.
        shutdown = getattr(self.scheduler, "shutdown", None)
        if callable(shutdown):
            @functools.wraps(shutdown)
            def kvfabric_shutdown(*args: Any, **kwargs: Any) -> Any:
                self.report()
                return shutdown(*args, **kwargs)

            self.scheduler.shutdown = kvfabric_shutdown
        atexit.register(self.report)

    def summary(self) -> str:
        return (SUMMARY.format(requests=self.held_requests, steps=self.held_steps)
                + (f"; {self.errors:,} look(s) failed and let their request through" if self.errors else ""))

    def report(self) -> None:
        """Log :meth:`summary` unless the last line logged said the same counts. Never raises."""
        counts = (self.held_requests, self.held_steps, self.errors)
        if counts == self._reported:
            return
        self._reported = counts
        try:
            summary_log.info("%s", self.summary())
        except Exception:  # (logging torn down at exit: nothing to tell it to)
            pass
