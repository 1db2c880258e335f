"""The Recorder: the engine's state on vLLM's scheduler thread, and the one way records are made.

Every pool and manager wrapper (:mod:`.pool`, :mod:`.manager`) appends one compact record per vLLM call
(:mod:`kvfabric.contract.records`) through :meth:`Recorder.add`, which applies it to steering's statistics keeper
when a policy reads statistics and hands the list to the installation's outlet (:mod:`.handover`) every 100 ms,
every 4096 records and when the last request ends.

Ownership: the Recorder's slots are written by this class and by the recording wrappers of :mod:`.pool` and
:mod:`.manager` (the request in context, the victims slot they clear); steering and the installation change it only
through its methods (:meth:`follow_statistics`, :meth:`gate_with`, :meth:`observe_admissions`,
:meth:`observe_frees`, :meth:`report_victims`, :meth:`note`, :meth:`connect`). The compiled hooks
(:mod:`.compiled`) read the same slots by name and apply records as :meth:`add` does.

Invariants: no I/O and no lock here; a failure anywhere in KVFabric turns ``on`` off (:meth:`failed`), and vLLM
carries on as if nothing were installed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from kvfabric.contract import records as R
from kvfabric.engine.config import HookSettings
from kvfabric.engine.families import FamilyNamer

log = logging.getLogger("kvfabric.engine")

HANDOVER_S = 0.1
"""Records are handed over by the first record made this long after the last hand-over (see :meth:`Recorder.add`);
the forwarder's own batches wait as long (``KVFABRIC_FLUSH_MS``, 100 by default)."""
HANDOVER_RECORDS = 4096
"""... or when this many wait."""


def _nothing() -> None:
    pass


class Recorder:
    """The hook's state on the scheduler thread: the record list, the step, the request in context.

    ``on`` is False once anything in KVFabric failed (or when nothing asked for records): the wrappers then do
    nothing but call vLLM. ``keeper`` is steering's statistics keeper (a policy reads block statistics), applied to
    each record as it is made; ``log`` is None when events are not recorded (a policy alone).
    """

    __slots__ = ("block_size", "clock", "errors", "families", "free_observers", "fresh_observers", "gate", "handover",
                 "handover_at", "keeper", "log", "name_family", "on", "rid", "stepper", "victims")

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
        #: Entered (``enter(request)``, its result saved) before vLLM frees a request, and left (``leave(saved)``,
        #: in reverse order) after the free is recorded: steering's policy context. Each handles its own errors.
        self.free_observers: list[Any] = []
        #: Hands the records made so far to the outlet (the installation's ``flush``; it never raises).
        self.handover: Callable[[], None] = _nothing
        #: ``time.monotonic()`` from which the next record triggers a hand-over (0: the next one does).
        self.handover_at = 0.0
        self.rid: str | None = None  # the request whose KVCacheManager call is in progress (pool calls see it)
        #: The policy's victims in the allocation in progress (:meth:`report_victims`; the allocation's record
        #: carries them), else None.
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

    # ---- what steering and the installation may change (the only ways they do) ----------------------------

    def connect(self, handover: Callable[[], None], stepper: Any = None) -> None:
        """Hand records over through ``handover`` (the installation's ``flush``; it never raises); take each
        record's step from ``stepper.current_step`` (a scheduler; None: step 0)."""
        self.handover = handover
        if stepper is not None:
            self.stepper = stepper

    def follow_statistics(self, keeper: Any) -> None:
        """Apply every record to ``keeper`` (steering's :class:`~kvfabric.lifecycle.keeper.StatisticsKeeper`) as
        it is made."""
        self.keeper = keeper

    def gate_with(self, gate: Any) -> None:
        """Let ``gate`` narrow ``cache_full_blocks``' mask
        (:class:`~kvfabric.engine.steering.admission.AdmissionSeam`)."""
        self.gate = gate

    def observe_admissions(self, observe: Callable[[Any, int], None]) -> None:
        """Call ``observe(request, hit_tokens)`` at each admission attempt, before it is recorded."""
        self.fresh_observers.append(observe)

    def observe_frees(self, observer: Any) -> None:
        """Enter ``observer`` around each ``KVCacheManager.free`` (see :attr:`free_observers`)."""
        self.free_observers.append(observer)

    def report_victims(self, chosen: list[int]) -> None:
        """The allocation in progress evicted ``chosen`` by the policy's choice: its ``ALLOCATED`` record says so."""
        if self.victims is None:
            self.victims = chosen
        else:  # (a second hand-out within one allocation)
            self.victims += chosen

    def note(self, record: tuple) -> None:
        """Append ``record`` to the pending records as it is, for the expander only: not applied to the keeper, and
        it triggers no hand-over (steering's ``SCORED`` reports ride with the next recorded call)."""
        pending = self.log
        if pending is not None:
            pending.append(record)

