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
import sys

from kvfabric.queries import connect_read_only


def _literal(path: str) -> str:
    return "'" + path.replace("'", "''") + "'"


def export_parquet(db_path: str, out_dir: str, *, partition_by_date: bool = False) -> dict[str, object]:
    """Write ``events`` (partitioned by run, optionally by UTC date) and ``streams`` under ``out_dir``.

    Replaces ``out_dir/events`` and ``out_dir/streams`` if they exist (nothing else in ``out_dir`` is touched).
    Returns counts and paths: ``events_rows``, ``streams_rows``, ``runs`` (rows per run), ``files``,
    ``events_glob``, ``streams_path``, ``out_dir``.
    """
    events_dir = os.path.join(out_dir, "events")
    streams_dir = os.path.join(out_dir, "streams")
    os.makedirs(streams_dir, exist_ok=True)
    streams_path = os.path.join(streams_dir, "streams.parquet")
    con = connect_read_only(db_path)
    try:
        runs = {run: n for run, n in con.execute("SELECT run_id, count(*) FROM events GROUP BY run_id").fetchall()}
        if partition_by_date:
            select = ("SELECT *, strftime(make_timestamp(ts_ns // 1000), '%Y-%m-%d') AS date FROM events")
            partition = "run_id, date"
        else:
            select, partition = "SELECT * FROM events", "run_id"
        con.execute(
            f"COPY ({select}) TO {_literal(events_dir)} "
            f"(FORMAT parquet, COMPRESSION zstd, PARTITION_BY ({partition}), OVERWRITE)"
        )
        con.execute(f"COPY streams TO {_literal(streams_path)} (FORMAT parquet, COMPRESSION zstd)")
        streams_rows = con.execute("SELECT count(*) FROM streams").fetchone()
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
    parser.add_argument("--db", default="kvfabric.duckdb", help="DuckDB file no collector holds (default: %(default)s)")
    parser.add_argument("--format", choices=("parquet", "mooncake"), default="parquet",
                        help="parquet: every event, hive-partitioned (default); mooncake: one run's traffic as a "
                             "hash_ids JSONL trace that `kvfabric replay` reads (no token ids, hashes renumbered)")
    parser.add_argument("--out", required=True,
                        help="parquet: output directory (its events/ and streams/ are replaced); mooncake: file")
    parser.add_argument("--by-date", action="store_true", help="parquet: also partition events by UTC date")
    parser.add_argument("--run", default=None, help="mooncake: the run to export (required)")
    parser.add_argument("--engine", default=None, help="mooncake: only this engine's admissions (default: all)")
    parser.add_argument("--block-tokens", type=int, default=512,
                        help="mooncake: tokens per hash id, a multiple of the run's block size (default 512, the "
                             "Mooncake traces' and `kvfabric replay`'s; the run's block size keeps sharing exact)")


def run(args: argparse.Namespace) -> int:
    from kvfabric.queries import DatabaseUnavailable

    if args.format == "mooncake":
        from kvfabric.collector.mooncake import run_mooncake_export

        return run_mooncake_export(args)
    try:
        result = export_parquet(args.db, args.out, partition_by_date=args.by_date)
    except DatabaseUnavailable as exc:
        print(f"kvfabric export: {exc}", file=sys.stderr)
        return 2
    runs = result["runs"]
    assert isinstance(runs, dict)
    print(f"exported {result['events_rows']:,} events of {len(runs)} run(s) to {result['events_glob']}")
    for run_id, n in sorted(runs.items()):
        print(f"  {run_id}: {n:,}")
    print(f"read back: python -c \"import duckdb; duckdb.sql(\\\"SELECT count(*) FROM "
          f"read_parquet('{result['events_glob']}', hive_partitioning=true)\\\").show()\"")
    return 0
