"""Where a command reads: a DuckDB file no collector holds (``--db``) or a lake (``--lake CATALOG --data PATH``),
which any number of readers may query while collectors write it. Every read-only command takes the same three
flags through :func:`add_source_arguments` and builds its runner with :func:`runner_from_args`."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import duckdb

from kvfabric.lake import LakeLocation, LakeUnavailable, MissingExtension, connect_lake
from kvfabric.queries.runner import DatabaseUnavailable, QueryRunner, connect_read_only
from kvfabric.usage import UsageError


def add_source_arguments(parser: argparse.ArgumentParser, *, db_default: str = "kvfabric.duckdb") -> None:
    parser.add_argument("--db", default=db_default, help="DuckDB file no collector holds (default: %(default)s)")
    parser.add_argument("--lake", default=None, metavar="CATALOG",
                        help="read a lake instead of --db: its DuckLake catalog, as `kvfabric collector --lake` "
                        "takes it (needs --data)")
    parser.add_argument("--data", default=None, metavar="PATH", help="the lake's data path (folder or s3://...)")


def lake_from_args(args: argparse.Namespace) -> LakeLocation | None:
    """The lake the flags name, or None for ``--db``. Raises UsageError naming the flag at fault."""
    lake, data = getattr(args, "lake", None), getattr(args, "data", None)
    if lake is None and data is None:
        return None
    if lake is None or data is None:
        raise UsageError("--lake and --data go together: the catalog and where its Parquet files live")
    try:
        return LakeLocation.parse(lake, data)
    except ValueError as e:
        raise UsageError(str(e)) from None


def connector(db_path: str, lake: LakeLocation | None) -> Callable[[], duckdb.DuckDBPyConnection]:
    """A function returning a new read-only connection to the file or the lake."""
    if lake is None:
        return lambda: connect_read_only(db_path)

    def connect() -> duckdb.DuckDBPyConnection:
        try:
            return connect_lake(lake, read_only=True)
        except (LakeUnavailable, MissingExtension) as e:
            raise DatabaseUnavailable(str(e)) from e

    return connect


def runner_from_args(args: argparse.Namespace) -> QueryRunner:
    return QueryRunner(connector(args.db, lake_from_args(args)))


def source_label(args: argparse.Namespace) -> str:
    """The flag a "cannot read" message names."""
    lake = lake_from_args(args)
    return f"--db {args.db}" if lake is None else f"--lake ({lake.describe()})"
