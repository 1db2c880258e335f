"""``kvfabric query NAME --db PATH``: run one named query against a database file no collector holds."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvfabric.queries import QueryRunner


def run_named_query(db_path: str, name: str, **params: Any) -> Any:
    """Run query ``name`` (see :data:`kvfabric.queries.QUERY_NAMES`) on ``db_path`` opened read-only.

    Parameters left None are dropped (so CLI flags can be passed through unconditionally); ``run_summary``
    without ``run`` returns every run's summary. Raises KeyError (unknown name), BadParameter, UnknownRun,
    NotFound, DatabaseUnavailable (missing file, or locked by a running collector: use its REST API).
    """
    return QueryRunner.for_path(db_path).run(name, **params)


def configure(parser: argparse.ArgumentParser) -> None:
    """``kvfabric query NAME --db PATH [--run R] ...``."""
    from kvfabric.queries import QUERY_NAMES

    parser.add_argument("name", choices=QUERY_NAMES, metavar="NAME", help="one of: " + ", ".join(QUERY_NAMES))
    parser.add_argument("--db", default="kvfabric.duckdb", help="DuckDB file no collector holds (default: %(default)s)")
    parser.add_argument("--run", default=None, help="run id (run_summary, families, evictions, ...)")
    parser.add_argument("--family", default=None, help="family id (family_detail, evictions)")
    parser.add_argument("--engine", default=None, help="engine (evictions)")
    parser.add_argument("--block-hash", dest="block_hash", type=int, default=None, help="digest (block_history)")
    parser.add_argument("--a", default=None, help="first run (compare)")
    parser.add_argument("--b", default=None, help="second run (compare)")
    parser.add_argument("--request-id", dest="request_id", default=None, help="request id (request)")
    parser.add_argument("--bucket-s", dest="bucket_s", type=float, default=None,
                        help="time-window length in seconds (misses; default 60)")
    parser.add_argument("--limit", type=int, default=None, help="row limit")
    parser.add_argument("--format", choices=["json", "table"], default="table", help="output (default: table)")


def _print_sections(result: dict[str, Any]) -> None:
    """``misses`` and ``request`` answers: a few tables, each under a title."""
    if "totals" in result:
        print(f"run {result['run_id']}: {json.dumps(result['totals'])}")
        print(f"evictions by reason: {json.dumps(result['evictions_by_reason'])}")
        print("\nby family")
        _print_table(result["items"])
        print(f"\nby window of {result['bucket_s']:g} s")
        _print_table(result["windows"])
        return
    for a in result["admissions"]:
        print(f"{result['request_id']}  run {a['run_id']}  engine {a['engine']}  admission {a['admission']}  "
              f"family {a['family']}  prompt {a['prompt_tokens']}  split {json.dumps(a['split'])}")
        _print_table([{k: b[k] for k in ("depth", "tokens", "kind", "cause", "block_hash_hex", "rebuilt",
                                         "last_evicted_ns", "evicted_reason", "evicted_by_request")}
                      for b in a["blocks"]])
        print()


def _print_table(result: Any) -> None:
    if isinstance(result, dict) and ("totals" in result or "admissions" in result):
        _print_sections(result)
        return
    rows = result.get("items", result) if isinstance(result, dict) else result
    if isinstance(rows, dict):
        width = max((len(str(k)) for k in rows), default=0)
        for k, v in rows.items():
            print(f"{k:<{width}}  {json.dumps(v, default=str) if isinstance(v, (dict, list)) else v}")
        return
    if not rows:
        print("(no rows)")
        return
    cols = list(rows[0])
    cells = [[("" if r.get(c) is None else str(r.get(c))) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)))


def run(args: argparse.Namespace) -> int:
    from kvfabric.queries import BadParameter, DatabaseUnavailable, NotFound, UnknownRun

    params = {"run": args.run, "family": args.family, "engine": args.engine, "block_hash": args.block_hash,
              "a": args.a, "b": args.b, "limit": args.limit, "request_id": args.request_id, "bucket_s": args.bucket_s}
    try:
        result = run_named_query(args.db, args.name, **params)
    except (BadParameter, DatabaseUnavailable, NotFound, UnknownRun, TypeError) as exc:
        print(f"kvfabric query {args.name}: {exc}", file=sys.stderr)
        return 2
    if args.format == "json":
        print(json.dumps(result, indent=2, default=str))
    else:
        _print_table(result)
    return 0
