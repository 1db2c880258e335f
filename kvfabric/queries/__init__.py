"""Named analytics over the collector's DuckDB tables, shared by the REST API, the CLI and reports.

SQL lives in ``sql/*.sql`` (one statement per file, parameters documented in its header); :class:`QueryRunner`
binds parameters, bounds rows and time, and returns JSON-ready dicts.
"""

from kvfabric.queries.params import BadParameter, Cursor, parse_block_hash
from kvfabric.queries.runner import (
    MAX_LIMIT,
    QUERY_NAMES,
    DatabaseUnavailable,
    NotFound,
    QueryRunner,
    QueryTimeout,
    UnknownRun,
    connect_read_only,
)

__all__ = [
    "MAX_LIMIT",
    "QUERY_NAMES",
    "BadParameter",
    "Cursor",
    "DatabaseUnavailable",
    "NotFound",
    "QueryRunner",
    "QueryTimeout",
    "UnknownRun",
    "connect_read_only",
    "parse_block_hash",
]
