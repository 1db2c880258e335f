"""The DuckDB file: table definitions, opening, and the stream state a restarted collector resumes from.

Tables (created if missing, never altered):

``events``
    One row per event, columns = :data:`kvfabric.contract.schema.COLUMNS` with the schema's types; append-only (nothing
    ever deletes or updates a row, which keeps ``rowid`` a stable tie-breaker for keyset pagination).
``streams``
    One row per stream id: its metadata (``source``: ``plugin`` or ``kv_events``) and ingest accounting (batches,
    rows, last_seq, gaps, duplicates, refused batches and rows). Rewritten by the writer in the same transaction as
    the events it accounts for, so after any crash or restart ``last_seq`` and ``rows`` describe exactly the
    committed events, and gap detection and deduplication resume from there. Columns added after the first release
    are appended (ALTER TABLE ... ADD COLUMN IF NOT EXISTS on open; ``source`` with its default ``plugin``), so
    older files keep working.
``kvfabric_meta``
    Key/value facts about the file (schema version), checked on open; an older file is upgraded in place by the
    additive steps of :data:`MIGRATIONS` (columns appended, nothing rewritten), a newer or unknown one refused.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

import duckdb
import pyarrow as pa

from kvfabric.contract import schema as S

_DUCKDB_TYPES: dict[pa.DataType, str] = {
    pa.int64(): "BIGINT",
    pa.int32(): "INTEGER",
    pa.string(): "VARCHAR",
    pa.float64(): "DOUBLE",
    pa.bool_(): "BOOLEAN",
}


def quote(name: str) -> str:
    """A SQL identifier (column names such as ``count`` are keywords)."""
    return '"' + name.replace('"', '""') + '"'


def events_ddl() -> str:
    """CREATE TABLE for ``events``, derived from EVENT_SCHEMA so the two cannot drift."""
    cols = []
    for f in S.EVENT_SCHEMA:
        not_null = "" if f.nullable else " NOT NULL"
        cols.append(f"{quote(f.name)} {_DUCKDB_TYPES[f.type]}{not_null}")
    return "CREATE TABLE IF NOT EXISTS events (" + ", ".join(cols) + ")"


@dataclass
class StreamState:
    """One ``streams`` row. ``last_seq`` is -1 before the first batch; ``gaps`` counts batches never received."""

    stream_id: str
    run_id: str
    engine: str
    vllm_version: str | None
    block_size: int
    num_blocks: int
    policy: str
    settings: str | None
    schema_version: int
    peer: str
    first_seen_ns: int
    last_seen_ns: int
    connections: int = 0
    batches: int = 0
    rows: int = 0
    last_seq: int = -1
    gaps: int = 0
    seq_resets: int = 0
    first_ts_ns: int | None = None
    last_ts_ns: int | None = None
    duplicates: int = 0  # batches received again after they were committed (not stored twice)
    refused_batches: int = 0  # batches refused for their content (counted, not stored)
    refused_rows: int = 0
    host: str | None = None  # metadata kvfabric.host (absent from older hooks)
    dp_rank: int | None = None  # metadata kvfabric.dp_rank (absent from older hooks)
    source: str = S.SOURCE_PLUGIN  # metadata kvfabric.source: plugin (the hook) or kv_events (vLLM's KV events)


STREAMS_SCHEMA = pa.schema(
    [
        ("stream_id", pa.string()),
        ("run_id", pa.string()),
        ("engine", pa.string()),
        ("vllm_version", pa.string()),
        ("block_size", pa.int32()),
        ("num_blocks", pa.int64()),
        ("policy", pa.string()),
        ("settings", pa.string()),
        ("schema_version", pa.int32()),
        ("peer", pa.string()),
        ("first_seen_ns", pa.int64()),
        ("last_seen_ns", pa.int64()),
        ("connections", pa.int64()),
        ("batches", pa.int64()),
        ("rows", pa.int64()),
        ("last_seq", pa.int64()),
        ("gaps", pa.int64()),
        ("seq_resets", pa.int64()),
        ("first_ts_ns", pa.int64()),
        ("last_ts_ns", pa.int64()),
        ("duplicates", pa.int64()),
        ("refused_batches", pa.int64()),
        ("refused_rows", pa.int64()),
        ("host", pa.string()),
        ("dp_rank", pa.int32()),
        ("source", pa.string()),
    ]
)
_ADDED_STREAM_COLUMNS = ("duplicates", "refused_batches", "refused_rows")  # absent from files of the first release
_ADDED_STREAM_METADATA = ("host", "dp_rank")  # absent from files before schema 3 (null there: not known)
# Added with the KV-event source: every stream of an older file came from the plugin, so they get that value.
_ADDED_STREAM_DEFAULTS = (("source", S.SOURCE_PLUGIN),)
assert [f.name for f in STREAMS_SCHEMA] == [f.name for f in fields(StreamState)]


def streams_ddl(table: str = "streams") -> str:
    cols = ", ".join(f"{quote(f.name)} {_DUCKDB_TYPES[f.type]}" for f in STREAMS_SCHEMA)
    return f"CREATE TABLE IF NOT EXISTS {table} ({cols})"


GENERATION_SQL = "connections + batches + duplicates + refused_batches"
"""A stream's state advances this number on every change (a connection, a batch stored, a duplicate or a refusal
recognised), so among rows of one stream the highest is the newest (an append-only log's ``streams``)."""


class IncompatibleDatabase(RuntimeError):
    """The file was written by a collector of another schema version."""


# Additive upgrades of an older file, keyed by the version they upgrade *from* (to that version + 1). Columns are
# only ever appended, so an upgraded ``events`` has exactly the column order a new file gets.
MIGRATIONS: dict[int, tuple[str, ...]] = {
    1: ('ALTER TABLE events ADD COLUMN IF NOT EXISTS "reason" VARCHAR',),  # schema 2: block_evicted.reason
    2: tuple(  # schema 3: where an event comes from and whose it is
        f"ALTER TABLE events ADD COLUMN IF NOT EXISTS {quote(name)} {_DUCKDB_TYPES[S.EVENT_SCHEMA.field(name).type]}"
        for name in ("host", "dp_rank", "tenant", "lora")
    ),
}


def _migrate(con: duckdb.DuckDBPyConnection, path: str, found: str) -> None:
    """Upgrade a file of schema version ``found`` to :data:`kvfabric.contract.schema.SCHEMA_VERSION` in one
    transaction."""
    try:
        version = int(found)
    except ValueError:
        version = -1
    steps = []
    while 0 < version < S.SCHEMA_VERSION and version in MIGRATIONS:
        steps.extend(MIGRATIONS[version])
        version += 1
    if version != S.SCHEMA_VERSION:
        con.close()
        raise IncompatibleDatabase(
            f"{path} holds schema version {found}, this collector writes {S.SCHEMA_VERSION}; use a new file"
        )
    con.execute("BEGIN TRANSACTION")
    try:
        con.execute(events_ddl())  # a v1 file always has it; this keeps the ALTERs valid on any file
        for statement in steps:
            con.execute(statement)
        con.execute("UPDATE kvfabric_meta SET value = ? WHERE key = 'schema_version'", [str(S.SCHEMA_VERSION)])
        con.execute("COMMIT")
    except BaseException:
        con.execute("ROLLBACK")
        con.close()
        raise


def open_database(path: str, checkpoint_threshold: str | None = None,
                  memory_limit: str | None = None) -> duckdb.DuckDBPyConnection:
    """Open (creating if needed) the collector's database read-write and ensure its tables.

    DuckDB lets one process open a file read-write; a second collector (or ``kvfabric query``) on the same file
    fails here with DuckDB's lock error, which names the holding process. ``checkpoint_threshold`` (a DuckDB size
    such as ``"16MB"``, its default) is the WAL size at which a commit also checkpoints into the file;
    ``memory_limit`` (e.g. ``"256MB"``) bounds DuckDB's memory, its cache of the file included.
    """
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    con = duckdb.connect(path)
    try:
        _prepare(con, path, checkpoint_threshold, memory_limit)
    except BaseException:
        con.close()
        raise
    return con


def _prepare(con: duckdb.DuckDBPyConnection, path: str, checkpoint_threshold: str | None,
             memory_limit: str | None = None, streams_table: str = "streams") -> None:
    """Create or upgrade the tables; ``streams_table``: where the ``streams`` rows are kept (a lake keeps them in
    the append-only ``stream_log`` under a ``streams`` view, see :mod:`kvfabric.ingest.backend`)."""
    if memory_limit:
        con.execute(f"SET memory_limit = '{memory_limit.replace(chr(39), '')}'")
    if checkpoint_threshold:
        con.execute(f"SET checkpoint_threshold = '{checkpoint_threshold.replace(chr(39), '')}'")
    con.execute("CREATE TABLE IF NOT EXISTS kvfabric_meta (key VARCHAR, value VARCHAR)")
    row = con.execute("SELECT value FROM kvfabric_meta WHERE key = 'schema_version'").fetchone()
    if row is None:
        con.execute("INSERT INTO kvfabric_meta VALUES ('schema_version', ?)", [str(S.SCHEMA_VERSION)])
    elif row[0] != str(S.SCHEMA_VERSION):
        _migrate(con, path, row[0])
    con.execute(events_ddl())
    con.execute(streams_ddl(streams_table))
    for name in _ADDED_STREAM_COLUMNS:
        con.execute(f"ALTER TABLE {streams_table} ADD COLUMN IF NOT EXISTS {quote(name)} BIGINT DEFAULT 0")
    for name in _ADDED_STREAM_METADATA:
        kind = _DUCKDB_TYPES[STREAMS_SCHEMA.field(name).type]
        con.execute(f"ALTER TABLE {streams_table} ADD COLUMN IF NOT EXISTS {quote(name)} {kind}")
    for name, default in _ADDED_STREAM_DEFAULTS:
        kind = _DUCKDB_TYPES[STREAMS_SCHEMA.field(name).type]
        con.execute(f"ALTER TABLE {streams_table} ADD COLUMN IF NOT EXISTS {quote(name)} {kind} "
                    f"DEFAULT '{default}'")


def load_streams(con: duckdb.DuckDBPyConnection) -> dict[str, StreamState]:
    """The committed state of every known stream, to resume sequence checks after a restart."""
    table = con.sql("SELECT * FROM streams").to_arrow_table()
    return {row["stream_id"]: StreamState(**row) for row in table.to_pylist()}


def streams_table(states: list[StreamState]) -> pa.Table:
    """Arrow table of ``states`` in ``streams`` column order (for one DELETE + INSERT per commit)."""
    return pa.Table.from_pylist([vars(s) for s in states], schema=STREAMS_SCHEMA)


def db_size_bytes(path: str) -> int:
    """Bytes of the database file plus its write-ahead log (0 for what does not exist)."""
    total = 0
    for p in (path, path + ".wal"):
        try:
            total += os.path.getsize(p)
        except OSError:
            pass
    return total
