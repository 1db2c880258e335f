"""The collector's Prometheus metrics (the contract is docs/metrics.md: names, types and labels are public).

One :class:`CollectorMetrics` per collector, on its own registry (no process/platform collectors, no ``_created``
series), so ``/metrics`` exposes exactly the documented families.

Analytics counters are advanced by the writer *after* the rows they describe committed, from one aggregate query
over the inserted Arrow table (never per row in Python), so a counter never runs ahead of the database.
Label cardinality is bounded: at most ``max_label_runs`` distinct ``run`` values, later runs share ``_other``;
``reason`` takes the values of :data:`EVICTION_REASON_LABELS` only (ingest refuses any other).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvfabric import settings
from kvfabric.contract import schema as S
from kvfabric.ingest.errors import (
    BAD_STREAM_REASONS,
    CLOSED_CONNECTION_REASONS,
    REFUSED_BATCH_REASONS,
    REFUSED_CONNECTION_REASONS,
)

OTHER_RUNS = "_other"
UNKNOWN_REASON = "unknown"
EVICTION_REASON_LABELS: tuple[str, ...] = (*S.EVICTION_REASONS, UNKNOWN_REASON)
"""Values of the ``reason`` label: the documented reasons, and ``unknown`` for rows that carry none."""
DEFAULT_MAX_LABEL_RUNS: int = settings.BY_NAME["KVFABRIC_MAX_LABEL_RUNS"].default

# Label values of the KV-event metrics (docs/metrics.md); kvfabric.kvevents uses only these.
KV_VIA = ("live", "replay")
KV_EVENT_KINDS = ("BlockStored", "BlockRemoved", "AllBlocksCleared")
KV_SKIP_REASONS = ("unknown_type", "medium")
KV_LOSS_GAP = "gap"  # a hole in the live sequence and no replay socket to ask
KV_LOSS_REPLAY = "replay_unavailable"  # the replay no longer held the range (or did not answer)
KV_LOSS_JOINED_LATE = "joined_late"  # published before this collector's first batch of the stream, not replayable
KV_LOSS_REASONS = (KV_LOSS_GAP, KV_LOSS_REPLAY, KV_LOSS_JOINED_LATE)
KV_DECODE_ERROR_REASONS = ("frames", "garbage", "truncated", "shape", "topic")

LAG_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0)
REBUILD_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
INSERT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)

# The "_created" samples are not part of the contract; they would double the series count for nothing.
prometheus_client.disable_created_metrics()


@dataclass(frozen=True)
class CommitAggregate:
    """Per (run, engine, event) sums over one committed insert, as computed by the writer's aggregate query."""

    run_id: str | None
    engine: str | None
    event: str
    rows: int
    prompt_tokens: int
    hit_tokens: int
    count_sum: int
    shared_anchor: int
    protected: int
    evicted_by_reason: tuple[int, ...] = ()
    """block_evicted rows per reason, in :data:`kvfabric.contract.schema.EVICTION_REASONS` order (the rest: unknown)."""

    @classmethod
    def from_row(cls, row: tuple) -> CommitAggregate:
        """The writer's aggregate row: the fields above in order, then one count per eviction reason."""
        return cls(*row[:9], evicted_by_reason=tuple(int(v) for v in row[9:]))


def max_label_runs_from_env() -> int:
    """``$KVFABRIC_MAX_LABEL_RUNS`` (kvfabric.settings: a bad value logs a warning and gives the default)."""
    return int(settings.read("KVFABRIC_MAX_LABEL_RUNS"))


class CollectorMetrics:
    """Every metric of docs/metrics.md, plus the helpers the ingest pipeline uses to advance them."""

    def __init__(self, max_label_runs: int | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._max_runs = max_label_runs if max_label_runs is not None else max_label_runs_from_env()
        self._runs: set[str] = set()
        self._lock = threading.Lock()
        r = self.registry
        re_ = ["run", "engine"]
        self.events = Counter("kvfabric_events_total", "Events ingested", [*re_, "event"], registry=r)
        self.prompt_tokens = Counter(
            "kvfabric_prompt_tokens_total", "Prompt tokens over admissions (prefix_lookup.prompt_tokens)", re_,
            registry=r,
        )
        self.prefix_hit_tokens = Counter(
            "kvfabric_prefix_hit_tokens_total", "Prompt tokens served from the prefix cache", re_, registry=r
        )
        self.evicted_blocks = Counter(
            "kvfabric_evicted_blocks_total", "Evicted blocks by kind (shared_anchor: share_degree >= 2)",
            [*re_, "kind"], registry=r,
        )
        self.evicted_by_reason = Counter(
            "kvfabric_evicted_blocks_by_reason_total",
            "Evicted blocks by why they lost their content (block_evicted.reason; unknown where not given)",
            [*re_, "reason"], registry=r,
        )
        self.protected_evictions = Counter(
            "kvfabric_protected_evictions_total", "Evictions of blocks the policy marked protected", re_, registry=r
        )
        self.rebuilt_blocks = Counter(
            "kvfabric_rebuilt_blocks_total", "Rebuilt-from-eviction blocks (block_rebuilt)", re_, registry=r
        )
        self.regretful_evictions = Counter(
            "kvfabric_regretful_evictions_total", "Regretful evictions (sum of prefix_lookup.count)", re_, registry=r
        )
        self.wasted_prefill_tokens = Counter(
            "kvfabric_wasted_prefill_tokens_total", "Block size x rebuilt blocks", re_, registry=r
        )
        self.admission_limited_blocks = Counter(
            "kvfabric_admission_limited_blocks_total", "Blocks the admission gate kept out of the cache", re_,
            registry=r,
        )
        self.sink_dropped_events = Counter(
            "kvfabric_sink_dropped_events_total", "Events the hook's sink had to drop", re_, registry=r
        )
        self.time_to_rebuild = Histogram(
            "kvfabric_time_to_rebuild_seconds", "From a block's eviction to its rebuild (block_rebuilt.age_ns)", re_,
            buckets=REBUILD_BUCKETS, registry=r,
        )
        self.run_info = Gauge(
            "kvfabric_run_info", "1 per run and engine seen, with the stream's policy and vLLM settings as labels",
            [*re_, "policy", "vllm_version", "block_size", "num_blocks"], registry=r,
        )
        self.ingest_rows = Counter("kvfabric_ingest_rows_total", "Rows written to DuckDB", registry=r)
        self.ingest_batches = Counter("kvfabric_ingest_batches_total", "Arrow batches received", registry=r)
        self.insert_duration = Histogram(
            "kvfabric_insert_duration_seconds", "Time of one coalesced DuckDB insert", buckets=INSERT_BUCKETS,
            registry=r,
        )
        self.ingest_lag = Histogram(
            "kvfabric_ingest_lag_seconds", "Event ts_ns to commit of its row (per received batch: its oldest row)",
            buckets=LAG_BUCKETS, registry=r,
        )
        self.sequence_gaps = Counter(
            "kvfabric_sequence_gaps_total", "Batches missing according to per-stream sequence numbers", registry=r
        )
        self.bad_streams = Counter(
            "kvfabric_bad_streams_total", "Streams refused or cut, by reason", ["reason"], registry=r
        )
        for reason in BAD_STREAM_REASONS:  # every reason shows as 0 from the start: alert rules need the series
            self.bad_streams.labels(reason=reason)
        self.refused_batches = Counter(
            "kvfabric_refused_batches_total", "Batches refused for their content (the stream goes on), by reason",
            ["reason"], registry=r,
        )
        for reason in REFUSED_BATCH_REASONS:
            self.refused_batches.labels(reason=reason)
        self.refused_rows = Counter(
            "kvfabric_refused_rows_total", "Rows of refused batches (counted, never stored)", registry=r
        )
        self.duplicate_batches = Counter(
            "kvfabric_duplicate_batches_total",
            "Batches received again after they were committed (a sink's resend): not stored twice", registry=r,
        )
        self.connections_refused = Counter(
            "kvfabric_connections_refused_total", "Connections closed right after accept, by reason", ["reason"],
            registry=r,
        )
        for reason in REFUSED_CONNECTION_REASONS:
            self.connections_refused.labels(reason=reason)
        self.connections_closed = Counter(
            "kvfabric_connections_closed_total",
            "Quiet connections the collector closed at a message boundary (idle, or evicted to make room)",
            ["reason"], registry=r,
        )
        for reason in CLOSED_CONNECTION_REASONS:
            self.connections_closed.labels(reason=reason)
        self.suppressed_log_lines = Counter(
            "kvfabric_log_lines_suppressed_total", "Refusal log lines left out by rate limiting", registry=r
        )
        self.buffered_bytes = Gauge(
            "kvfabric_ingest_buffered_bytes", "Bytes held in partly received messages, all connections together",
            registry=r,
        )
        self.storage_healthy = Gauge(
            "kvfabric_storage_healthy", "1 while DuckDB accepts writes, 0 from a failed write until one succeeds",
            registry=r,
        )
        self.storage_healthy.set(1)
        self.storage_errors = Counter(
            "kvfabric_storage_errors_total", "DuckDB write attempts that failed (disk full, I/O error, invalidated)",
            registry=r,
        )
        self.commit_conflicts = Counter(
            "kvfabric_lake_commit_conflicts_total",
            "Lake commits refused as conflicting with another writer's and retried (0 on a DuckDB file)", registry=r,
        )
        self.open_streams = Gauge("kvfabric_open_streams", "Connected sink streams", registry=r)
        self.db_size = Gauge("kvfabric_db_size_bytes", "Size of the DuckDB file and its WAL", registry=r)
        self.writer_queue_rows = Gauge(
            "kvfabric_writer_queue_rows", "Rows received but not yet committed", registry=r
        )
        self.up = Gauge("kvfabric_up", "1 while the collector serves and its storage accepts writes", registry=r)
        self._kv_events_metrics(r)

    def _kv_events_metrics(self, r: CollectorRegistry) -> None:
        """vLLM's KV-event streams (--kv-events, kvfabric.kvevents), label ``engine``: one series set per spec."""
        e = ["engine"]
        self.kv_batches = Counter(
            "kvfabric_kv_events_batches_total",
            "KV-event batches placed in their stream (stored or refused), label via = live | replay (a hole filled)",
            [*e, "via"], registry=r,
        )
        self.kv_events = Counter(
            "kvfabric_kv_events_events_total", "KV events decoded, label type = BlockStored | BlockRemoved | "
            "AllBlocksCleared", [*e, "type"], registry=r,
        )
        self.kv_skipped = Counter(
            "kvfabric_kv_events_skipped_events_total", "KV events skipped, label reason = unknown_type | medium",
            [*e, "reason"], registry=r,
        )
        self.kv_lost = Counter(
            "kvfabric_kv_events_lost_batches_total", "KV-event batches published and never stored, label reason",
            [*e, "reason"], registry=r,
        )
        self.kv_replays = Counter(
            "kvfabric_kv_events_replays_total", "Replay requests sent to publishers", e, registry=r,
        )
        self.kv_decode_errors = Counter(
            "kvfabric_kv_events_decode_errors_total", "KV-event messages that could not be used, label reason",
            [*e, "reason"], registry=r,
        )
        self.kv_reconnects = Counter(
            "kvfabric_kv_events_reconnects_total", "Publishers that went away and came back", e, registry=r,
        )
        self.kv_restarts = Counter(
            "kvfabric_kv_events_restarts_total", "Publisher restarts detected (sequence back to 0: a new stream)", e,
            registry=r,
        )
        self.kv_connected = Gauge(
            "kvfabric_kv_events_connected", "1 while the subscriber is connected to its publisher", e, registry=r,
        )
        self.kv_lag = Histogram(
            "kvfabric_kv_events_lag_seconds", "Receive time minus the batch's ts, live batches", e,
            buckets=LAG_BUCKETS, registry=r,
        )
        self.engine_scrapes = Counter(
            "kvfabric_engine_metrics_scrapes_total", "Reads of an engine's /metrics, label outcome = ok | failed",
            [*e, "outcome"], registry=r,
        )
        self.engine_counter_resets = Counter(
            "kvfabric_engine_metrics_counter_resets_total",
            "Prefix-cache counters of an engine seen going back (the engine restarted)", e, registry=r,
        )

    def open_kv_events(self, engine: str, *, scraped: bool = False) -> None:
        """A ``--kv-events`` engine (``scraped``: one with an engine-metrics URL): its series exist at 0 from now."""
        for via in KV_VIA:
            self.kv_batches.labels(engine, via)
        for kind in KV_EVENT_KINDS:
            self.kv_events.labels(engine, kind)
        for reason in KV_SKIP_REASONS:
            self.kv_skipped.labels(engine, reason)
        for reason in KV_LOSS_REASONS:
            self.kv_lost.labels(engine, reason)
        for reason in KV_DECODE_ERROR_REASONS:
            self.kv_decode_errors.labels(engine, reason)
        for metric in (self.kv_replays, self.kv_reconnects, self.kv_restarts, self.kv_connected,
                       self.kv_lag):
            metric.labels(engine)
        if scraped:
            for outcome in ("ok", "failed"):
                self.engine_scrapes.labels(engine, outcome)
            self.engine_counter_resets.labels(engine)

    def bind_gauges(
        self, db_size: Callable[[], float], queue_rows: Callable[[], float],
        buffered_bytes: Callable[[], float] | None = None,
    ) -> None:
        """Gauges read at scrape time (no thread has to keep them fresh)."""
        self.db_size.set_function(db_size)
        self.writer_queue_rows.set_function(queue_rows)
        if buffered_bytes is not None:
            self.buffered_bytes.set_function(buffered_bytes)

    def run_label(self, run_id: str | None) -> str:
        """``run_id`` itself for the first ``max_label_runs`` runs seen, ``_other`` after that."""
        run = run_id or ""
        with self._lock:
            if run in self._runs:
                return run
            if len(self._runs) < self._max_runs:
                self._runs.add(run)
                return run
        return OTHER_RUNS

    def open_run(self, run_id: str, engine: str, policy: str, vllm_version: str | None, block_size: int,
                 num_blocks: int) -> None:
        """A stream of ``run_id``/``engine`` connected: every per-run series exists from now on, at 0.

        Without this a series appears only at its first increment, and ``rate()``/``increase()`` cannot see that
        first step (an alert on the first sink drops of a run would never fire)."""
        run = self.run_label(run_id)
        for counter in (self.prompt_tokens, self.prefix_hit_tokens, self.protected_evictions, self.rebuilt_blocks,
                        self.regretful_evictions, self.wasted_prefill_tokens, self.admission_limited_blocks,
                        self.sink_dropped_events):
            counter.labels(run, engine)
        for kind in ("shared_anchor", "private_tail"):
            self.evicted_blocks.labels(run, engine, kind)
        for reason in EVICTION_REASON_LABELS:
            self.evicted_by_reason.labels(run, engine, reason)
        for event in S.EVENT_TYPES:
            self.events.labels(run, engine, event)
        self.time_to_rebuild.labels(run, engine)
        self.run_info.labels(run, engine, policy, vllm_version or "unknown", str(block_size), str(num_blocks)).set(1)

    def observe_rebuilds(self, rebuilt: Iterable[tuple[str | None, str | None, int | None]]) -> None:
        """Time-to-rebuild of committed ``block_rebuilt`` rows: (run_id, engine, age_ns)."""
        children: dict[tuple[str | None, str | None], Any] = {}  # (a labels() lookup per row cost more than observe)
        for run_id, engine, age_ns in rebuilt:
            if age_ns is not None:
                child = children.get((run_id, engine))
                if child is None:
                    child = children[run_id, engine] = self.time_to_rebuild.labels(self.run_label(run_id),
                                                                                   engine or "")
                child.observe(max(0, age_ns) / 1e9)

    def record_commit(self, aggregates: Iterable[CommitAggregate], block_size: Callable[[str, str], int]) -> None:
        """Advance the analytics counters for rows that just committed.

        ``block_size(run_id, engine)`` gives the block size of the stream(s) that carried those rows, the same
        join the SQL ``wasted_prefill_tokens`` uses, so the metric and the query agree.
        """
        for a in aggregates:
            run = self.run_label(a.run_id)
            engine = a.engine or ""
            self.events.labels(run, engine, a.event).inc(a.rows)
            if a.event == S.PREFIX_LOOKUP:
                self.prompt_tokens.labels(run, engine).inc(a.prompt_tokens)
                self.prefix_hit_tokens.labels(run, engine).inc(a.hit_tokens)
                self.regretful_evictions.labels(run, engine).inc(a.count_sum)
            elif a.event == S.BLOCK_EVICTED:
                self.evicted_blocks.labels(run, engine, "shared_anchor").inc(a.shared_anchor)
                self.evicted_blocks.labels(run, engine, "private_tail").inc(a.rows - a.shared_anchor)
                self.protected_evictions.labels(run, engine).inc(a.protected)
                known = 0
                for reason, n in zip(S.EVICTION_REASONS, a.evicted_by_reason, strict=False):
                    self.evicted_by_reason.labels(run, engine, reason).inc(n)
                    known += n
                self.evicted_by_reason.labels(run, engine, UNKNOWN_REASON).inc(a.rows - known)
            elif a.event == S.BLOCK_REBUILT:
                self.rebuilt_blocks.labels(run, engine).inc(a.rows)
                self.wasted_prefill_tokens.labels(run, engine).inc(a.rows * block_size(a.run_id or "", engine))
            elif a.event == S.CACHE_ADMISSION_LIMITED:
                self.admission_limited_blocks.labels(run, engine).inc(a.count_sum)
            elif a.event == S.SINK_DROPPED:
                self.sink_dropped_events.labels(run, engine).inc(a.count_sum)
