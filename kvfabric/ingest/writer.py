"""The single DuckDB writer: coalesces queued batches into large inserts and keeps the ``streams`` table.

Why one writer: DuckDB allows one writing process and serialises writers anyway; one thread that owns the
connection turns many small batches (the sink sends ~4096 rows) into few large inserts, which is what makes
>= 1M rows/s possible (one INSERT per 4096-row batch reached ~0.35-0.5M rows/s; inserts of whole DuckDB row groups,
122880 rows each, are written straight to the file; see benchmarks/results/ingest.md). The default target,
245760 rows, is two row groups = 60 sink batches of 4096 rows.

Invariants:
  * every commit holds the events of some queue items *and* the ``streams`` rows accounting for them, in one
    transaction: ``streams.rows`` always equals the committed rows of that stream and ``last_seq`` its highest
    committed batch, so a restarted collector resumes gap detection and deduplication exactly;
  * a batch is stored at most once per (stream id, seq): a ``seq`` not above ``last_seq`` is a duplicate (a sink's
    resend after a lost acknowledgement) unless it fills a gap left open less than ``gap_grace_s`` ago (batches of
    one stream arriving out of order over two connections); a gap counts in ``kvfabric_sequence_gaps_total`` only
    once that grace has passed, so reordering is not reported as loss;
  * acknowledgements (protocol 2) go out only after the COMMIT that holds the batches they name returned;
  * metrics advance only after COMMIT returned;
  * a storage fault (disk full, I/O error, DuckDB's "database has been invalidated") loses nothing received: the
    items of the failed commit are held, no further items are taken (the bounded queue fills, connections stop
    reading, sinks keep their unacknowledged batches), ``kvfabric_storage_healthy`` is 0 and /healthz is 503 until
    a retry (reopening the database when DuckDB invalidated it) commits them;
  * :meth:`EventWriter.stop` commits every item queued before it was called, then CHECKPOINTs, and reports
    truthfully in :class:`StopReport` what could not be committed.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import duckdb
import pyarrow as pa

from kvfabric.contract import schema as S
from kvfabric.ingest import defaults as D
from kvfabric.ingest.acks import AckChannel
from kvfabric.ingest.backend import FILE_INSERT_SQL, Backend
from kvfabric.ingest.errors import STORE_FAILED
from kvfabric.ingest.metrics import CollectorMetrics, CommitAggregate
from kvfabric.ingest.queue import BatchQueue, BatchReceived, BatchRefused, QueueItem, StreamOpened
from kvfabric.ingest.ratelimit import RateLimitedLog
from kvfabric.ingest.store import StreamState, load_streams, streams_table
from kvfabric.lake import is_commit_conflict

log = logging.getLogger("kvfabric.ingest.writer")

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

MAX_PENDING_GAP_RANGES = 256
"""Open gaps remembered per stream (ranges of missing seqs); beyond it the oldest are confirmed at once."""
RETRY_MIN_S = 0.5
RETRY_MAX_S = 10.0
CONFLICT_RETRIES = 12
"""Lake commit races retried at once (with jittered backoff) before the commit counts as a storage fault."""
CONFLICT_BACKOFF_S = 0.02
CONFLICT_BACKOFF_MAX_S = 1.0


class StorageFault(Exception):
    """A write failed for a reason that is not the data's: retry the same items later."""


def is_storage_fault(exc: duckdb.Error) -> bool:
    """Disk full, I/O errors, an invalidated database, a failed commit: the database, not the rows, is at fault."""
    if isinstance(exc, (duckdb.IOException, duckdb.FatalException, duckdb.InternalException,
                        duckdb.OutOfMemoryException, duckdb.TransactionException)):
        return True
    text = str(exc).lower()
    return any(s in text for s in ("invalidated", "could not write", "no space left", "file too large"))


def needs_reopen(exc: BaseException) -> bool:
    """DuckDB refuses every statement on an invalidated database until it is closed and opened again."""
    text = str(exc).lower()
    return isinstance(exc, duckdb.FatalException) or "invalidated" in text or "fatal" in text


@dataclass
class StopReport:
    """What :meth:`EventWriter.stop` achieved: the collector logs "flushed" only when ``clean``."""

    uncommitted_rows: int = 0
    checkpoint_ok: bool = True
    problem: str | None = None

    @property
    def clean(self) -> bool:
        return self.uncommitted_rows == 0 and self.checkpoint_ok and self.problem is None


class _Gaps:
    """Open (unconfirmed) gaps of one stream: ranges ``[first, last]`` of missing seqs, with when each opened."""

    __slots__ = ("ranges",)

    def __init__(self, ranges: list[list[float]] | None = None) -> None:
        self.ranges: list[list[float]] = ranges or []  # [first, last, opened_monotonic]

    def copy(self) -> _Gaps:
        return _Gaps([list(r) for r in self.ranges])

    def open(self, first: int, last: int, now: float) -> list[tuple[int, int]]:
        """Record a new gap; returns ranges that had to be confirmed at once (over the bound)."""
        self.ranges.append([first, last, now])
        overflow = []
        while len(self.ranges) > MAX_PENDING_GAP_RANGES:
            a, b, _ = self.ranges.pop(0)
            overflow.append((int(a), int(b)))
        return overflow

    def fill(self, seq: int) -> bool:
        """``seq`` arrived late: take it out of its open gap; False when no open gap holds it."""
        for i, (a, b, t) in enumerate(self.ranges):
            if a <= seq <= b:
                parts = [[a, seq - 1, t]] if seq > a else []
                if seq < b:
                    parts.append([seq + 1, b, t])
                self.ranges[i : i + 1] = parts
                return True
        return False

    def expire(self, before: float) -> list[tuple[int, int]]:
        """Confirm (remove and return) the ranges opened before ``before``."""
        old = [(int(a), int(b)) for a, b, t in self.ranges if t <= before]
        if old:
            self.ranges = [r for r in self.ranges if r[2] > before]
        return old

    def low_watermark(self) -> int | None:
        """The first missing seq, if any."""
        return int(min(r[0] for r in self.ranges)) if self.ranges else None


class EventWriter:
    """Owns the read-write DuckDB connection; consumes :class:`BatchQueue` in a thread (see module docstring).

    ``reopen`` (given by the pipeline) closes every connection to the database and opens a new one: DuckDB needs
    that after it invalidated the database instance.
    """

    def __init__(
        self,
        con: duckdb.DuckDBPyConnection,
        queue: BatchQueue,
        metrics: CollectorMetrics,
        *,
        coalesce_rows: int = D.COALESCE_ROWS,
        coalesce_s: float = D.COALESCE_MS / 1000,
        gap_grace_s: float = D.GAP_GRACE_S,
        reopen: Callable[[], duckdb.DuckDBPyConnection] | None = None,
        insert_sql: str = FILE_INSERT_SQL,
        streams_sql: tuple[str, ...] = Backend("").streams_sql,
        lake: bool = False,
        lookup_stream: Callable[[str], StreamState | None] | None = None,
        maintenance: Callable[[duckdb.DuckDBPyConnection], None] | None = None,
        maintenance_interval_s: float = 60.0,
    ) -> None:
        self._con = con
        self._insert_sql = insert_sql
        self._streams_sql = streams_sql
        # A lake is shared: another collector may have committed a stream since this one loaded it, and any
        # storage fault (catalog connection lost, object store refusing) is cured by attaching again.
        self._lake = lake
        self._lookup_stream = lookup_stream
        self._maintenance = maintenance
        self._maintenance_interval_s = maintenance_interval_s
        self._next_maintenance = time.monotonic() + maintenance_interval_s
        self._queue = queue
        self._metrics = metrics
        self._coalesce_rows = coalesce_rows
        self._coalesce_s = coalesce_s
        self._gap_grace_s = gap_grace_s
        self._reopen = reopen
        self._streams: dict[str, StreamState] = load_streams(con)
        self._gaps: dict[str, _Gaps] = {}
        self._block_sizes: dict[tuple[str, str], int] = {}
        self._run_block_sizes: dict[str, int] = {}
        for st in self._streams.values():
            self._learn_block_size(st)
        self._in_flight_rows = 0
        self._held: list[QueueItem] = []  # items of a commit that failed for a storage fault, retried in order
        self._held_rows = 0
        self._attempts = 0  # failed attempts in the current storage fault (paces the retries)
        self._needs_reopen = False
        self._reopened = 0  # reopens in the current storage fault
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._rlog = RateLimitedLog(log, metrics.suppressed_log_lines)
        self.failed: BaseException | None = None
        self.storage_problem: str | None = None
        self.storage_failed_since: float | None = None  # time.time() of the first failed write of this episode
        self.uncommitted_rows = 0  # rows given up at stop (storage still failing)
        self.commits = 0

    # -- lifecycle ------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvfabric-writer", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> StopReport:
        """Close the queue, commit everything in it, CHECKPOINT. Producers must have stopped first.

        With storage failing, one last attempt is made; what still cannot be committed is reported (protocol-2
        senders keep those batches unacknowledged and resend them to the next collector)."""
        report = StopReport()
        self._queue.close()
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("writer did not finish within %.1f s; rows still queued: %d", timeout, self.pending_rows)
                report.problem = f"writer still busy after {timeout} s"
                report.uncommitted_rows = self.pending_rows
                return report
        report.uncommitted_rows = self.uncommitted_rows
        if self.failed is not None:
            report.problem = f"writer thread died: {self.failed}"
        elif self.storage_problem is not None:
            report.problem = f"storage failing: {self.storage_problem}"
            report.checkpoint_ok = False  # nothing to checkpoint into
            return report
        if self._lake:  # every commit is durable in the catalog; a lake's CHECKPOINT would run its compaction
            return report
        try:
            self._con.execute("CHECKPOINT")
        except duckdb.Error as e:  # the WAL still holds the data; DuckDB replays it on the next open
            report.checkpoint_ok = False
            report.problem = report.problem or f"CHECKPOINT failed: {e}"
            log.error("CHECKPOINT at shutdown failed (%s); committed rows are in the WAL, replayed on next open", e)
        return report

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def healthy(self) -> bool:
        return self.alive and self.storage_problem is None

    @property
    def pending_rows(self) -> int:
        """Rows received but not committed: queued, held after a storage fault, plus the insert in progress."""
        return self._queue.rows + max(self._in_flight_rows, self._held_rows)

    def stream_states(self) -> dict[str, StreamState]:
        """A snapshot of the per-stream accounting as last committed (or being committed)."""
        return dict(self._streams)

    def resume_seq(self, stream_id: str) -> int:
        """HELLO's value for a connecting stream: every batch up to it is committed (or given up as a gap)."""
        st = self._streams.get(stream_id)
        last = st.last_seq if st is not None else -1
        if self._lookup_stream is not None:  # a lake: the stream may have been committed by another collector
            shared = self._lookup_stream(stream_id)
            if shared is not None and shared.last_seq > last:
                return shared.last_seq
        gaps = self._gaps.get(stream_id)
        first_missing = gaps.low_watermark() if gaps is not None else None
        return last if first_missing is None else min(last, first_missing - 1)

    def block_size(self, run_id: str, engine: str) -> int:
        """Block size of (run, engine) from stream metadata; the run's if the engine is unknown; else 0."""
        return self._block_sizes.get((run_id, engine)) or self._run_block_sizes.get(run_id, 0)

    # -- the loop -------------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                if self._held and not self._retry_held():
                    continue
                items = self._queue.get_many(self._coalesce_rows, self._coalesce_s, timeout=0.5)
                self._confirm_gaps(time.monotonic() - self._gap_grace_s)
                if items is None:
                    self._confirm_gaps(float("inf"))  # stopping: what is still open stays open for good
                    return
                if items:
                    self._process(items)
                self._maybe_maintain()
        except BaseException as e:  # recorded for /healthz, then the thread ends loudly
            self.failed = e
            log.exception("writer thread died; ingest stops committing")
            raise

    def _maybe_maintain(self) -> None:
        """Retention and compaction (``maintenance``), in this thread so they never race the writes, when due and
        storage is healthy. A failure is logged and retried at the next interval; ingest goes on."""
        if self._maintenance is None or self._held or time.monotonic() < self._next_maintenance:
            return
        try:
            self._maintenance(self._con)
            if self._lake and self._reopen is not None:
                # DuckLake's compaction leaves the in-memory database holding memory it never returns (measured:
                # RSS grew ~0.3 MB/s under a steady load with maintenance every 10 s, flat with a fresh attach
                # after each run); attaching anew costs ~0.1 s per interval and frees all of it.
                self._con = self._reopen()
        except Exception as e:
            self._rlog.log(logging.WARNING, "maintenance", "retention/compaction failed (retried in %.0f s): %s",
                           self._maintenance_interval_s, str(e).splitlines()[0][:300] if str(e) else e)
            if self._reopen is not None and (self._lake or needs_reopen(e) or isinstance(e, duckdb.InternalException)):
                # DuckLake's compaction racing another collector's has raised INTERNAL errors, and DuckDB then
                # invalidates the whole instance: every later statement, the writes' too, fails until it is opened
                # again. Reopen now so that ingest goes on; the maintenance itself waits for the next interval.
                try:
                    self._con = self._reopen()
                except Exception as reopen_error:  # the next commit meets the fault and takes the storage path
                    self._needs_reopen = True
                    log.warning("reopening the database after a failed maintenance failed: %s", reopen_error)
        finally:
            self._next_maintenance = time.monotonic() + self._maintenance_interval_s

    def _process(self, items: list[QueueItem]) -> None:
        self._in_flight_rows = sum(i.rows for i in items)
        try:
            self._commit(items)
        except StorageFault as e:
            self._held = items
            self._held_rows = sum(i.rows for i in items)
            self._storage_failed(e)
        finally:
            self._in_flight_rows = 0

    def _storage_failed(self, exc: BaseException) -> None:
        self._attempts += 1
        self._needs_reopen = self._needs_reopen or self._lake or needs_reopen(exc)
        self._metrics.storage_errors.inc()
        self._metrics.storage_healthy.set(0)
        first = self.storage_problem is None
        self.storage_problem = str(exc).splitlines()[0][:300]
        if first:
            self.storage_failed_since = time.time()
            held = self._held_rows
            log.error(
                "storage failing: %s. Ingest is held: %d rows kept for retry, no further batches are taken (the "
                "queue is bounded; sinks keep unacknowledged batches); /healthz answers 503 until a retry commits",
                self.storage_problem, held,
            )
        else:
            self._rlog.log(logging.WARNING, "storage", "storage still failing: %s", self.storage_problem)

    def _retry_held(self) -> bool:
        """One retry of the held items after a pause (reopening the database if DuckDB invalidated it)."""
        pause = 0.0 if self._stopping.is_set() else min(RETRY_MAX_S, RETRY_MIN_S * 2 ** min(self._attempts, 10))
        self._stopping.wait(pause)  # stop() wakes it: one last attempt, then give up (see stop())
        try:
            if self._needs_reopen and self._reopen is not None:
                self._con = self._reopen()
                # The committed state is the truth: a COMMIT that raised may still have been durable (DuckDB says
                # so when only its autocheckpoint failed); what it held is now recognised as duplicates.
                self._streams = load_streams(self._con)
                self._needs_reopen = False
                self._reopened += 1
            self._in_flight_rows = self._held_rows
            self._commit(self._held)
        except Exception as e:  # StorageFault, or the reopen failing (disk still full, file gone, ...)
            self._storage_failed(e)
            if self._stopping.is_set():
                self._give_up()
            return False
        finally:
            self._in_flight_rows = 0
        since = self.storage_failed_since or time.time()
        log.warning("storage recovered after %.1f s%s; %d held rows committed", time.time() - since,
                    f" (database reopened {self._reopened}x)" if self._reopened else "", self._held_rows)
        self._held = []
        self._held_rows = 0
        self._attempts = 0
        self._reopened = 0
        self.storage_problem = None
        self.storage_failed_since = None
        self._metrics.storage_healthy.set(1)
        return True

    def _give_up(self) -> None:
        """Stopping with storage still failing: count what cannot be committed, drain the closed queue."""
        lost = self._held_rows
        self._held = []
        self._held_rows = 0
        while True:
            items = self._queue.get_many(self._coalesce_rows, 0.0, timeout=0.0)
            if not items:
                break
            lost += sum(i.rows for i in items)
        self.uncommitted_rows += lost
        log.error(
            "stopping with storage failing (%s): %d received rows were NOT committed. Protocol-2 sinks never got "
            "their acknowledgement and resend them to the next collector; protocol-1 sinks lost them",
            self.storage_problem, lost,
        )
        self._queue.close()

    def _learn_block_size(self, st: StreamState) -> None:
        key = (st.run_id, st.engine)
        self._block_sizes[key] = max(st.block_size, self._block_sizes.get(key, 0))
        self._run_block_sizes[st.run_id] = max(st.block_size, self._run_block_sizes.get(st.run_id, 0))

    # -- sequence bookkeeping -------------------------------------------------------------------------------
    def _confirm_gaps(self, before: float) -> None:
        """Gaps still open after the grace period are lost batches: count them now (they are already in
        ``streams.gaps``, which says "missing so far")."""
        for sid, gaps in list(self._gaps.items()):
            for first, last in gaps.expire(before):
                self._report_gap(sid, first, last)
            if not gaps.ranges:
                del self._gaps[sid]

    def _report_gap(self, stream_id: str, first: int, last: int) -> None:
        n = last - first + 1
        self._metrics.sequence_gaps.inc(n)
        self._rlog.log(logging.WARNING, f"gap:{stream_id}", "stream %r: %d batch(es) missing (seq %d..%d never "
                       "arrived)", stream_id, n, first, last)

    def _sequence(self, st: StreamState, gaps: _Gaps, seq: int, now: float) -> str:
        """Place ``seq`` in the stream's sequence: ``"next"`` (store), ``"fill"`` (store, closes part of a gap)
        or ``"duplicate"`` (already committed: do not store)."""
        if seq > st.last_seq:
            if seq > st.last_seq + 1:
                st.gaps += seq - st.last_seq - 1
                for first, last in gaps.open(st.last_seq + 1, seq - 1, now):
                    self._report_gap(st.stream_id, first, last)
            st.last_seq = seq
            return "next"
        if gaps.fill(seq):
            st.gaps -= 1
            return "fill"
        st.duplicates += 1
        return "duplicate"

    def _apply(
        self, items: list[QueueItem], states: dict[str, StreamState], gaps: dict[str, _Gaps]
    ) -> tuple[list[pa.RecordBatch], int, int, list[BatchRefused]]:
        """Fold items into copies of the stream states; return the batches to insert, the duplicates, the
        refused rows and the refusals recorded."""
        batches: list[pa.RecordBatch] = []
        duplicates = 0
        refused_rows = 0
        refusals: list[BatchRefused] = []
        now = time.monotonic()
        for item in items:
            if isinstance(item, StreamOpened):
                m = item.meta
                old = states.get(m.stream_id) or self._streams.get(m.stream_id)
                if m.stream_id not in states:
                    old = self._fresher(old, m.stream_id)
                st = StreamState(
                    stream_id=m.stream_id, run_id=m.run_id, engine=m.engine, vllm_version=m.vllm_version,
                    block_size=m.block_size, num_blocks=m.num_blocks, policy=m.policy, settings=m.settings,
                    schema_version=m.schema_version, peer=item.peer,
                    first_seen_ns=old.first_seen_ns if old else item.received_ns, last_seen_ns=item.received_ns,
                    host=m.host, dp_rank=m.dp_rank, source=m.source,
                )
                if old is not None:  # a reconnect: keep the accounting, refresh the metadata
                    for name in ("connections", "batches", "rows", "last_seq", "gaps", "seq_resets",
                                 "first_ts_ns", "last_ts_ns", "duplicates", "refused_batches", "refused_rows"):
                        setattr(st, name, getattr(old, name))
                    if not item.refresh and (old.run_id, old.engine, old.block_size) != (m.run_id, m.engine,
                                                                                          m.block_size):
                        log.warning("stream %r reconnected with other metadata (run %r engine %r block_size %d)",
                                    m.stream_id, m.run_id, m.engine, m.block_size)
                if not item.refresh:
                    st.connections += 1
                states[m.stream_id] = st
                continue
            st = states.get(item.stream_id)
            if st is None:
                known = self._streams.get(item.stream_id)
                if known is None:  # only if its StreamOpened failed to commit: nothing to account it against
                    log.error("stream %r: metadata never committed, %d rows dropped", item.stream_id, item.rows)
                    continue
                st = _copy(known)
                states[item.stream_id] = st
            g = gaps.get(item.stream_id)
            if g is None:
                g = gaps[item.stream_id] = (self._gaps.get(item.stream_id) or _Gaps()).copy()
            if isinstance(item, BatchRefused):
                if item.seq is not None and self._sequence(st, g, item.seq, now) == "duplicate":
                    duplicates += 1
                    continue
                st.refused_batches += 1
                st.refused_rows += item.refused_rows
                refused_rows += item.refused_rows
                refusals.append(item)
                continue
            info = item.info
            placed = self._sequence(st, g, info.seq, now)
            if placed == "duplicate":
                duplicates += 1
                continue
            st.batches += 1
            st.rows += info.rows
            st.last_seen_ns = item.received_ns
            st.first_ts_ns = info.min_ts_ns if st.first_ts_ns is None else min(st.first_ts_ns, info.min_ts_ns)
            st.last_ts_ns = info.max_ts_ns if st.last_ts_ns is None else max(st.last_ts_ns, info.max_ts_ns)
            batches.append(item.batch)
        return batches, duplicates, refused_rows, refusals

    def _fresher(self, known: StreamState | None, stream_id: str) -> StreamState | None:
        """The lake's committed state of ``stream_id`` when it is ahead of ours (the stream last wrote through
        another collector): its batches up to that ``last_seq`` are then recognised as duplicates."""
        shared = self._lookup_stream(stream_id) if self._lookup_stream is not None else None
        if shared is not None and (known is None or shared.last_seq > known.last_seq):
            self._gaps.pop(stream_id, None)
            return shared
        return known

    # -- commit ---------------------------------------------------------------------------------------------
    def _commit(self, items: list[QueueItem]) -> None:
        """Commit ``items`` in one transaction, or item by item when DuckDB refuses one for its data.

        Raises :class:`StorageFault` (nothing committed by this call) when the database is at fault."""
        states: dict[str, StreamState] = {}
        gaps: dict[str, _Gaps] = {}
        batches, duplicates, refused_rows, refusals = self._apply(items, states, gaps)
        # One contiguous chunk (a memcpy of ~40 ms per 250k rows): DuckDB then appends it as whole row groups
        # instead of scanning many small batches on parallel threads that each leave a partial row group behind
        # (measured on 2 cores: 1.2-2.1M vs 0.4-0.9M rows/s, and 37 vs 57-75 bytes/row on disk).
        table = pa.Table.from_batches(batches, schema=S.EVENT_SCHEMA).combine_chunks()
        t0 = time.perf_counter()
        try:
            aggregates, rebuilt = self._transaction_retrying(table, list(states.values()))
        except duckdb.Error as e:
            if is_storage_fault(e):
                raise StorageFault(str(e)) from e
            if len(items) > 1:
                # Find the item DuckDB refuses, commit the others: one bad batch must not cost a whole window.
                log.warning("coalesced insert of %d rows failed (%s); retrying item by item", table.num_rows, e)
                for item in items:
                    self._commit([item])
                return
            self._refuse_stored_item(items[0], e)
            return
        duration = time.perf_counter() - t0
        self._streams.update(states)
        for sid, g in gaps.items():
            if g.ranges:
                self._gaps[sid] = g
            else:
                self._gaps.pop(sid, None)
        for st in states.values():
            self._learn_block_size(st)
        self.commits += 1
        m = self._metrics
        m.insert_duration.observe(duration)
        m.ingest_rows.inc(table.num_rows)
        if duplicates:
            m.duplicate_batches.inc(duplicates)
        for r in refusals:
            m.refused_batches.labels(reason=r.reason).inc()
        if refused_rows:
            m.refused_rows.inc(refused_rows)
        now_ns = time.time_ns()
        for item in items:
            if isinstance(item, BatchReceived):
                m.ingest_lag.observe(max(0.0, (now_ns - item.info.min_ts_ns) / 1e9))
        m.record_commit(aggregates, self.block_size)
        m.observe_rebuilds(rebuilt)
        _acknowledge(items)

    def _refuse_stored_item(self, item: QueueItem, exc: duckdb.Error) -> None:
        """DuckDB refused this one item for its data (validation let it through): count it as refused."""
        if isinstance(item, BatchReceived):
            self._rlog.log(logging.ERROR, "store_failed", "insert refused for %s: %s; its %d rows are counted in "
                           "kvfabric_refused_rows_total, not stored", item_label(item), exc, item.rows)
            if item.ack is not None:
                item.ack.refused(item.info.seq)
            self._commit([BatchRefused(item.stream_id, item.info.seq, item.rows, STORE_FAILED, ack=item.ack)])
        else:
            log.error("could not record %s: %s", item_label(item), exc)

    def _transaction_retrying(
        self, table: pa.Table, states: list[StreamState]
    ) -> tuple[list[CommitAggregate], list[tuple[str | None, str | None, int | None]]]:
        """:meth:`_transaction`, run again after a lost lake commit race (counted), with jittered exponential
        backoff so racing collectors spread out; after :data:`CONFLICT_RETRIES` the error goes to the caller."""
        attempt = 0
        while True:
            try:
                return self._transaction(table, states)
            except duckdb.Error as e:
                if not (self._lake and is_commit_conflict(e)) or attempt >= CONFLICT_RETRIES:
                    raise
                self._metrics.commit_conflicts.inc()
                attempt += 1
                pause = min(CONFLICT_BACKOFF_MAX_S, CONFLICT_BACKOFF_S * 2 ** attempt)
                time.sleep(random.uniform(pause / 2, pause))

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
                    con.execute(self._insert_sql)
                    aggregates = [CommitAggregate.from_row(row) for row in con.execute(_AGG_SQL).fetchall()]
                    if any(a.event == S.BLOCK_REBUILT for a in aggregates):
                        rebuilt = con.execute(_REBUILT_SQL).fetchall()
                finally:
                    con.unregister("_kvf_ingest")
            if states:
                con.register("_kvf_streams", streams_table(states))
                try:
                    for statement in self._streams_sql:
                        params = {"ids": [s.stream_id for s in states]} if "$ids" in statement else None
                        con.execute(statement, params)
                finally:
                    con.unregister("_kvf_streams")
            con.execute("COMMIT")
        except BaseException:
            # The error to report is the one that made the transaction fail; a ROLLBACK that fails too ("no
            # transaction is active" after a failed COMMIT, "invalidated") must not replace it.
            try:
                con.execute("ROLLBACK")
            except duckdb.Error:
                pass
            raise
        return aggregates, rebuilt


def _acknowledge(items: list[QueueItem]) -> None:
    """After COMMIT: tell each protocol-2 connection the newest of its batches now accounted for."""
    newest: dict[AckChannel, int] = {}
    for item in items:
        if isinstance(item, (BatchReceived, BatchRefused)) and item.ack is not None:
            seq = item.info.seq if isinstance(item, BatchReceived) else item.seq
            if seq is not None and seq > newest.get(item.ack, -1):
                newest[item.ack] = seq
    for channel, seq in newest.items():
        channel.committed(seq)


def _copy(st: StreamState) -> StreamState:
    return StreamState(**vars(st))


def item_label(item: QueueItem) -> str:
    if isinstance(item, StreamOpened):
        return f"stream {item.meta.stream_id!r} (metadata)"
    if isinstance(item, BatchRefused):
        return f"stream {item.stream_id!r} seq {item.seq} (refused)"
    return f"stream {item.stream_id!r} seq {item.info.seq}"
