"""``kvfabric learn``: fit the ``learned`` policy's reuse model on a trace or on a run the collector recorded.

    kvfabric learn --trace ../shared/traces/mooncake_conversation_first_half.jsonl --out m.json
    kvfabric learn --db kvfabric.duckdb --run my-run --out m.json
    kvfabric replay --trace T --policy learned --policy-model m.json --num-blocks N [--fast]
    KVFABRIC_EVICTION_POLICY=learned KVFABRIC_POLICY_MODEL=m.json vllm serve ...

The traffic is replayed at block level (vLLM's prefix-cache behaviour, LRU order) at each ``--capacity``; every
eviction candidate is classified as the policy classifies it and labelled with its next use (what the offline
optimum ranks by); the counts per class are the model (docs/design.md §6). The file records its training source
and validation metrics (a model fitted on the first 80 % of the requests, scored on the last 20 %).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, NoReturn

from kvfabric.argtypes import nonneg_int, positive_int
from kvfabric.policies.reuse_model import DEFAULT_FEATURES, FEATURES
from kvfabric.sim.tracecheck import scan_trace
from kvfabric.usage import UsageError


def configure(parser: argparse.ArgumentParser) -> None:
    parser.epilog = __doc__.split("\n\n", 1)[1] if __doc__ else None
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help="hash_ids JSONL trace (Mooncake format)")
    src.add_argument("--db", help="the collector's DuckDB file (with --run)")
    parser.add_argument("--run", help="run id to learn from (with --db)")
    parser.add_argument("--out", required=True, help="where to write the model (JSON)")
    parser.add_argument("--skip", type=nonneg_int, default=0, help="trace: skip the first K rows (default: 0)")
    parser.add_argument("--limit", type=positive_int, default=None, help="trace: use at most K rows")
    parser.add_argument("--block-size", type=positive_int, default=16, help="trace: tokens per KV block (default: 16)")
    parser.add_argument("--capacity", default="0.05,0.2",
                        help="pool sizes to replay at, as shares of the traffic's unique blocks (default: "
                             "%(default)s)")
    parser.add_argument("--features", default=",".join(DEFAULT_FEATURES),
                        help=f"features of a block's class (default {','.join(DEFAULT_FEATURES)}; "
                             f"known: {','.join(FEATURES)})")
    parser.add_argument("--format", choices=("json", "text"), default="text",
                        help="text: a summary and the most reused classes; json: the summary as one JSON object")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def _error(msg: str) -> NoReturn:
    raise UsageError(msg)


def _progress_factory(enabled: bool) -> Any:
    if not enabled:
        return None
    try:
        # tqdm: only when a bar is drawn, and optional (a missing one costs the bar only)
        from tqdm import tqdm
    except ImportError:  # tqdm is a dependency; a progress bar is never worth failing for
        return None

    def make(desc: str, total: int) -> Any:
        """An iterator the replay advances once per request; the bar closes itself at ``total``."""
        bar = tqdm(total=total, desc=desc, unit="req", file=sys.stderr, leave=False)

        def ticks() -> Any:
            for i in range(total):
                bar.update(1)
                if i == total - 1:
                    bar.close()
                yield None
            while True:
                yield None

        return ticks()

    return make


def run(args: argparse.Namespace) -> int:
    # (pyarrow and DuckDB load only when a model is fitted, so `kvfabric learn --help` stays fast)
    from kvfabric.learn import source
    from kvfabric.learn.fit import learn
    from kvfabric.queries import DatabaseUnavailable, QueryRunner

    features = tuple(f.strip() for f in args.features.split(",") if f.strip())
    unknown = [f for f in features if f not in FEATURES]
    if unknown or not features:
        return _error(f"unknown feature(s) {', '.join(unknown) or '(none)'} (known: {', '.join(FEATURES)})")
    try:
        capacities = [float(c) for c in args.capacity.split(",") if c.strip()]
    except ValueError:
        return _error(f"--capacity {args.capacity!r} is not a list of numbers")
    if not capacities or not all(0 < c <= 1 for c in capacities):
        return _error("--capacity takes shares of the unique blocks in (0, 1]")
    out_dir = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(out_dir):
        return _error(f"no directory {out_dir!r} for --out")
    t0 = time.perf_counter()
    try:
        if args.trace:
            if args.run:
                return _error("--run goes with --db, not --trace")
            if not os.path.isfile(args.trace):
                return _error(f"no trace file {args.trace!r}")
            scan_trace(args.trace, args.limit, skip=args.skip)  # a malformed row is refused by file and line
            traffic = source.from_trace(args.trace, args.block_size, args.skip, args.limit)
        else:
            if not args.run:
                return _error("--db needs --run RUN_ID")
            QueryRunner.for_path(args.db).runs()  # a file that is not a collector's database: one line naming it
            traffic = source.from_db(args.db, args.run)
        if not traffic.chains:
            return _error("no requests to learn from")
        model = learn(traffic, features, capacities, _progress_factory(not args.no_progress))
    except (ValueError, KeyError) as exc:  # malformed trace rows, unknown run, empty traffic
        return _error(str(exc))
    except DatabaseUnavailable as exc:
        return _error(f"--db: {exc}")
    model.training["command"] = "kvfabric learn " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["learn"] else [])
    model.training["wall_s"] = round(time.perf_counter() - t0, 1)
    try:
        model.save(args.out)
    except OSError as exc:
        return _error(f"--out {args.out}: cannot write it ({exc.strerror or exc})")
    val = model.metrics.get("validation", {})
    summary = {
        "out": args.out,
        "features": list(model.features),
        "requests": len(traffic),
        "classes": len(model.classes),
        "favoured_classes": sum(1 for i in model.classes if model.lift(i) > 1.0),
        "base_rate": round(model.base_rate, 5),
        "validation_auc": val.get("auc"),
        "validation_log_loss": val.get("log_loss"),
        "validation_log_loss_base_rate": val.get("log_loss_base_rate"),
        "wall_s": model.training["wall_s"],
    }
    if args.format == "json":
        print(json.dumps(summary, sort_keys=True))
    else:
        width = max(len(k) for k in summary)
        for k, v in summary.items():
            print(f"{k:<{width}}  {v}")
        print()
        print("class (most reused first)                      candidates  reused")
        for i in sorted(model.classes, key=lambda i: -model.probability(i))[:12]:
            c = model.classes[i]
            print(f"  {model.label(i):<45} {c.n:>10,}  {model.probability(i):.3f}")
    return 0
