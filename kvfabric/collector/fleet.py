"""``kvfabric fleet``: per host and engine, prefix hit rate, evictions, rebuilt-from-eviction, shared-anchor eviction
ratio, wasted prefill, ingest lag and loss, over a time window, from a DuckDB file no collector holds (``--db``) or
a lake (``--lake CATALOG --data PATH``, which collectors may be writing). The same object as ``GET /api/v1/fleet``
(:meth:`kvfabric.queries.QueryRunner.fleet`); ``--format json`` prints it exactly."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from kvfabric.argtypes import duration, int_range
from kvfabric.collector.columns import aligned
from kvfabric.queries import BadParameter, DatabaseUnavailable, QueryTimeout, UnknownRun
from kvfabric.queries import availability as A
from kvfabric.queries.sources import add_source_arguments, runner_from_args, source_label
from kvfabric.usage import UsageError

_INT64 = int_range(-(1 << 63), (1 << 63) - 1)  # times go to SQL as BIGINT, as REST checks them

COLUMNS: tuple[tuple[str, str], ...] = (
    ("HOST", "host"), ("ENGINE", "engine"), ("DP", "dp_rank"), ("REQUESTS", "requests"),
    ("PROMPT TOKENS", "prompt_tokens"), ("HIT RATE", "prefix_hit_rate"), ("EVICTED", "evicted_blocks"),
    ("SHARED-ANCHOR", "shared_anchor_eviction_ratio"), ("REBUILT", "rebuilt_blocks"),
    ("WASTED PREFILL", "wasted_prefill_tokens"), ("EVENTS", "events"), ("SINK DROPPED", "sink_dropped_events"),
    ("SEQ GAPS", "sequence_gaps"), ("LAG S", "ingest_lag_s"),
)
"""The table's columns: (title, field of an ``engines`` item or of ``totals``)."""
_RATIOS = ("prefix_hit_rate", "shared_anchor_eviction_ratio")
NOT_AVAILABLE = "n/a"
FROM_COUNTERS_MARK = "*"


def configure(parser: argparse.ArgumentParser) -> None:
    """``kvfabric fleet [--db FILE | --lake CATALOG --data PATH] [--since DURATION | --since-ns NS] [--until-ns NS]
    [--run R] [--format table|json]``."""
    add_source_arguments(parser)
    since = parser.add_mutually_exclusive_group()
    since.add_argument("--since", type=duration, default=None, metavar="DURATION",
                       help="only events of the last DURATION (90s, 15m, 12h, 7d); default: all stored events")
    since.add_argument("--since-ns", dest="since_ns", type=_INT64, default=None,
                       help="only events at or after this time, ns since the epoch")
    parser.add_argument("--until-ns", dest="until_ns", type=_INT64, default=None,
                        help="only events before this time, ns since the epoch")
    parser.add_argument("--run", default=None, help="only this run (default: every run)")
    parser.add_argument("--format", choices=["table", "json"], default="table",
                        help="table: one row per host and engine plus a TOTAL row; json: the REST object, exact "
                             "(default: %(default)s)")


def _cell(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if key in _RATIOS:
        return f"{value * 100:.1f}%"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def _row(item: dict[str, Any]) -> list[str]:
    """One engine's (or the totals') cells: ``n/a`` where its source cannot give the number, a ``*`` after a hit
    rate taken from the engine's own counters."""
    missing = item.get("unavailable") or {}
    cells = []
    for _, k in COLUMNS:
        cell = NOT_AVAILABLE if k in missing else _cell(k, item.get(k))
        if k == "prefix_hit_rate" and A.FROM_COUNTERS in _origins(item):
            cell += FROM_COUNTERS_MARK
        cells.append(cell)
    return cells


def _origins(item: dict[str, Any]) -> list[str]:
    origin = item.get("prefix_hit_rate_from")
    return list(origin) if isinstance(origin, list) else [origin] if origin else []


def table_lines(overview: dict[str, Any]) -> list[str]:
    """The overview as aligned lines: a header, one row per (host, engine), then the TOTAL row, then a footnote
    for each mark the table uses (``n/a``, ``*``)."""
    rows = [_row(e) for e in overview["engines"]]
    t = overview["totals"]
    total = _row(t)
    total[0], total[1], total[2] = f"TOTAL ({t['hosts']} hosts)", f"{t['engines']} engines", ""
    lines = aligned([title for title, _ in COLUMNS], [*rows, total])
    items = [*overview["engines"], t]
    if any(item.get("unavailable") for item in items):
        lines.append(f"{NOT_AVAILABLE}: {A.NO_LOOKUPS}")
    if any(A.FROM_COUNTERS in _origins(item) for item in items):
        lines.append(f"{FROM_COUNTERS_MARK}: hit rate {A.FROM_COUNTERS_TEXT} (vLLM's prefix_cache_queries and "
                     "prefix_cache_hits; a TOTAL with * adds them to other engines' lookups)")
    return lines


def window_text(overview: dict[str, Any]) -> str:
    since, until = overview["since_ns"], overview["until_ns"]
    if since is None and until is None:
        return "every stored event"
    fmt = "%Y-%m-%d %H:%M:%S UTC"
    parts = []
    if since is not None:
        parts.append(f"from {time.strftime(fmt, time.gmtime(since / 1e9))}")
    if until is not None:
        parts.append(f"until {time.strftime(fmt, time.gmtime(until / 1e9))}")
    return "events " + " ".join(parts)


def run(args: argparse.Namespace) -> int:
    since_ns = args.since_ns
    if args.since is not None:
        if args.since <= 0:
            raise UsageError("--since takes a duration above 0 (90s, 15m, 12h, 7d); leave it out for every event")
        since_ns = time.time_ns() - round(args.since * 1e9)
    try:
        overview = runner_from_args(args).fleet(since_ns=since_ns, until_ns=args.until_ns, run=args.run)
    except DatabaseUnavailable as exc:
        raise UsageError(f"{source_label(args)}: {exc}") from None
    except (BadParameter, UnknownRun, QueryTimeout) as exc:
        raise UsageError(str(exc)) from None
    if args.format == "json":
        print(json.dumps(overview, default=str))
        return 0
    scope = f"run {args.run}" if args.run else "every run"
    print(f"fleet: {scope}, {window_text(overview)}")
    if not overview["engines"]:
        print("(no engines)")
        return 0
    print("\n".join(table_lines(overview)))
    return 0
