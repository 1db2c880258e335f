"""Where the collector's tables live: one DuckDB file (the embedded default) or a lake (DuckLake: catalog in
PostgreSQL or a local file, data as Parquet in a folder or on S3). Everything above this module (writer, queries,
REST) runs the same SQL on either: a lake connection has the lake as its default database.

Lake tables are the file's tables with two differences:
  * ``events`` has a ``day`` column (UTC date of ``ts_ns``) that, with ``run_id`` and ``engine``, partitions the
    data files, so a query for one run, engine or day reads only its files;
  * ``streams`` is a view of the newest row per stream id of ``stream_log``, to which every commit *appends* the
    rows of the streams it advanced. DuckLake makes a transaction that deletes from a table fail when another
    committed an insert into it meanwhile, so the file's DELETE + INSERT would make collectors sharing a lake
    conflict on every commit; appends never conflict. Maintenance deletes the superseded rows.
"""

from __future__ import annotations

import logging
import os
import random
import time
from dataclasses import dataclass

import duckdb

from kvfabric.contract import schema as S
from kvfabric.ingest.store import GENERATION_SQL, _prepare, db_size_bytes, open_database, quote
from kvfabric.lake import LakeLocation, connect_lake, is_commit_conflict, use_lake

log = logging.getLogger("kvfabric.ingest.backend")

NS_PER_DAY = 86_400_000_000_000
DAY_SQL = f"(DATE '1970-01-01' + (ts_ns // {NS_PER_DAY})::INTEGER)"
"""The lake's ``day`` partition column, computed from ``ts_ns`` at insert (UTC)."""
LAKE_PARTITIONS = ("run_id", "engine", "day")
_COLS = ", ".join(quote(c) for c in S.COLUMNS)
FILE_INSERT_SQL = f"INSERT INTO events ({_COLS}) SELECT {_COLS} FROM _kvf_ingest"
LAKE_INSERT_SQL = f"INSERT INTO events ({_COLS}, day) SELECT {_COLS}, {DAY_SQL} FROM _kvf_ingest"
_PREPARE_ATTEMPTS = 8
STREAM_LOG = "stream_log"
NEWEST_STREAM_ROWS = (f"SELECT * FROM {STREAM_LOG} "
                      f"QUALIFY row_number() OVER (PARTITION BY stream_id ORDER BY {GENERATION_SQL} DESC, "
                      "last_seen_ns DESC) = 1")
STREAMS_VIEW_DDL = f"CREATE VIEW IF NOT EXISTS streams AS {NEWEST_STREAM_ROWS}"
SUPERSEDED_STREAM_ROWS_DELETE = (
    f"DELETE FROM {STREAM_LOG} WHERE rowid IN (SELECT rowid FROM {STREAM_LOG} "
    f"QUALIFY row_number() OVER (PARTITION BY stream_id ORDER BY {GENERATION_SQL} DESC, last_seen_ns DESC) > 1)"
)


@dataclass(frozen=True)
class Backend:
    """``lake`` None: the DuckDB file ``db_path``. Otherwise the lake (``db_path`` unused)."""

    db_path: str
    lake: LakeLocation | None = None

    @property
    def is_lake(self) -> bool:
        return self.lake is not None

    @property
    def streams_sql(self) -> tuple[str, ...]:
        """The writer's statements recording the registered Arrow table ``_kvf_streams`` (its states, one row each),
        with the parameter ``$ids`` (their stream ids) where needed."""
        if self.is_lake:
            return (f"INSERT INTO {STREAM_LOG} SELECT * FROM _kvf_streams",)
        return ("DELETE FROM streams WHERE stream_id IN (SELECT unnest($ids::VARCHAR[]))",
                "INSERT INTO streams SELECT * FROM _kvf_streams")

    @property
    def insert_sql(self) -> str:
        """The writer's INSERT of the registered Arrow table ``_kvf_ingest``."""
        return LAKE_INSERT_SQL if self.is_lake else FILE_INSERT_SQL

    def describe(self) -> str:
        return self.lake.describe() if self.lake is not None else f"db {self.db_path}"

    def open(self, *, checkpoint_threshold: str | None = None,
             memory_limit: str | None = None) -> duckdb.DuckDBPyConnection:
        """The read-write connection, tables ensured (created, upgraded, partitioned)."""
        if self.lake is None:
            return open_database(self.db_path, checkpoint_threshold, memory_limit)
        con = connect_lake(self.lake, memory_limit=memory_limit)
        try:
            prepare_lake(con, self.lake)
        except BaseException:
            con.close()
            raise
        return con

    def open_read_only(self, *, memory_limit: str | None = None) -> duckdb.DuckDBPyConnection:
        """A lake attached read-only (``--read-only`` collectors, ``kvfabric query --lake``); files: see
        :func:`kvfabric.queries.connect_read_only`."""
        if self.lake is None:
            raise ValueError("open_read_only is for lakes; files use kvfabric.queries.connect_read_only")
        return connect_lake(self.lake, read_only=True, memory_limit=memory_limit)

    def cursor(self, parent: duckdb.DuckDBPyConnection) -> duckdb.DuckDBPyConnection:
        """A new connection to ``parent``'s database instance that reads the same tables."""
        cur = parent.cursor()
        return use_lake(cur) if self.is_lake else cur

    def size_bytes(self) -> int:
        """Bytes on local disk: the file and its WAL, or a local lake's data folder (0 for object storage)."""
        if self.lake is None:
            return db_size_bytes(self.db_path)
        if self.lake.remote_data:
            return 0
        return folder_bytes(self.lake.data)


def folder_bytes(path: str) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return total


def prepare_lake(con: duckdb.DuckDBPyConnection, location: LakeLocation) -> None:
    """Create or upgrade the lake's tables and set ``events``' partitioning. Idempotent; collectors starting at
    once on a new lake race here, so a lost commit race is retried (each statement commits on its own)."""
    for attempt in range(_PREPARE_ATTEMPTS):
        try:
            _prepare(con, location.describe(), None, None, streams_table=STREAM_LOG)
            con.execute(STREAMS_VIEW_DDL)
            con.execute("ALTER TABLE events ADD COLUMN IF NOT EXISTS day DATE")
            if not _partitioned(con):
                con.execute(f"ALTER TABLE events SET PARTITIONED BY ({', '.join(LAKE_PARTITIONS)})")
            return
        except duckdb.Error as e:
            if not is_commit_conflict(e) or attempt == _PREPARE_ATTEMPTS - 1:
                raise
            time.sleep(random.uniform(0.05, 0.2) * 2 ** attempt)


def _partitioned(con: duckdb.DuckDBPyConnection) -> bool:
    """Whether ``events`` already has a partition key (the catalog's own tables say)."""
    try:
        row = con.execute(
            "SELECT count(*) FROM __ducklake_metadata_lake.ducklake_partition_info p "
            "JOIN __ducklake_metadata_lake.ducklake_table t USING (table_id) "
            "WHERE t.table_name = 'events' AND t.end_snapshot IS NULL AND p.end_snapshot IS NULL"
        ).fetchone()
    except duckdb.Error:
        return False
    return bool(row and row[0])
