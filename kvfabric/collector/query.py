"""``kvfabric query NAME --db PATH`` (or ``--lake CATALOG --data PATH``): run one named query against a database file
no collector holds, or against a lake (which collectors may be writing)."""

from __future__ import annotations

import argparse
import inspect
import json
import math
import sys
from typing import Any

from kvfabric.argtypes import int_range, positive_float
from kvfabric.collector.columns import aligned
from kvfabric.collector.fleet import table_lines as fleet_table_lines
from kvfabric.lake import LakeLocation
from kvfabric.queries import (
    MAX_LIMIT,
    QUERY_NAMES,
    BadParameter,
    DatabaseUnavailable,
    NotFound,
    QueryRunner,
    QueryTimeout,
    UnknownRun,
    parse_block_hash,
)
from kvfabric.queries import availability as A
from kvfabric.queries.sources import add_source_arguments, connector, lake_from_args, source_label
from kvfabric.usage import UsageError


def run_named_query(db_path: str, name: str, *, lake: LakeLocation | None = None, **params: Any) -> Any:
    """Run query ``name`` (see :data:`kvfabric.queries.QUERY_NAMES`) on ``db_path`` (or ``lake``) opened read-only.

    Parameters left None are dropped (so CLI flags can be passed through unconditionally); ``run_summary``
    without ``run`` returns every run's summary. Raises KeyError (unknown name), BadParameter, UnknownRun,
    NotFound, DatabaseUnavailable (missing file, or locked by a running collector: use its REST API).
    """
    return QueryRunner(connector(db_path, lake)).run(name, **params)


#: Each query parameter's command-line flag (``top_waste_families``'s ``n`` is its ``--limit``).
FLAGS: dict[str, str] = {
    "run": "--run", "family": "--family", "engine": "--engine", "block_hash": "--block-hash", "a": "--a",
    "b": "--b", "request_id": "--request-id", "bucket_s": "--bucket-s", "since_ns": "--since-ns",
    "until_ns": "--until-ns", "limit": "--limit", "n": "--limit", "cursor": "--cursor", "host": "--host",
    "tenant": "--tenant", "lora": "--lora",
}


_INT64 = int_range(-(1 << 63), (1 << 63) - 1)  # times go to SQL as BIGINT, as REST checks them


def _block_hash(text: str) -> str:
    try:
        parse_block_hash(text)
    except BadParameter as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text  # the runner parses it (and prints the given form in "not found")


def configure(parser: argparse.ArgumentParser) -> None:
    """``kvfabric query NAME --db PATH [--run R] ...``."""
    parser.epilog = "what each query needs:\n" + "\n".join(f"  {n:<19} {usage_of(n)}" for n in QUERY_NAMES)
    parser.add_argument("name", choices=QUERY_NAMES, metavar="NAME", help="one of: " + ", ".join(QUERY_NAMES))
    add_source_arguments(parser)
    parser.add_argument("--run", default=None, help="run id (run_summary, families, evictions, ...)")
    parser.add_argument("--family", default=None, help="family id (family_detail, evictions)")
    parser.add_argument("--engine", default=None, help="engine (evictions)")
    parser.add_argument("--host", default=None, help="only events of this host (run_summary, families, evictions)")
    parser.add_argument("--tenant", default=None,
                        help="only events of this tenant, the requests' cache_salt (run_summary, families, evictions)")
    parser.add_argument("--lora", default=None,
                        help="only events of this LoRA adapter (run_summary, families, evictions)")
    parser.add_argument("--block-hash", dest="block_hash", type=_block_hash, default=None, metavar="HASH",
                        help="block digest, as REST takes and prints it: 16 hex digits, 0x-hex or signed decimal "
                             "(block_history)")
    parser.add_argument("--a", default=None, help="first run (compare)")
    parser.add_argument("--b", default=None, help="second run (compare)")
    parser.add_argument("--request-id", dest="request_id", default=None, help="request id (request)")
    parser.add_argument("--bucket-s", dest="bucket_s", type=positive_float, default=None,
                        help="time-window length in seconds (misses; default 60)")
    parser.add_argument("--since-ns", dest="since_ns", type=_INT64, default=None,
                        help="events at or after this time, ns since the epoch (evictions, fleet)")
    parser.add_argument("--until-ns", dest="until_ns", type=_INT64, default=None,
                        help="events before this time, ns since the epoch (evictions, fleet)")
    parser.add_argument("--limit", type=int_range(1, MAX_LIMIT), default=None,
                        help=f"rows per answer, 1..{MAX_LIMIT} (default: the query's own, shown below)")
    parser.add_argument("--cursor", default=None,
                        help="evictions: the next_cursor a previous page printed, for the page after it")
    parser.add_argument("--format", choices=["json", "table"], default="table",
                        help="table: numbers rounded for reading; json: every value exactly (default: %(default)s)")


def _signature(name: str) -> list[inspect.Parameter]:
    return [p for p in inspect.signature(getattr(QueryRunner, name)).parameters.values() if p.name != "self"]


def usage_of(name: str) -> str:
    """``--run RUN [--limit N (100)]``: the flags query ``name`` takes, required ones first."""
    parts = []
    for p in _signature(name):
        flag = FLAGS[p.name]
        if p.default is inspect.Parameter.empty and not (name == "run_summary" and p.name == "run"):
            parts.append(f"{flag} {p.name.upper()}")
        else:
            number = isinstance(p.default, (int, float)) and not isinstance(p.default, bool)
            default = f" (default {p.default:g})" if number else ""
            parts.append(f"[{flag}{default}]")
    return " ".join(parts) or "(no options)"


def query_params(name: str, given: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of query ``name`` from the flags given (None = not given). Raises UsageError for a
    required flag left out and for a flag this query does not take: nothing given is silently ignored."""
    given = {k: v for k, v in given.items() if v is not None}
    params = _signature(name)
    names = {p.name for p in params}
    if "n" in names and "limit" in given:
        given["n"] = given.pop("limit")
    unused = [FLAGS[k] for k in given if k not in names]
    if unused:
        raise UsageError(f"{name} does not take {', '.join(unused)}; it takes: {usage_of(name)}")
    missing = [FLAGS[p.name] for p in params if p.default is inspect.Parameter.empty and p.name not in given
               and not (name == "run_summary" and p.name == "run")]
    if missing:
        raise UsageError(f"{name} needs {' and '.join(missing)}; it takes: {usage_of(name)}")
    return given


def human(value: Any) -> Any:
    """``value`` with every float rounded for a person to read (4 significant digits, one decimal from 100 up);
    integers (ids, times in ns, counts) stay exact."""
    if isinstance(value, float):
        if not math.isfinite(value) or value == 0:
            return value
        return round(value, 1) if abs(value) >= 100 else float(f"{value:.4g}")
    if isinstance(value, dict):
        return {k: human(v) for k, v in value.items()}
    if isinstance(value, list):
        return [human(v) for v in value]
    return value


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        value = human(value)
        return f"{value:.1f}" if abs(value) >= 100 else f"{value:g}"
    if isinstance(value, (dict, list)):
        return json.dumps(human(value), default=str)
    return str(value)


NOT_AVAILABLE = "n/a"
"""A table cell of a field the event source cannot give; a footnote under the table says why."""


def _print_sections(result: dict[str, Any]) -> None:
    """``misses``, ``lifetimes`` and ``request`` answers: a few tables, each under a title."""
    if result.get("unavailable"):
        subject = f"run {result['run_id']}" if "run_id" in result else f"request {result['request_id']}"
        print(f"{subject}: {result['unavailable']}")
        if "evictions_by_reason" in result:
            print(f"evictions by reason: {_cell(result['evictions_by_reason'])}")
        return
    if "totals" in result:
        print(f"run {result['run_id']}: {_cell(result['totals'])}")
        if "evictions_by_reason" in result:
            print(f"evictions by reason: {_cell(result['evictions_by_reason'])}")
        print("\nby family")
        _print_table(result["items"])
        if "windows" in result:
            print(f"\nby window of {result['bucket_s']:g} s")
            _print_table(result["windows"])
        return
    for a in result["admissions"]:
        print(f"{result['request_id']}  run {a['run_id']}  engine {a['engine']}  admission {a['admission']}  "
              f"family {a['family']}  prompt {a['prompt_tokens']}  split {_cell(a['split'])}")
        _print_table([{k: b[k] for k in ("depth", "tokens", "kind", "cause", "block_hash_hex", "rebuilt",
                                         "last_evicted_ns", "evicted_reason", "evicted_by_request")}
                      for b in a["blocks"]])
        print()


def _is_rows(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(r, dict) for r in value)


def _print_table(result: Any) -> None:
    if isinstance(result, dict) and "engines" in result and "totals" in result:  # fleet: kvfabric fleet's table
        print("\n".join(fleet_table_lines(result)) if result["engines"] else "(no engines)")
        return
    if isinstance(result, dict) and ("totals" in result or "admissions" in result):
        _print_sections(result)
        return
    if isinstance(result, dict) and "items" in result:  # a page: its rows, then how to get the next one
        _print_table(result["items"])
        if result.get("next_cursor"):
            print(f"(more rows: repeat with --cursor {result['next_cursor']} for the next page)")
        return
    if isinstance(result, dict):
        scalars = {k: v for k, v in result.items() if not _is_rows(v) and k != "unavailable"}
        missing = result.get("unavailable") or {}
        width = max((len(str(k)) for k in scalars), default=0)
        for k, v in scalars.items():
            print(f"{k:<{width}}  {_marked(k, v, result, missing)}")
        for k, v in result.items():
            if _is_rows(v):
                print(f"\n{k}")
                _print_table(v)
        return
    if not result:
        print("(no rows)")
        return
    if not _is_rows(result):
        for v in result:
            print(_cell(v))
        return
    cols = [c for c in result[0] if c != "unavailable"]
    print("\n".join(aligned(cols, [[NOT_AVAILABLE if c in (r.get("unavailable") or {}) else _cell(r.get(c))
                                     for c in cols] for r in result])))
    reasons = sorted({why for r in result for why in (r.get("unavailable") or {}).values()})
    for why in reasons:
        print(f"{NOT_AVAILABLE}: {why}")


def _marked(key: str, value: Any, result: dict[str, Any], missing: dict[str, str]) -> str:
    """One value of a single-object answer, or the reason it is missing, or where a hit rate came from."""
    if key in missing:
        return missing[key]
    if key == "prefix_hit_rate" and result.get("prefix_hit_rate_from") == A.FROM_COUNTERS:
        return f"{_cell(value)}  ({A.FROM_COUNTERS_TEXT})"
    return _cell(value)


def run(args: argparse.Namespace) -> int:
    params = query_params(args.name, {
        "run": args.run, "family": args.family, "engine": args.engine, "block_hash": args.block_hash, "a": args.a,
        "b": args.b, "limit": args.limit, "request_id": args.request_id, "bucket_s": args.bucket_s,
        "since_ns": args.since_ns, "until_ns": args.until_ns, "cursor": args.cursor, "host": args.host,
        "tenant": args.tenant, "lora": args.lora,
    })
    try:
        result = run_named_query(args.db, args.name, lake=lake_from_args(args), **params)
    except DatabaseUnavailable as exc:
        raise UsageError(f"{source_label(args)}: {exc}") from None
    except (BadParameter, NotFound, UnknownRun, QueryTimeout) as exc:
        raise UsageError(f"{args.name}: {exc}") from None
    if args.format == "json":
        print(json.dumps(result, indent=2, default=str))
    else:
        _print_table(result)
        if args.name == "admission_misses" and not result:  # a list cannot say why it is empty: say it here
            sources = QueryRunner(connector(args.db, lake_from_args(args))).sources(params["run"])
            if not A.has_lookups(sources):
                print(f"run {params['run']}: {A.NO_LOOKUPS}")
    limit = row_limit(args.name, params)
    rows = result.get("events") if isinstance(result, dict) else result  # block_history: its events
    if limit is not None and isinstance(rows, list) and len(rows) >= limit:
        print(f"kvfabric query: showing the first {limit:,} rows; --limit N shows up to {MAX_LIMIT:,}",
              file=sys.stderr)
    return 0


def row_limit(name: str, params: dict[str, Any]) -> int | None:
    """The number of rows query ``name`` answers at most with ``params`` (None: it is not cut)."""
    for p in _signature(name):
        if p.name in ("limit", "n") and name != "evictions":  # evictions pages: it says how to get the next
            return int(params.get(p.name, p.default))
    return None
