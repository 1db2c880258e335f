"""Retention and compaction: what keeps the store's disk bounded, on either backend. Runs in the writer thread
(:class:`~kvfabric.ingest.writer.EventWriter` ``maintenance``), so it never races this collector's own commits.

Per run, with ``cutoff = now - retain``:
  * DuckDB file: delete ``events`` older than the cutoff and ``streams`` silent since then, then CHECKPOINT, so
    the freed blocks are reused (the file stops growing; DuckDB truncates it when the free blocks are at its end);
  * lake: delete whole ``day`` partitions before the cutoff's day first (DuckLake drops whole data files without
    writing delete files), then the rest of the rows before the cutoff; flush rows inlined in the catalog into
    Parquet, merge small adjacent files, expire snapshots older than ``snapshot_keep_s`` and remove the files no
    snapshot needs any more (plus files of commits that lost a race and were never referenced).

``retain_s`` 0 keeps every row (compaction still runs on a lake). Several collectors sharing a lake each run this;
a lost commit race only postpones the step to the next run.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import duckdb

from kvfabric.ingest.backend import NS_PER_DAY
from kvfabric.lake import LAKE_ALIAS

log = logging.getLogger("kvfabric.ingest.retention")

SNAPSHOT_KEEP_S = 3600.0
"""Lake snapshots (and the files only they reference) outlive their replacement this long, so a query that
started on an older snapshot, or a reader that attached before, still finds its files."""


@dataclass
class RetentionReport:
    deleted_events: int = 0
    deleted_streams: int = 0
    seconds: float = 0.0


class Retention:
    """The writer's ``maintenance`` callable for one backend (see module docstring)."""

    def __init__(self, *, lake: bool, retain_s: float, snapshot_keep_s: float = SNAPSHOT_KEEP_S,
                 clock: Callable[[], float] = time.time,
                 on_report: Callable[[RetentionReport], None] | None = None) -> None:
        self.lake = lake
        self.retain_s = retain_s
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
            report.deleted_streams = _count_changes(
                con, "DELETE FROM streams WHERE last_seen_ns < ?", [cutoff_ns])
        if self.lake:
            self._compact(con)
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

    def _compact(self, con: duckdb.DuckDBPyConnection) -> None:
        keep = f"now() - to_microseconds({int(self.snapshot_keep_s * 1e6)})"
        for statement in (
            f"SELECT count(*) FROM ducklake_flush_inlined_data('{LAKE_ALIAS}')",
            f"SELECT count(*) FROM ducklake_merge_adjacent_files('{LAKE_ALIAS}')",
            f"SELECT count(*) FROM ducklake_expire_snapshots('{LAKE_ALIAS}', older_than => {keep})",
            f"SELECT count(*) FROM ducklake_cleanup_old_files('{LAKE_ALIAS}', older_than => {keep})",
            f"SELECT count(*) FROM ducklake_delete_orphaned_files('{LAKE_ALIAS}', older_than => {keep})",
        ):
            con.execute(statement).fetchall()


def _count_changes(con: duckdb.DuckDBPyConnection, sql: str, params: list[object]) -> int:
    row = con.execute(sql, params).fetchone()
    return int(row[0]) if row else 0
