"""Retention and compaction: what keeps the store's disk bounded, on either backend. Runs in the writer thread
(:class:`~kvfabric.ingest.writer.EventWriter` ``maintenance``), so it never races this collector's own commits.

Per run, with ``cutoff = now - retain``:
  * DuckDB file: delete ``events`` older than the cutoff and ``streams`` silent since then, then CHECKPOINT, so
    the freed blocks are reused (the file stops growing; DuckDB truncates it when the free blocks are at its end);
  * lake: delete whole ``day`` partitions before the cutoff's day first (DuckLake drops whole data files without
    writing delete files), then the rest of the rows before the cutoff; flush rows inlined in the catalog into
    Parquet, merge small adjacent files, expire snapshots older than ``snapshot_keep_s`` and remove the files no
    snapshot needs any more (plus files of commits that lost a race and were never referenced). ``streams`` is a
    view there (:mod:`kvfabric.ingest.backend`): a silent stream's rows are deleted from ``stream_log``, and so are
    the rows a newer row of the same stream superseded (every commit appends one per stream it advanced).

``snapshot_keep_s`` defaults to :data:`SNAPSHOT_KEEP_S` (1 h), but never more than ``retain_s``: the files of
expired rows stay on disk until the snapshots that reference them expire, so a keep longer than the retention
would hold ``retain + 1 h`` of data on disk (with ``--retain 60s``, 60 times what was asked for).

Orphaned files (written by a commit that lost a race, or by one still in flight in another collector) are only
removed after :data:`ORPHAN_KEEP_S` whatever the snapshot keep: a short ``--retain`` must not make another
collector's slow commit lose the files it is about to reference.

``retain_s`` 0 keeps every row (compaction still runs on a lake). Several collectors sharing a lake each run this;
a lost commit race only postpones that step to the next run (the later steps still run).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import duckdb

from kvfabric.ingest.backend import NS_PER_DAY, STREAM_LOG, SUPERSEDED_STREAM_ROWS_DELETE
from kvfabric.lake import LAKE_ALIAS, is_commit_conflict

log = logging.getLogger("kvfabric.ingest.retention")

SNAPSHOT_KEEP_S = 3600.0
"""Lake snapshots (and the files only they reference) outlive their replacement this long, so a query that
started on an older snapshot, or a reader that attached before, still finds its files."""

ORPHAN_KEEP_S = 3600.0
"""Files no snapshot references are deleted only once this old: they may belong to a commit still in flight."""


@dataclass
class RetentionReport:
    deleted_events: int = 0
    deleted_streams: int = 0
    seconds: float = 0.0
    conflicts: int = 0  # lake maintenance steps that lost a commit race (retried at the next run)


class Retention:
    """The writer's ``maintenance`` callable for one backend (see module docstring)."""

    def __init__(self, *, lake: bool, retain_s: float, snapshot_keep_s: float | None = None,
                 clock: Callable[[], float] = time.time,
                 on_report: Callable[[RetentionReport], None] | None = None) -> None:
        self.lake = lake
        self.retain_s = retain_s
        if snapshot_keep_s is None:
            snapshot_keep_s = min(SNAPSHOT_KEEP_S, retain_s) if retain_s > 0 else SNAPSHOT_KEEP_S
        self.snapshot_keep_s = snapshot_keep_s
        self._clock = clock
        self._on_report = on_report
        self.runs = 0

    def __call__(self, con: duckdb.DuckDBPyConnection) -> RetentionReport:
        t0 = time.perf_counter()
        report = RetentionReport()
        if self.retain_s > 0:
            cutoff_ns = int((self._clock() - self.retain_s) * 1e9)
            report.deleted_events = self._expire_events(con, cutoff_ns)
            report.deleted_streams = self._expire_streams(con, cutoff_ns)
        if self.lake:
            report.conflicts = self._compact(con)
        else:
            con.execute("CHECKPOINT")
        report.seconds = time.perf_counter() - t0
        self.runs += 1
        if report.deleted_events or report.deleted_streams:
            log.info("retention: deleted %d events and %d idle streams older than %.0f s in %.2f s",
                     report.deleted_events, report.deleted_streams, self.retain_s, report.seconds)
        if self._on_report is not None:
            self._on_report(report)
        return report

    def _expire_events(self, con: duckdb.DuckDBPyConnection, cutoff_ns: int) -> int:
        deleted = 0
        if self.lake:  # whole days first: DuckLake drops their files instead of writing delete files
            cutoff_day = cutoff_ns // NS_PER_DAY
            deleted += _count_changes(
                con, "DELETE FROM events WHERE day < DATE '1970-01-01' + ?::INTEGER", [cutoff_day])
        deleted += _count_changes(con, "DELETE FROM events WHERE ts_ns < ?", [cutoff_ns])
        return deleted

    def _expire_streams(self, con: duckdb.DuckDBPyConnection, cutoff_ns: int) -> int:
        if not self.lake:
            return _count_changes(con, "DELETE FROM streams WHERE last_seen_ns < ?", [cutoff_ns])
        # A lake's streams is a view of stream_log's newest row per stream: delete every row of the streams whose
        # newest row is older than the cutoff (a collector appending a newer one meanwhile makes this commit fail,
        # so a stream that came back is never lost), then the rows superseded by a newer one.
        con.execute("BEGIN")
        try:
            silent = con.execute("SELECT count(*) FROM streams WHERE last_seen_ns < ?", [cutoff_ns]).fetchone()
            con.execute(f"DELETE FROM {STREAM_LOG} WHERE stream_id IN "
                        "(SELECT stream_id FROM streams WHERE last_seen_ns < ?)", [cutoff_ns])
            con.execute("COMMIT")
        except BaseException:
            try:
                con.execute("ROLLBACK")
            except duckdb.Error:
                pass  # a failed COMMIT has already rolled back
            raise
        con.execute(SUPERSEDED_STREAM_ROWS_DELETE)
        return int(silent[0]) if silent else 0

    def _compact(self, con: duckdb.DuckDBPyConnection) -> int:
        """The lake's compaction steps; returns how many lost a commit race (each is retried at the next run)."""
        keep = f"now() - to_microseconds({int(self.snapshot_keep_s * 1e6)})"
        orphans = f"now() - to_microseconds({int(max(self.snapshot_keep_s, ORPHAN_KEEP_S) * 1e6)})"
        conflicts = 0
        for statement in (
            f"SELECT count(*) FROM ducklake_flush_inlined_data('{LAKE_ALIAS}')",
            f"SELECT count(*) FROM ducklake_merge_adjacent_files('{LAKE_ALIAS}')",
            f"SELECT count(*) FROM ducklake_expire_snapshots('{LAKE_ALIAS}', older_than => {keep})",
            f"SELECT count(*) FROM ducklake_cleanup_old_files('{LAKE_ALIAS}', older_than => {keep})",
            f"SELECT count(*) FROM ducklake_delete_orphaned_files('{LAKE_ALIAS}', older_than => {orphans})",
        ):
            try:
                con.execute(statement).fetchall()
            except duckdb.Error as e:
                if not is_commit_conflict(e):
                    raise
                conflicts += 1  # another collector committed first: this step waits for the next run
        return conflicts


def _count_changes(con: duckdb.DuckDBPyConnection, sql: str, params: list[object]) -> int:
    row = con.execute(sql, params).fetchone()
    return int(row[0]) if row else 0
