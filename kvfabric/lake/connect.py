"""Connections to a lake: an in-memory DuckDB with the extensions loaded, the S3 secret made, the lake attached
and made the default database, so every statement the file backend runs reads the same tables unqualified."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import duckdb

from kvfabric.lake.extensions import load_extensions
from kvfabric.lake.location import LAKE_ALIAS, LakeLocation, s3_secret_sql


class LakeUnavailable(RuntimeError):
    """The lake could not be attached (catalog unreachable, data path refused, extension missing)."""


def connect_lake(location: LakeLocation, *, read_only: bool = False,
                 memory_limit: str | None = None) -> duckdb.DuckDBPyConnection:
    """A connection whose default database is the lake. Raises :class:`LakeUnavailable` with one line saying
    which part failed; a :class:`~kvfabric.lake.extensions.MissingExtension` passes through as it is."""
    con = duckdb.connect()
    try:
        # An in-memory database spills to ./.tmp by default: collectors started in one folder would share (and
        # remove each other's) spill files. Each connection gets a folder of its own, removed at exit.
        spill = tempfile.mkdtemp(prefix="kvfabric-spill-")
        atexit.register(shutil.rmtree, spill, True)
        con.execute(f"SET temp_directory = '{spill}'")
        if memory_limit:
            con.execute(f"SET memory_limit = '{memory_limit.replace(chr(39), '')}'")
        load_extensions(con, location.extensions())
        if location.remote_data:
            secret = s3_secret_sql(os.environ)
            if secret is not None:
                con.execute(secret)
        else:
            os.makedirs(location.data, exist_ok=True)
        try:
            con.execute(location.attach_sql(read_only=read_only))
        except duckdb.Error as e:
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise LakeUnavailable(f"cannot attach the {location.describe()}: {first}") from e
        con.execute(f"USE {LAKE_ALIAS}")
    except BaseException:
        con.close()
        raise
    return con


def use_lake(con: duckdb.DuckDBPyConnection) -> duckdb.DuckDBPyConnection:
    """A cursor of a lake connection reads its tables unqualified too (``USE`` is per connection)."""
    con.execute(f"USE {LAKE_ALIAS}")
    return con


def is_commit_conflict(exc: BaseException) -> bool:
    """Another writer committed first (DuckLake's snapshot race or a conflicting change): retry the transaction."""
    text = str(exc)
    return isinstance(exc, duckdb.TransactionException) and (
        "DuckLake" in text or "conflict" in text.lower() or "retry count" in text
    )
