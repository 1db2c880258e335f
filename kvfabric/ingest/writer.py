"""The single DuckDB writer: coalesces queued batches into large inserts and keeps the ``streams`` table.

Why one writer: DuckDB allows one writing process and serialises writers anyway; one thread that owns the
connection turns many small batches (the sink sends ~4096 rows) into few large inserts, which is what makes
>= 1M rows/s possible (one INSERT per 4096-row batch reached ~0.35-0.5M rows/s; inserts of whole DuckDB row groups,
122880 rows each, are written straight to the file; see benchmarks/results/ingest.md). The default target,
245760 rows, is two row groups = 60 sink batches of 4096 rows.

Invariants:
  * every commit holds the events of some queue items *and* the ``streams`` rows accounting for them, in one
    transaction: ``streams.rows`` always equals the committed rows of that stream and ``last_seq`` its last
    committed batch, so a restarted collector resumes gap detection exactly;
  * metrics advance only after COMMIT returned;
  * :meth:`EventWriter.stop` returns after every item queued before it was called is committed (or reported lost
    in the log when DuckDB itself fails), followed by a CHECKPOINT.
"""

from __future__ import annotations

import logging
import threading
import time

import duckdb
import pyarrow as pa

from kvfabric import schema as S
from kvfabric.ingest.metrics import CollectorMetrics, CommitAggregate
from kvfabric.ingest.queue import BatchQueue, BatchReceived, QueueItem, StreamOpened
from kvfabric.ingest.store import StreamState, load_streams, quote, streams_table

log = logging.getLogger("kvfabric.ingest.writer")

_COLS = ", ".join(quote(c) for c in S.COLUMNS)
_INSERT_SQL = f"INSERT INTO events ({_COLS}) SELECT {_COLS} FROM _kvf_ingest"
# block_evicted rows per documented reason, in S.EVICTION_REASONS order (validation admits no other value).
_REASON_COLS = "".join(
    f",\n       count(*) FILTER (WHERE event = '{S.BLOCK_EVICTED}' AND reason = '{r}') AS evicted_{r}"
    for r in S.EVICTION_REASONS
)
# Aggregates for the analytics counters, computed by DuckDB over the Arrow table just inserted.
_AGG_SQL = f"""
SELECT run_id, engine, event, count(*) AS n,
       coalesce(sum(prompt_tokens), 0) AS prompt_tokens,
       coalesce(sum(hit_tokens), 0) AS hit_tokens,
       coalesce(sum("count"), 0) AS count_sum,
       count(*) FILTER (WHERE event = '{S.BLOCK_EVICTED}' AND share_degree >= 2) AS shared_anchor,
       count(*) FILTER (WHERE event = '{S.BLOCK_EVICTED}' AND protected) AS protected{_REASON_COLS}
FROM _kvf_ingest GROUP BY run_id, engine, event
"""
# Rebuilt rows are a small share of events; their ages feed the time-to-rebuild histogram.
_REBUILT_SQL = f"SELECT run_id, engine, age_ns FROM _kvf_ingest WHERE event = '{S.BLOCK_REBUILT}'"


class EventWriter:
    """Owns the read-write DuckDB connection; consumes :class:`BatchQueue` in a thread (see module docstring)."""

    def __init__(
        self,
        con: duckdb.DuckDBPyConnection,
        queue: BatchQueue,
        metrics: CollectorMetrics,
        *,
        coalesce_rows: int = 245_760,
        coalesce_s: float = 0.1,
    ) -> None:
        self._con = con
        self._queue = queue
        self._metrics = metrics
        self._coalesce_rows = coalesce_rows
        self._coalesce_s = coalesce_s
        self._streams: dict[str, StreamState] = load_streams(con)
        self._block_sizes: dict[tuple[str, str], int] = {}
        self._run_block_sizes: dict[str, int] = {}
        for st in self._streams.values():
            self._learn_block_size(st)
        self._in_flight_rows = 0
        self._thread: threading.Thread | None = None
        self.failed: BaseException | None = None
        self.commits = 0

    # -- lifecycle ------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvfabric-writer", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Close the queue, commit everything in it, CHECKPOINT. Producers must have stopped first."""
        self._queue.close()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("writer did not finish within %.1f s; rows still queued: %d", timeout, self.pending_rows)
                return
        try:
            self._con.execute("CHECKPOINT")
        except duckdb.Error as e:  # the WAL still holds the data; DuckDB replays it on the next open
            log.warning("CHECKPOINT at shutdown failed (%s); the WAL will be replayed on next open", e)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def pending_rows(self) -> int:
        """Rows received but not committed: queued plus the insert in progress."""
        return self._queue.rows + self._in_flight_rows

    def stream_states(self) -> dict[str, StreamState]:
        """A snapshot of the per-stream accounting as last committed (or being committed)."""
        return dict(self._streams)

    def block_size(self, run_id: str, engine: str) -> int:
        """Block size of (run, engine) from stream metadata; the run's if the engine is unknown; else 0."""
        return self._block_sizes.get((run_id, engine)) or self._run_block_sizes.get(run_id, 0)

    # -- the loop -------------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                items = self._queue.get_many(self._coalesce_rows, self._coalesce_s)
                if items is None:
                    return
                self._in_flight_rows = sum(i.rows for i in items)
                try:
                    self._commit(items)
                finally:
                    self._in_flight_rows = 0
        except BaseException as e:  # recorded for /healthz, then the thread ends loudly
            self.failed = e
            log.exception("writer thread died; ingest stops committing")
            raise

    def _learn_block_size(self, st: StreamState) -> None:
        key = (st.run_id, st.engine)
        self._block_sizes[key] = max(st.block_size, self._block_sizes.get(key, 0))
        self._run_block_sizes[st.run_id] = max(st.block_size, self._run_block_sizes.get(st.run_id, 0))

    def _apply(self, items: list[QueueItem], states: dict[str, StreamState]) -> tuple[list[pa.RecordBatch], int]:
        """Fold items into copies of the stream states; return the batches to insert and the new gaps."""
        batches: list[pa.RecordBatch] = []
        gaps = 0
        for item in items:
            if isinstance(item, StreamOpened):
                m = item.meta
                old = states.get(m.stream_id) or self._streams.get(m.stream_id)
                st = StreamState(
                    stream_id=m.stream_id, run_id=m.run_id, engine=m.engine, vllm_version=m.vllm_version,
                    block_size=m.block_size, num_blocks=m.num_blocks, policy=m.policy, settings=m.settings,
                    schema_version=m.schema_version, peer=item.peer,
                    first_seen_ns=old.first_seen_ns if old else item.received_ns, last_seen_ns=item.received_ns,
                )
                if old is not None:  # a reconnect: keep the accounting, refresh the metadata
                    for name in ("connections", "batches", "rows", "last_seq", "gaps", "seq_resets",
                                 "first_ts_ns", "last_ts_ns"):
                        setattr(st, name, getattr(old, name))
                    if (old.run_id, old.engine, old.block_size) != (m.run_id, m.engine, m.block_size):
                        log.warning("stream %r reconnected with other metadata (run %r engine %r block_size %d)",
                                    m.stream_id, m.run_id, m.engine, m.block_size)
                st.connections += 1
                states[m.stream_id] = st
                continue
            assert isinstance(item, BatchReceived)
            st = states.get(item.stream_id)
            if st is None:
                known = self._streams.get(item.stream_id)
                if known is None:  # only if its StreamOpened failed to commit: nothing to account it against
                    log.error("stream %r seq %d: metadata never committed, %d rows dropped",
                              item.stream_id, item.info.seq, item.info.rows)
                    continue
                st = _copy(known)
                states[item.stream_id] = st
            info = item.info
            expected = st.last_seq + 1
            if info.seq > expected:
                missing = info.seq - expected
                gaps += missing
                st.gaps += missing
                log.warning("stream %r: %d batch(es) missing (seq %d..%d never arrived)",
                            item.stream_id, missing, expected, info.seq - 1)
            elif info.seq < expected:
                # A sink restarted with the same stream id (or resent): keep the rows, follow the new numbering.
                st.seq_resets += 1
                log.warning("stream %r: seq went back from %d to %d; rows kept, sequence followed",
                            item.stream_id, st.last_seq, info.seq)
            st.last_seq = info.seq
            st.batches += 1
            st.rows += info.rows
            st.last_seen_ns = item.received_ns
            st.first_ts_ns = info.min_ts_ns if st.first_ts_ns is None else min(st.first_ts_ns, info.min_ts_ns)
            st.last_ts_ns = info.max_ts_ns if st.last_ts_ns is None else max(st.last_ts_ns, info.max_ts_ns)
            batches.append(item.batch)
        return batches, gaps

    def _commit(self, items: list[QueueItem]) -> None:
        states: dict[str, StreamState] = {}
        batches, gaps = self._apply(items, states)
        # One contiguous chunk (a memcpy of ~40 ms per 250k rows): DuckDB then appends it as whole row groups
        # instead of scanning many small batches on parallel threads that each leave a partial row group behind
        # (measured on 2 cores: 1.2-2.1M vs 0.4-0.9M rows/s, and 37 vs 57-75 bytes/row on disk).
        table = pa.Table.from_batches(batches, schema=S.EVENT_SCHEMA).combine_chunks()
        t0 = time.perf_counter()
        try:
            aggregates, rebuilt = self._transaction(table, list(states.values()))
        except duckdb.Error as e:
            if len(items) > 1:
                # Find the item DuckDB refuses, commit the others: one bad batch must not cost a whole window.
                log.warning("coalesced insert of %d rows failed (%s); retrying item by item", table.num_rows, e)
                for item in items:
                    self._commit([item])
                return
            where = item_label(items[0])
            log.error("insert failed for %s, %d rows lost: %s", where, table.num_rows, e)
            return
        duration = time.perf_counter() - t0
        self._streams.update(states)
        for st in states.values():
            self._learn_block_size(st)
        self.commits += 1
        m = self._metrics
        m.insert_duration.observe(duration)
        m.ingest_rows.inc(table.num_rows)
        if gaps:
            m.sequence_gaps.inc(gaps)
        now_ns = time.time_ns()
        for item in items:
            if isinstance(item, BatchReceived):
                m.ingest_lag.observe(max(0.0, (now_ns - item.info.min_ts_ns) / 1e9))
        m.record_commit(aggregates, self.block_size)
        m.observe_rebuilds(rebuilt)

    def _transaction(
        self, table: pa.Table, states: list[StreamState]
    ) -> tuple[list[CommitAggregate], list[tuple[str | None, str | None, int | None]]]:
        con = self._con
        con.execute("BEGIN TRANSACTION")
        try:
            aggregates: list[CommitAggregate] = []
            rebuilt: list[tuple[str | None, str | None, int | None]] = []
            if table.num_rows:
                con.register("_kvf_ingest", table)
                try:
                    con.execute(_INSERT_SQL)
                    aggregates = [CommitAggregate.from_row(row) for row in con.execute(_AGG_SQL).fetchall()]
                    if any(a.event == S.BLOCK_REBUILT for a in aggregates):
                        rebuilt = con.execute(_REBUILT_SQL).fetchall()
                finally:
                    con.unregister("_kvf_ingest")
            if states:
                con.execute("DELETE FROM streams WHERE stream_id IN (SELECT unnest(?::VARCHAR[]))",
                            [[s.stream_id for s in states]])
                con.register("_kvf_streams", streams_table(states))
                try:
                    con.execute("INSERT INTO streams SELECT * FROM _kvf_streams")
                finally:
                    con.unregister("_kvf_streams")
            con.execute("COMMIT")
        except BaseException:
            con.execute("ROLLBACK")
            raise
        return aggregates, rebuilt


def _copy(st: StreamState) -> StreamState:
    return StreamState(**vars(st))


def item_label(item: QueueItem) -> str:
    if isinstance(item, StreamOpened):
        return f"stream {item.meta.stream_id!r} (metadata)"
    return f"stream {item.stream_id!r} seq {item.info.seq}"

