"""receiver -> queue -> writer, wired: the whole ingest side of the collector as one object.

Order matters at both ends: the writer starts before the socket accepts anything (and before the KV-event
subscribers, kvfabric.kvevents, start), and on stop the subscribers stop, then the socket server drains (its
connections may still be queueing batches), then the writer commits what is queued. That order is what "nothing
acknowledged is lost" rests on; a KV-event batch placed in the queue is committed too, and one not yet placed is
replayed to the next collector from the committed ``last_seq``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import duckdb

from kvfabric.contract import schema as S
from kvfabric.ingest import defaults as D
from kvfabric.ingest.backend import Backend
from kvfabric.ingest.budget import ByteBudget
from kvfabric.ingest.connection import IngestContext
from kvfabric.ingest.engines import EngineRegistry
from kvfabric.ingest.metrics import CollectorMetrics
from kvfabric.ingest.queue import BatchQueue
from kvfabric.ingest.ratelimit import RateLimitedLog
from kvfabric.ingest.server import StreamServer
from kvfabric.ingest.store import StreamState
from kvfabric.ingest.validate import BatchLimits
from kvfabric.ingest.writer import EventWriter, StopReport
from kvfabric.lake import LakeLocation
from kvfabric.queries import DatabaseUnavailable

if TYPE_CHECKING:
    from kvfabric.kvevents.engine_metrics import EngineMetricsScraper
    from kvfabric.kvevents.spec import EngineMetricsSpec, KvEventsSpec
    from kvfabric.kvevents.subscriber import KvEventsSubscriber

log = logging.getLogger("kvfabric.ingest")


@dataclass(frozen=True)
class IngestSettings:
    """Knobs of the ingest side (the collector's CLI flags map onto these)."""

    db_path: str
    socket_path: str
    socket_mode: int = D.SOCKET_MODE
    max_connections: int = D.MAX_CONNECTIONS
    handshake_timeout_s: float = D.HANDSHAKE_TIMEOUT_S
    drain_timeout_s: float = D.DRAIN_TIMEOUT_S
    max_batch_rows: int = D.MAX_BATCH_ROWS
    max_batch_bytes: int = D.MAX_BATCH_BYTES
    max_string_bytes: int = D.MAX_STRING_BYTES
    max_buffered_bytes: int = D.MAX_BUFFERED_BYTES
    message_timeout_s: float = D.MESSAGE_TIMEOUT_S
    idle_timeout_s: float = D.IDLE_TIMEOUT_S
    queue_max_rows: int = D.QUEUE_MAX_ROWS
    queue_max_bytes: int = D.QUEUE_MAX_BYTES
    coalesce_rows: int = D.COALESCE_ROWS
    coalesce_ms: int = D.COALESCE_MS
    gap_grace_s: float = D.GAP_GRACE_S
    checkpoint_threshold: str | None = None  # DuckDB size string; None = DuckDB's default (16MB)
    memory_limit: str | None = None  # DuckDB size string; None = DuckDB's default (80 % of RAM)
    allow_uids: frozenset[int] = field(default_factory=frozenset)
    lake: LakeLocation | None = None  # None: the DuckDB file db_path
    maintenance: Callable[[duckdb.DuckDBPyConnection], None] | None = None  # retention + compaction, writer thread
    maintenance_interval_s: float = 60.0
    kv_events: tuple[KvEventsSpec, ...] = ()  # vLLM KV-event publishers to subscribe to (kvfabric.kvevents)
    engine_metrics: tuple[EngineMetricsSpec, ...] = ()  # engines' /metrics to read prefix-cache counters from

    @property
    def backend(self) -> Backend:
        return Backend(self.db_path, self.lake)


class IngestPipeline:
    """Owns the read-write DuckDB connection, the writer thread and the socket server."""

    def __init__(self, settings: IngestSettings, metrics: CollectorMetrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.con: duckdb.DuckDBPyConnection | None = None
        self.writer: EventWriter | None = None
        self.server: StreamServer | None = None
        self.queue = BatchQueue(settings.queue_max_rows, settings.queue_max_bytes)
        #: The streams (engines) the socket holds or held, in memory (GET /api/v1/engines, kvfabric status).
        self.engines = EngineRegistry()
        self._readers_parent: duckdb.DuckDBPyConnection | None = None
        self._readers_lock = threading.Lock()
        self.budget: ByteBudget | None = None
        #: One per --kv-events spec and per engine-metrics URL (kvfabric.kvevents): started after the socket server,
        #: stopped before it drains (they queue batches like its connections do).
        self.kv_subscribers: list[KvEventsSubscriber] = []
        self.engine_scrapers: list[EngineMetricsScraper] = []

    def start(self) -> None:
        s = self.settings
        backend = s.backend
        self.con = backend.open(checkpoint_threshold=s.checkpoint_threshold, memory_limit=s.memory_limit)
        # Reader connections are made from a parent that no query ever runs on, under a lock, so they never touch
        # the writer's connection object from another thread.
        self._readers_parent = self.con.cursor()
        self.writer = EventWriter(
            self.con, self.queue, self.metrics, coalesce_rows=s.coalesce_rows, coalesce_s=s.coalesce_ms / 1000,
            gap_grace_s=s.gap_grace_s, reopen=self.reopen, insert_sql=backend.insert_sql,
            streams_sql=backend.streams_sql, lake=backend.is_lake,
            lookup_stream=self._lookup_stream if backend.is_lake else None, maintenance=s.maintenance,
            maintenance_interval_s=s.maintenance_interval_s,
        )
        writer = self.writer
        budget = ByteBudget(s.max_buffered_bytes)
        self.budget = budget
        self.metrics.bind_gauges(backend.size_bytes, lambda: writer.pending_rows,
                                 lambda: budget.held)
        self.writer.start()
        ctx = IngestContext(
            queue=self.queue,
            metrics=self.metrics,
            limits=BatchLimits(max_rows=s.max_batch_rows, max_bytes=s.max_batch_bytes,
                               max_string_bytes=s.max_string_bytes),
            handshake_timeout_s=s.handshake_timeout_s,
            stopping=threading.Event(),
            drain_deadline=[float("inf")],
            resume_seq=writer.resume_seq,
            message_timeout_s=s.message_timeout_s,
            idle_timeout_s=s.idle_timeout_s,
            rlog=RateLimitedLog(log, self.metrics.suppressed_log_lines),
            engines=self.engines,
        )
        self.server = StreamServer(
            s.socket_path, ctx, max_connections=s.max_connections, socket_mode=s.socket_mode, budget=budget,
            allow_uids=s.allow_uids,
        )
        try:
            self.server.start()
            self._start_kv_events(ctx.rlog)
        except BaseException:
            self.server = None
            self.stop()
            raise

    def _start_kv_events(self, rlog: RateLimitedLog | None) -> None:
        """One subscriber thread per --kv-events spec, one scraper per engine-metrics URL."""
        s = self.settings
        if not (s.kv_events or s.engine_metrics):
            return
        # (kvfabric.kvevents builds on ingest's queue, metrics and defaults: a module-level import here would be a
        # cycle through kvfabric.ingest's __init__)
        from kvfabric.kvevents.engine_metrics import EngineMetricsScraper
        from kvfabric.kvevents.stream import SubscriberContext
        from kvfabric.kvevents.subscriber import KvEventsSubscriber

        assert self.writer is not None
        ctx = SubscriberContext(queue=self.queue, metrics=self.metrics, max_string_bytes=s.max_string_bytes,
                                committed_streams=self._committed_kv_streams, resume_seq=self.writer.resume_seq,
                                engines=self.engines, rlog=rlog)
        for spec in s.kv_events:
            subscriber = KvEventsSubscriber(spec, ctx)
            subscriber.start()
            self.kv_subscribers.append(subscriber)
        for target in s.engine_metrics:
            scraper = EngineMetricsScraper(target, ctx)
            scraper.start()
            self.engine_scrapers.append(scraper)

    def _committed_kv_streams(self, engine: str, run_id: str) -> list[StreamState]:
        """The committed KV-event streams of (engine, run): on a lake, whichever collector wrote them."""
        try:
            con = self.reader_connection()
        except (DatabaseUnavailable, duckdb.Error):  # an invalidated instance: the writer reopens it
            return []
        try:
            rows = con.execute("SELECT * FROM streams WHERE source = ? AND engine = ? AND run_id = ?",
                               [S.SOURCE_KV_EVENTS, engine, run_id]).to_arrow_table()
            return [StreamState(**r) for r in rows.to_pylist()]
        except duckdb.Error as e:
            log.warning("kv-events %s: could not read its committed streams (%s); starting a new one", engine, e)
            return []
        finally:
            con.close()

    def reader_connection(self) -> duckdb.DuckDBPyConnection:
        """A new connection to the same database instance, for read-only queries in this process.

        DuckDB's MVCC gives it a consistent snapshot per query while the writer commits concurrently. While the
        database is being reopened after a storage fault, raises :class:`~kvfabric.queries.DatabaseUnavailable`
        (REST: 503).
        """
        with self._readers_lock:
            if self._readers_parent is None:
                raise DatabaseUnavailable("the database is not open (storage failing or collector stopping)")
            return self.settings.backend.cursor(self._readers_parent)

    def _lookup_stream(self, stream_id: str) -> StreamState | None:
        """The committed state of one stream in a shared lake (another collector may have written it last)."""
        try:
            con = self.reader_connection()
        except (DatabaseUnavailable, duckdb.Error):  # an invalidated instance: the writer's next commit reopens it
            return None
        try:
            rows = con.execute("SELECT * FROM streams WHERE stream_id = ?", [stream_id]).to_arrow_table()
            states = [StreamState(**r) for r in rows.to_pylist()]
        except duckdb.Error as e:
            log.warning("stream %r: could not read its committed state from the lake (%s)", stream_id, e)
            return None
        finally:
            con.close()
        return max(states, key=lambda st: st.last_seq, default=None)

    def reopen(self) -> duckdb.DuckDBPyConnection:
        """Close every connection to the database and open it again (DuckDB's way out of an invalidated instance:
        it keeps one instance per file while any connection to it lives). Called by the writer thread."""
        s = self.settings
        with self._readers_lock:
            for con in (self._readers_parent, self.con):
                if con is not None:
                    try:
                        con.close()
                    except duckdb.Error:
                        pass
            self._readers_parent = None
            self.con = None
            con = s.backend.open(checkpoint_threshold=s.checkpoint_threshold, memory_limit=s.memory_limit)
            self.con = con
            self._readers_parent = con.cursor()
            return con

    def stop(self) -> StopReport:
        """Drain the socket, commit the queue, checkpoint and close the database. Idempotent.

        Returns what the writer achieved (:class:`~kvfabric.ingest.writer.StopReport`)."""
        report = StopReport()
        for thread in (*self.kv_subscribers, *self.engine_scrapers):
            thread.stop(self.settings.drain_timeout_s)
        self.kv_subscribers, self.engine_scrapers = [], []
        if self.server is not None:
            self.server.stop(self.settings.drain_timeout_s)
            self.server = None
        if self.writer is not None:
            report = self.writer.stop()
            self.writer = None
        with self._readers_lock:
            if self._readers_parent is not None:
                self._readers_parent.close()
                self._readers_parent = None
        if self.con is not None:
            try:
                self.con.close()
            except duckdb.Error:
                pass
            self.con = None
        return report
