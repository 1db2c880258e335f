"""A collector stream fed from outside the socket: its identity, its metadata, and its batches into the queue.

A KV-event stream's id is ``kv-events:{engine}:{epoch}``, ``epoch`` the wall-clock ns at which this collector first
heard that publisher incarnation (a restarted engine, its sequence back at 0, gets a new one); an engine's
``prefix_cache_counters`` rows go to ``kv-events:{engine}:metrics``. Batches keep the publisher's ``seq``, so the
writer's per-stream accounting applies unchanged: a batch is stored at most once, a hole in the sequence is a gap
(``streams.gaps``, ``kvfabric_sequence_gaps_total``), and ``streams.last_seq`` is where a restarted collector
resumes. Every published seq ends in exactly one of: stored (:meth:`KvStream.put`, an empty batch when it held
nothing to store), refused (:meth:`KvStream.refuse`: its payload could not be decoded, counted) or lost
(:meth:`KvStream.lose`: counted with its reason here, and a gap for the writer).

Invariants: only the owning thread calls a :class:`KvStream`; its metadata reaches the writer (``StreamOpened``)
before its first batch, again after each reconnect of the publisher (``streams.connections``), and once more
(``refresh``) when its block size or data-parallel rank becomes known.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pyarrow as pa

from kvfabric.contract import schema as S
from kvfabric.ingest.engines import EngineRegistry
from kvfabric.ingest.errors import UNDECODABLE
from kvfabric.ingest.metrics import KV_LOSS_REASONS, CollectorMetrics
from kvfabric.ingest.queue import BatchQueue, BatchReceived, BatchRefused, StreamOpened
from kvfabric.ingest.ratelimit import RateLimitedLog
from kvfabric.ingest.store import StreamState
from kvfabric.ingest.validate import BatchInfo, StreamMeta

log = logging.getLogger("kvfabric.kvevents")

PREFIX = "kv-events"
UNKNOWN_POLICY = "unknown"  # the engine's eviction policy: this source does not say
PROTOCOL = 0  # not a sink connection: nothing is acknowledged (the publisher's replay socket recovers batches)


@dataclass
class SubscriberContext:
    """What the collector hands its KV-event threads: where batches go, what is committed, where to count."""

    queue: BatchQueue
    metrics: CollectorMetrics
    max_string_bytes: int
    committed_streams: Callable[[str, str], list[StreamState]]  # (engine, run) -> its committed kv_events streams
    resume_seq: Callable[[str], int]  # stream id -> highest committed seq (-1: none)
    engines: EngineRegistry | None = None
    rlog: RateLimitedLog | None = None
    stopping: threading.Event = field(default_factory=threading.Event)

    def log(self, level: int, key: str, msg: str, *args: object) -> None:
        if self.rlog is None:
            log.log(level, msg, *args)
        else:
            self.rlog.log(level, key, msg, *args)


def event_stream_id(engine: str, epoch_ns: int | None = None) -> str:
    return f"{PREFIX}:{engine}:{time.time_ns() if epoch_ns is None else epoch_ns}"


def metrics_stream_id(engine: str) -> str:
    return f"{PREFIX}:{engine}:metrics"


def is_event_stream(sid: str, engine: str) -> bool:
    """Whether ``sid`` is one of ``engine``'s event streams (not its engine-metrics stream)."""
    head = f"{PREFIX}:{engine}:"
    return sid.startswith(head) and sid[len(head):].isdigit()


@dataclass
class Labels:
    """The constants of a stream's rows and metadata."""

    engine: str
    run_id: str
    host: str | None
    settings: dict[str, object]
    peer: str  # how logs and ``streams.peer`` name the other end


class KvStream:
    """One stream (module docstring). ``resumed``: its committed state, when this collector continues a stream it
    (or another collector of the lake) stored before."""

    def __init__(self, ctx: SubscriberContext, sid: str, labels: Labels, *, resumed: StreamState | None = None,
                 register: bool = True) -> None:
        self.ctx = ctx
        self.stream_id = sid
        self.labels = labels
        self.resumed = resumed
        self.register = register  # listed in GET /api/v1/engines (the event streams; not the metrics one)
        self.block_size = resumed.block_size if resumed is not None else 0
        self.dp_rank: int | None = resumed.dp_rank if resumed is not None else None
        self.batches = 0
        self.rows = 0
        self.refused = 0
        self.lost: dict[str, int] = dict.fromkeys(KV_LOSS_REASONS, 0)
        self._opened = False  # StreamOpened sent for the current connection
        self._registered = False

    @property
    def fresh(self) -> bool:
        """Nothing of it stored, refused or lost yet, and not a resumed stream: a hole before its first batch is
        history this collector joined too late for."""
        return self.resumed is None and not (self.batches or self.refused or any(self.lost.values()))

    def meta(self) -> StreamMeta:
        lb = self.labels
        return StreamMeta(
            stream_id=self.stream_id, engine=lb.engine, run_id=lb.run_id, schema_version=S.SCHEMA_VERSION,
            block_size=self.block_size, num_blocks=0, policy=UNKNOWN_POLICY, vllm_version=None,
            settings=json.dumps(lb.settings), protocol=PROTOCOL, host=lb.host, dp_rank=self.dp_rank,
            source=S.SOURCE_KV_EVENTS,
        )

    def learn(self, *, block_size: int = 0, dp_rank: int | None = None) -> None:
        """Metadata the batches tell (the first stored block's size, the publisher's rank): sent with the next
        batch."""
        learnt = False
        if not self.block_size and block_size > 0:
            self.block_size, learnt = block_size, True
        if self.dp_rank is None and dp_rank is not None:
            self.dp_rank, learnt = dp_rank, True
        if learnt and self._opened:
            self._announce(refresh=True)

    def reconnected(self) -> None:
        """The publisher came back: the next batch announces the stream again (one connection more)."""
        self._opened = False

    def closed(self, *, by_collector: bool, why: str) -> None:
        """The publisher went away or restarted, or the collector stops: for the list of engines."""
        if self._registered and self.ctx.engines is not None:
            self.ctx.engines.closed(self.stream_id, by_collector=by_collector, why=why)
        self._registered = False
        self._opened = False

    def _announce(self, *, refresh: bool = False) -> None:
        meta = self.meta()
        self.ctx.queue.put(StreamOpened(meta=meta, peer=self.labels.peer, refresh=refresh))
        if not refresh:
            self.ctx.metrics.open_run(meta.run_id, meta.engine, meta.policy, None, meta.block_size, 0)
            if self.register and self.ctx.engines is not None:
                self.ctx.engines.opened(meta, {S.META_HOST: self.labels.host or ""}, 0)
                self._registered = True
        self._opened = True

    # -- batches -------------------------------------------------------------------------------------------
    def put(self, seq: int, record: pa.RecordBatch, ts_ns: int, received_ns: int) -> int:
        """Queue batch ``seq`` (rows of one ``ts_ns``); returns its rows. Blocks while the writer's queue is full
        (the SUB socket then fills, and the publisher drops: a gap, counted).

        ``record`` is built by this package in :data:`~kvfabric.contract.schema.EVENT_SCHEMA` with the stream's
        labels, known event types and reasons, and strings msgspec decoded (valid UTF-8) under the string cap
        (:class:`~kvfabric.kvevents.convert.Converter`): what a sink's batch is checked for holds by construction,
        so it is not checked again (that check cost as much as the conversion)."""
        if not self._opened:
            self._announce()
        info = BatchInfo(seq=seq, rows=record.num_rows, nbytes=record.nbytes, min_ts_ns=ts_ns, max_ts_ns=ts_ns)
        self.ctx.queue.put(BatchReceived(stream_id=self.stream_id, batch=record, info=info, received_ns=received_ns))
        self.batches += 1
        self.rows += info.rows
        if self._registered and self.ctx.engines is not None:
            self.ctx.engines.received(self.stream_id, seq, info.rows)
        return info.rows

    def refuse(self, seq: int, message: str) -> None:
        """Batch ``seq`` arrived but its payload could not be decoded: counted (``undecodable``), never stored."""
        if not self._opened:
            self._announce()
        self.ctx.log(logging.WARNING, f"kv-refused:{self.labels.engine}", "kv-events %s: batch seq %d refused "
                     "(%s: %s); counted, the stream goes on", self.labels.engine, seq, UNDECODABLE, message)
        self.ctx.queue.put(BatchRefused(stream_id=self.stream_id, seq=seq, refused_rows=0, reason=UNDECODABLE))
        self.refused += 1

    def lose(self, first: int, last: int, reason: str) -> int:
        """Batches ``first..last`` were published and will never be stored: counted with ``reason``."""
        n = last - first + 1
        if n <= 0:
            return 0
        self.lost[reason] += n
        self.ctx.metrics.kv_lost.labels(self.labels.engine, reason).inc(n)
        self.ctx.log(logging.WARNING, f"kv-lost:{self.labels.engine}:{reason}", "kv-events %s: %d batch(es) lost "
                     "(seq %d..%d, %s) on stream %r", self.labels.engine, n, first, last, reason, self.stream_id)
        return n
