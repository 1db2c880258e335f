"""The engines a collector hears from: one entry per event stream, in memory, from its schema on.

A hook's forwarder connects and sends its stream's schema as soon as vLLM builds the scheduler, before any request
(kvfabric/forwarder.py), and keeps the connection while the engine idles. So the streams this collector holds
are the engines that have KVFabric on, whether or not they have served anything yet: ``GET /api/v1/engines`` and
``kvfabric status`` read :meth:`EngineRegistry.snapshot`.

States (:data:`STATES`):

``connected``
    a connection of the stream is open.
``idle``
    the collector itself closed the stream's last connection (``--idle-timeout``, or its slot was needed) and the
    process at the other end still runs: its sink reconnects at once (or with its next events, for older hooks).
``disconnected``
    the engine's side ended the stream (the forwarder closed it at the engine's shutdown, or died), or the process
    that held it is gone.

Invariants:
  * an entry is keyed by stream id, so a reconnect (same stream) keeps its ``connected_since_ns`` and its counts;
    a new forwarder process (a restarted engine or forwarder) is a new stream, and its arrival removes the ended
    entries of the same (engine, run, host), which it replaces;
  * ``events`` counts the rows of the batches received on the stream, each ``seq`` once (a batch resent after a
    reconnect is not counted twice); rows are counted when received and validated, a moment before their commit;
  * at most :data:`KEEP_ENDED` ended (idle or disconnected) entries are kept, the most recently ended; connected
    ones are never dropped. Nothing survives a collector restart: a live hook reconnects within seconds;
  * every method is thread-safe (connection threads write, the HTTP thread reads) and never raises into ingest.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

from kvfabric.contract import protocol as P
from kvfabric.ingest.validate import StreamMeta

CONNECTED = "connected"
IDLE = "idle"
DISCONNECTED = "disconnected"
STATES = (CONNECTED, IDLE, DISCONNECTED)

KEEP_ENDED = 64
"""Ended streams remembered (most recent first dropped last): enough to see an A/B's arms or a crash loop."""

IDLE_GRACE_S = 60.0
"""A stream the collector closed, from a process whose liveness cannot be checked (pid unknown: another pid
namespace), counts as idle this long; a live hook reconnects well within it."""


@dataclass
class EngineStream:
    """One stream as the registry sees it (see the module docstring for the fields' rules)."""

    stream_id: str
    engine: str
    run_id: str
    policy: str
    vllm_version: str | None
    block_size: int
    num_blocks: int
    protocol: int
    host: str | None
    pid: int | None  # the engine process, as the hook declared it
    kvfabric_version: str | None
    peer_pid: int  # the process holding the connection (the forwarder), from SO_PEERCRED; 0 when unknown
    connected_since_ns: int
    last_seen_ns: int
    open_connections: int = 0
    connections: int = 0
    batches: int = 0
    events: int = 0
    max_seq: int = -1
    ended_ns: int | None = None
    ended_by_collector: bool = False
    ended_why: str | None = None
    _ended_mono: float = field(default=0.0, repr=False)


def _alive(pid: int) -> bool | None:
    """Whether process ``pid`` exists (None: cannot tell)."""
    if pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, another user's
    except OSError:
        return None
    return True


def _optional_int(value: str | None) -> int | None:
    try:
        return int(value) if value else None
    except ValueError:
        return None


class EngineRegistry:
    """See the module docstring."""

    def __init__(self, keep_ended: int = KEEP_ENDED) -> None:
        self._lock = threading.Lock()
        self._streams: dict[str, EngineStream] = {}
        self._keep_ended = keep_ended

    # -- written by connection threads ----------------------------------------------------------------------
    def opened(self, meta: StreamMeta, raw: dict[str, str], peer_pid: int) -> None:
        """A stream's schema was accepted on a new connection (before any batch). ``raw``: its schema metadata
        as sent (validated for size by :func:`~kvfabric.ingest.validate.parse_stream_meta`)."""
        now = time.time_ns()
        host = raw.get(P.META_HOST) or None
        with self._lock:
            entry = self._streams.get(meta.stream_id)
            if entry is None:
                entry = EngineStream(
                    stream_id=meta.stream_id, engine=meta.engine, run_id=meta.run_id, policy=meta.policy,
                    vllm_version=meta.vllm_version, block_size=meta.block_size, num_blocks=meta.num_blocks,
                    protocol=meta.protocol, host=host, pid=_optional_int(raw.get(P.META_PID)),
                    kvfabric_version=raw.get(P.META_KVFABRIC_VERSION) or None, peer_pid=peer_pid,
                    connected_since_ns=now, last_seen_ns=now,
                )
                # A new process of the same engine replaces what its predecessor left (not an idle stream: two
                # servers on one host share the default engine id <host>/dp0, and both are listed).
                for sid, old in list(self._streams.items()):
                    if (old.engine, old.run_id, old.host) == (entry.engine, entry.run_id, entry.host) and \
                            self.state(old) == DISCONNECTED:
                        del self._streams[sid]
                self._streams[meta.stream_id] = entry
            entry.peer_pid = peer_pid or entry.peer_pid
            entry.open_connections += 1
            entry.connections += 1
            entry.last_seen_ns = now
            entry.ended_ns = None
            entry.ended_by_collector = False
            entry.ended_why = None

    def received(self, stream_id: str, seq: int, rows: int) -> None:
        """A batch of ``rows`` rows passed validation and was queued for the writer."""
        with self._lock:
            entry = self._streams.get(stream_id)
            if entry is None:
                return
            entry.last_seen_ns = time.time_ns()
            if seq > entry.max_seq:
                entry.max_seq = seq
                entry.batches += 1
                entry.events += rows

    def closed(self, stream_id: str, *, by_collector: bool, why: str) -> None:
        """One connection of the stream ended: ``by_collector`` when this collector closed it (idle, its slot
        needed, refused, stopping) rather than the engine's side."""
        with self._lock:
            entry = self._streams.get(stream_id)
            if entry is None:
                return
            entry.open_connections = max(0, entry.open_connections - 1)
            if entry.open_connections:
                return
            entry.ended_ns = time.time_ns()
            entry._ended_mono = time.monotonic()
            entry.ended_by_collector = by_collector
            entry.ended_why = why
            self._prune()

    def _prune(self) -> None:
        ended = [e for e in self._streams.values() if e.open_connections == 0]
        if len(ended) <= self._keep_ended:
            return
        ended.sort(key=lambda e: e._ended_mono)
        for e in ended[: len(ended) - self._keep_ended]:
            del self._streams[e.stream_id]

    # -- read by the API ------------------------------------------------------------------------------------
    def state(self, entry: EngineStream) -> str:
        if entry.open_connections:
            return CONNECTED
        if entry.ended_by_collector:
            alive = _alive(entry.peer_pid)
            if alive or (alive is None and time.monotonic() - entry._ended_mono < IDLE_GRACE_S):
                return IDLE
        return DISCONNECTED

    def snapshot(self) -> list[dict[str, object]]:
        """Every stream known, as ``GET /api/v1/engines`` returns them: connected first (the longest connected
        first), then idle, then disconnected (the most recently ended first)."""
        with self._lock:
            states = [(self.state(e), e) for e in self._streams.values()]
            order = {s: i for i, s in enumerate(STATES)}

            def key(item: tuple[str, EngineStream]) -> tuple[int, int, str]:
                state, e = item
                when = -(e.ended_ns or 0) if state == DISCONNECTED else e.connected_since_ns
                return order[state], when, e.stream_id

            return [self._row(e, state) for state, e in sorted(states, key=key)]

    @staticmethod
    def _row(e: EngineStream, state: str) -> dict[str, object]:
        return {
            "engine": e.engine,
            "host": e.host,
            "pid": e.pid,
            "run_id": e.run_id,
            "policy": e.policy,
            "vllm_version": e.vllm_version,
            "kvfabric_version": e.kvfabric_version,
            "block_size": e.block_size,
            "num_blocks": e.num_blocks,
            "state": state,
            "connected_since_ns": e.connected_since_ns,
            "last_seen_ns": e.last_seen_ns,
            "ended_ns": e.ended_ns,
            "ended_why": e.ended_why,
            "events": e.events,
            "batches": e.batches,
            "connections": e.connections,
            "stream_id": e.stream_id,
            "protocol": e.protocol,
        }

    def counts(self) -> dict[str, int]:
        """Streams per state (all three always present)."""
        out = dict.fromkeys(STATES, 0)
        for row in self.snapshot():
            out[str(row["state"])] += 1
        return out
