"""The hand-over: where the recorder's records go when vLLM's scheduler thread hands them over (:class:`Outlet`).

* :class:`RingOutlet` (``unix://`` and ``jsonl://`` sinks): serialise the step's records with ``marshal`` (one C
  call) into the shared-memory ring (:mod:`kvfabric.contract.ring`) read by the forwarder process, which expands them
  into events and ships them. It starts the forwarder, checks on it once a second, restarts it with backoff if it
  died, and counts what could not be handed over.
* :class:`LocalOutlet`: expand in-process, rows kept for the caller to :meth:`~Outlet.drain` (replays, tests).
* :class:`NullOutlet` (``none``): records are counted and dropped.

Loss is never silent: a message the ring cannot take, records a dead forwarder had taken but not delivered, and
records left at shutdown are counted as events (at least one per block they list) and reported as a
``sink_dropped`` row as soon as anything can be reported, and in :attr:`Outlet.lost_events` always.
"""

from __future__ import annotations

import atexit
import json
import logging
import marshal
import subprocess
import sys
import threading
import time
from typing import Any

from kvfabric.contract import records as R
from kvfabric.contract.ring import W_ACCOUNTED, W_CLOSING, W_CONSUMER, W_EXPANDED, W_SENT, Ring
from kvfabric.lifecycle.expander import Expander, expander_from_metadata

log = logging.getLogger("kvfabric.engine")

BYTES_PER_EVENT = 48
"""Ring bytes budgeted per buffered event: ``KVFABRIC_BUFFER_EVENTS`` x this is the ring's size (at least
:data:`MIN_RING_BYTES`); a step's records take ~25 bytes per block operation, so the default (1M events, 48 MB)
holds minutes of a busy engine's records while the collector is away."""
MIN_RING_BYTES = 1 << 10
MARSHAL_VERSION = 2
"""marshal format 2 keeps no table of repeated objects: a third faster to write than the default (4) for records,
whose objects (block ids, hashes) rarely repeat within a hand-over, at a few percent more bytes."""


class Outlet:
    """Base: counts what it is given and what it loses."""

    name = "none"

    def __init__(self) -> None:
        self.records = 0  # records handed over
        self.lost_events = 0  # events lost (counted, at least one per block of a lost record)

    def put(self, records: list[tuple]) -> None:
        self.records += len(records)

    def drain(self) -> list[tuple]:
        raise TypeError(f"the {self.name} outlet keeps no rows: build the hook with outlet='local' to drain them")

    @property
    def expander(self) -> Expander | None:
        """The expander running in this process (replays read its counters), or None."""
        return None

    def close(self) -> None:
        """Deliver what can be delivered within bounded time."""

    def describe(self) -> str:
        return self.name


class NullOutlet(Outlet):
    """``KVFABRIC_SINK=none``: the records are made (the hot path's whole cost) and dropped."""

    name = "none"


class LocalOutlet(Outlet):
    """Records expanded in this process at hand-over; rows wait in a list until drained."""

    name = "local"

    def __init__(self, metadata: dict[str, str], settings: Any) -> None:
        super().__init__()
        self.rows: list[tuple] = []
        self.expanding = expander_from_metadata(metadata, self.rows.append)

    def put(self, records: list[tuple]) -> None:
        self.records += len(records)
        self.expanding.apply(records)

    def drain(self) -> list[tuple]:
        rows, self.rows = self.rows, []
        self.expanding.emit = self.rows.append
        return rows

    @property
    def expander(self) -> Expander | None:
        return self.expanding


class TeeOutlet(Outlet):
    """In-process expansion (rows to drain) and another outlet (the collector) at once: replays that count events
    themselves and stream them too."""

    name = "tee"

    def __init__(self, local: LocalOutlet, remote: Outlet) -> None:
        super().__init__()
        self.local = local
        self.remote = remote

    def put(self, records: list[tuple]) -> None:
        self.records += len(records)
        self.local.put(records)
        self.remote.put(list(records))  # the remote outlet may prepend a LOST record to its list

    def drain(self) -> list[tuple]:
        return self.local.drain()

    @property
    def expander(self) -> Expander | None:
        return self.local.expanding

    def close(self) -> None:
        self.remote.close()

    @property
    def lost_events(self) -> int:  # type: ignore[override]
        return self.remote.lost_events

    @lost_events.setter
    def lost_events(self, value: int) -> None:
        pass

    def describe(self) -> str:
        return f"local + {self.remote.describe()}"


class RingOutlet(Outlet):
    """Records to the forwarder process through shared memory (see the module docstring)."""

    name = "forwarder"
    CHECK_EVERY_S = 1.0

    def __init__(self, sink: str, metadata: dict[str, str], settings: Any) -> None:
        super().__init__()
        self.sink = sink
        self.metadata = metadata
        self.batch_events = int(getattr(settings, "batch_events", 4096))
        self.flush_ms = int(getattr(settings, "flush_ms", 100))
        self.buffer_events = int(getattr(settings, "buffer_events", 1_000_000))
        self.ring = Ring.create(max(MIN_RING_BYTES, self.buffer_events * BYTES_PER_EVENT))
        self.proc: subprocess.Popen[bytes] | None = None
        self.spawns = 0
        self.unreported = 0  # lost events not yet reported through the ring
        self._backoff = 0.5
        self._next_spawn = 0.0
        self._next_check = 0.0
        # Totals over every forwarder this outlet ran (each restart starts the ring's words again at 0).
        self.expanded_events = 0  # events the forwarders made from the records
        self.delivered_events = 0  # of which delivered (or lost and reported in a delivered sink_dropped row)
        self._closed = False
        self._spawned_at = 0.0
        self._lock = threading.Lock()  # put() from the scheduler thread vs close() from atexit: never both at once
        self._spawn()
        atexit.register(self.close)

    def describe(self) -> str:
        return f"{self.sink} (forwarder)"

    # ---- the child -------------------------------------------------------------------------------------------

    def _spawn(self) -> None:
        """Start the forwarder on the existing ring: it resumes at the ring's read position."""
        now = time.monotonic()
        if now < self._next_spawn:
            return
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvfabric.forwarder", "--ring-fd", str(self.ring.fd),
                 "--ring-capacity", str(self.ring.capacity), "--sink", self.sink,
                 "--batch-events", str(self.batch_events), "--flush-ms", str(self.flush_ms),
                 "--buffer-events", str(self.buffer_events), "--metadata", json.dumps(self.metadata)],
                pass_fds=(self.ring.fd,), stdin=subprocess.DEVNULL, close_fds=True,
            )
        except (OSError, ValueError) as exc:
            self.proc = None
            self._next_spawn = now + self._backoff
            self._backoff = min(self._backoff * 2, 30.0)
            log.warning("kvfabric: cannot start the forwarder (%s); retrying in %.1f s", exc, self._backoff)
            return
        self.spawns += 1
        self._spawned_at = now
        self._next_check = now + self.CHECK_EVERY_S

    def _check(self) -> None:
        """Once a second: is the forwarder alive? If not, count what it took and never delivered, restart it."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            return
        if proc is not None:
            expanded, accounted = self.ring.word(W_EXPANDED), self.ring.word(W_ACCOUNTED)
            self.expanded_events += expanded
            self.delivered_events += accounted
            lost = expanded - accounted
            if lost > 0:
                self._lose(lost)
            # Sent but unacknowledged events may have been committed: the one over-count that cannot be known
            # (docs/reliability.md §1), said rather than hidden.
            in_flight = max(0, min(self.ring.word(W_SENT) - accounted, lost))
            log.warning("kvfabric: the forwarder exited (%s); %d events it held are counted lost (of which up to %d "
                        "were sent and may have been stored); restarting it", proc.returncode, max(lost, 0),
                        in_flight)
            # A new forwarder starts with an empty side table: events of blocks cached before it lack their
            # statistics until those blocks are sealed again (documented in docs/design.md §4).
            self.ring.set_word(W_EXPANDED, 0)
            self.ring.set_word(W_ACCOUNTED, 0)
            self.proc = None
            now = time.monotonic()
            if now - self._spawned_at >= 10 * self.CHECK_EVERY_S:
                self._backoff = 0.5  # it ran a while: a one-off crash, restart at once
                self._next_spawn = 0.0
            else:  # it died young: a crash loop, back off (doubling, up to 30 s)
                self._next_spawn = now + self._backoff
                self._backoff = min(self._backoff * 2, 30.0)
        self._spawn()

    def _lose(self, events: int) -> None:
        self.lost_events += events
        self.unreported += events

    def wait_ready(self, timeout: float = 30.0) -> bool:
        """Wait until the forwarder runs (it publishes its pid in the ring once its imports are done). vLLM never
        waits for this; benchmarks do, to measure steady state rather than a child's start-up."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.ring.word(W_CONSUMER) == self.proc.pid:
                return True
            time.sleep(0.01)
        return False

    # ---- hand-over (scheduler thread) ------------------------------------------------------------------------

    def put(self, records: list[tuple]) -> None:
        if not self._lock.acquire(blocking=False):
            self._lose(sum(R.events_in(r) for r in records))  # close() is draining: never wait on vLLM's thread
            return
        try:
            self.records += len(records)
            if self._closed:
                self._lose(sum(R.events_in(r) for r in records))
                return
            if self.unreported:
                records.insert(0, (R.LOST, time.time_ns(), self.unreported))
            if self.ring.write(marshal.dumps(records, MARSHAL_VERSION)):
                self.unreported = 0
            else:
                if self.unreported:
                    records.pop(0)
                self._lose(sum(R.events_in(r) for r in records))
            now = time.monotonic()
            if now >= self._next_check:
                self._next_check = now + self.CHECK_EVERY_S
                self._check()
        finally:
            self._lock.release()

    # ---- shutdown --------------------------------------------------------------------------------------------

    def close(self, timeout: float = 30.0) -> None:
        """Tell the forwarder to drain and exit; wait (bounded); count whatever did not make it."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            deadline = time.monotonic() + timeout
            if self.unreported:
                # The last count of loss must reach the collector too: wait (bounded) for the forwarder to make
                # room in a full ring.
                report = marshal.dumps([(R.LOST, time.time_ns(), self.unreported)], MARSHAL_VERSION)
                while not self.ring.write(report):
                    if time.monotonic() > deadline or self.proc is None or self.proc.poll() is not None:
                        break
                    time.sleep(0.01)
                else:
                    self.unreported = 0
            self.ring.set_word(W_CLOSING, 1)
            if self.proc is None or self.proc.poll() is not None:
                # No forwarder right now (it died, or waits out a backoff): count what the dead one held and start
                # one more to drain what is still in the ring.
                self._check()
                if self.proc is None:
                    self._next_spawn = 0.0
                    self._spawn()
            proc = self.proc
            if proc is None or proc.poll() is not None:
                self._check_dead_at_close()
            else:
                try:
                    proc.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning("kvfabric: forwarder still busy after %.0f s at close; stopping it", timeout)
                    proc.kill()
                    proc.wait()
                self._check_dead_at_close()
            lost = self.lost_events
            if lost:
                log.warning("kvfabric: %d events could not be delivered (counted as sink_dropped where possible)",
                            lost)
            self.ring.close()

    def _check_dead_at_close(self) -> None:
        """After the forwarder is gone: what it held, and what it never read, is lost."""
        expanded, accounted = self.ring.word(W_EXPANDED), self.ring.word(W_ACCOUNTED)
        self.expanded_events += expanded
        self.delivered_events += accounted
        held = expanded - accounted
        if held > 0:
            self.lost_events += held
        unread = 0
        self.ring.take_over_reading()
        while True:
            data = self.ring.read()
            if data is None:
                break
            try:
                unread += sum(R.events_in(r) for r in marshal.loads(data) if r[0] != R.LOST)
            except Exception:
                unread += 1
        self.lost_events += unread
        self.ring.set_word(W_CONSUMER, 0)


def make_outlet(spec: Any, settings: Any, metadata: dict[str, str]) -> Outlet:
    """The outlet for ``spec``: an :class:`Outlet`; ``"local"`` (expand in-process); ``"tee"`` (expand in-process
    and also follow ``settings.sink``); or None (follow ``settings.sink``)."""
    if isinstance(spec, Outlet):
        return spec
    if spec == "local":
        return LocalOutlet(metadata, settings)
    if spec == "tee":
        return TeeOutlet(LocalOutlet(metadata, settings), make_outlet(None, settings, metadata))
    if not getattr(settings, "lifecycle", False):
        return NullOutlet()
    sink = settings.sink
    if sink.startswith("unix://") or sink.startswith("jsonl://"):
        try:
            return RingOutlet(sink, metadata, settings)
        except OSError as exc:
            log.warning("kvfabric: cannot set up the event ring (%s); events are not sent", exc)
            return NullOutlet()
    return NullOutlet()
