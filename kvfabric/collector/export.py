"""Parquet export of a collector database: the hand-off to fleet-scale SQL engines (docs/design.md §1).
(``--format mooncake`` writes one run's traffic as a replayable trace instead: :mod:`kvfabric.collector.mooncake`.)

Layout (hive partitioning, so DuckDB, Spark, Trino and ClickHouse prune by run)::

    OUT/events/run_id=<run>/data_0.parquet        (with partition_by_date: run_id=<run>/date=YYYY-MM-DD/...)
    OUT/streams/streams.parquet

Read back with ``read_parquet('OUT/events/**/*.parquet', hive_partitioning=true)``. Partition values are
URL-escaped in directory names and restored on read; pass ``hive_types={'run_id': 'VARCHAR'}`` if run ids look
like numbers, or DuckDB will autocast them. The export opens the database read-only, so it works only while no
collector runs on that file (DuckDB's lock); against a live collector use its REST API or copy the file first.
"""

from __future__ import annotations

import argparse
import glob
import os

import duckdb

from kvfabric.argtypes import positive_int
from kvfabric.collector.mooncake import run_mooncake_export
from kvfabric.lake import LakeLocation
from kvfabric.queries import DatabaseUnavailable, UnknownRun
from kvfabric.queries.sources import add_source_arguments, connector, lake_from_args, source_label
from kvfabric.usage import UsageError, unwritable


def _literal(path: str) -> str:
    return "'" + path.replace("'", "''") + "'"


def export_parquet(db_path: str, out_dir: str, *, partition_by_date: bool = False, run: str | None = None,
                   engine: str | None = None, lake: LakeLocation | None = None) -> dict[str, object]:
    """Write ``events`` (partitioned by run, optionally by UTC date) and ``streams`` under ``out_dir``: every run,
    or only ``run`` and/or only ``engine``'s rows when given.

    Replaces ``out_dir/events`` and ``out_dir/streams`` if they exist (nothing else in ``out_dir`` is touched): they
    then hold exactly the rows selected. Returns counts and paths: ``events_rows``, ``streams_rows``, ``runs`` (rows
    per run), ``files``, ``events_glob``, ``streams_path``, ``out_dir``. Raises DatabaseUnavailable, UnknownRun (a
    ``run`` no stream ever named), OSError (``out_dir`` cannot be created), duckdb.IOException (cannot be written).
    """
    events_dir = os.path.join(out_dir, "events")
    streams_dir = os.path.join(out_dir, "streams")
    streams_path = os.path.join(streams_dir, "streams.parquet")
    con = connector(db_path, lake)()
    columns = "* EXCLUDE (day)" if lake is not None else "*"  # the lake's partition column is not an event column
    try:
        if run is not None and not con.execute("SELECT count(*) FROM streams WHERE run_id = $run",
                                               {"run": run}).fetchone()[0]:
            raise UnknownRun(run)
        where = "WHERE ($run IS NULL OR run_id = $run) AND ($engine IS NULL OR engine = $engine)"
        params = {"run": run, "engine": engine}
        runs = {r: n for r, n in con.execute(f"SELECT run_id, count(*) FROM events {where} GROUP BY run_id",
                                             params).fetchall()}
        os.makedirs(streams_dir, exist_ok=True)
        if partition_by_date:
            date = "strftime(make_timestamp(ts_ns // 1000), '%Y-%m-%d') AS date"
            select = f"SELECT {columns}, {date} FROM events {where}"
            partition = "run_id, date"
        else:
            select, partition = f"SELECT {columns} FROM events {where}", "run_id"
        con.execute(
            f"COPY ({select}) TO {_literal(events_dir)} "
            f"(FORMAT parquet, COMPRESSION zstd, PARTITION_BY ({partition}), OVERWRITE)", params
        )
        con.execute(f"COPY (SELECT * FROM streams {where}) TO {_literal(streams_path)} "
                    "(FORMAT parquet, COMPRESSION zstd)", params)
        streams_rows = con.execute(f"SELECT count(*) FROM streams {where}", params).fetchone()
    finally:
        con.close()
    files = sorted(glob.glob(os.path.join(events_dir, "**", "*.parquet"), recursive=True))
    return {
        "out_dir": out_dir,
        "events_rows": sum(runs.values()),
        "streams_rows": streams_rows[0] if streams_rows else 0,
        "runs": runs,
        "files": len(files),
        "events_glob": os.path.join(events_dir, "**", "*.parquet"),
        "streams_path": streams_path,
    }


def configure(parser: argparse.ArgumentParser) -> None:
    """``kvfabric export --db PATH --out DIR`` (Parquet) or ``--format mooncake --run R --out FILE``."""
    add_source_arguments(parser)
    parser.add_argument("--format", choices=("parquet", "mooncake"), default="parquet",
                        help="parquet: every event, hive-partitioned (default); mooncake: one run's traffic as a "
                             "hash_ids JSONL trace that `kvfabric replay` reads (no token ids, hashes renumbered)")
    parser.add_argument("--out", required=True,
                        help="parquet: output directory (its events/ and streams/ are replaced); mooncake: file")
    parser.add_argument("--by-date", action="store_true", help="parquet: also partition events by UTC date")
    parser.add_argument("--run", default=None,
                        help="the run to export (mooncake: required; parquet: only this run, default every run)")
    parser.add_argument("--engine", default=None, help="only this engine's events (mooncake: its admissions; "
                                                       "default: every engine)")
    parser.add_argument("--block-tokens", type=positive_int, default=None,
                        help="mooncake: tokens per hash id, a multiple of the run's block size (default 512, the "
                             "Mooncake traces' and `kvfabric replay`'s; the run's block size keeps sharing exact)")


def run(args: argparse.Namespace) -> int:
    if args.format == "mooncake":
        if args.by_date:
            raise UsageError("--by-date goes with --format parquet (a mooncake trace is one file, not partitioned)")
        return run_mooncake_export(args)
    if args.block_tokens is not None:
        raise UsageError("--block-tokens goes with --format mooncake (a Parquet export keeps every event as stored)")
    try:
        result = export_parquet(args.db, args.out, partition_by_date=args.by_date, run=args.run, engine=args.engine,
                                lake=lake_from_args(args))
    except (DatabaseUnavailable, UnknownRun) as exc:
        raise UsageError(f"{source_label(args)}: {exc}" if isinstance(exc, DatabaseUnavailable)
                         else f"--run: {exc}") from None
    except (OSError, duckdb.IOException) as exc:
        raise unwritable("--out", args.out, exc) from None
    runs = result["runs"]
    assert isinstance(runs, dict)
    which = "" if args.engine is None else f" (engine {args.engine})"
    print(f"exported {result['events_rows']:,} events of {len(runs)} run(s){which} to {result['events_glob']}")
    for run_id, n in sorted(runs.items()):
        print(f"  {run_id}: {n:,}")
    print(f"read back: python -c \"import duckdb; duckdb.sql(\\\"SELECT count(*) FROM "
          f"read_parquet('{result['events_glob']}', hive_partitioning=true)\\\").show()\"")
    return 0
