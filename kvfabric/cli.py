"""The ``kvfabric`` command.

Each subcommand lives in the module that does the work and exposes ``configure(parser)`` (adds its arguments)
and ``run(args) -> int`` (the exit status). This file only lists them, so ``kvfabric --help`` stays instant:
modules are imported when their subcommand runs, never to print help.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

import kvfabric
from kvfabric.argtypes import HelpFormatter, OneLineErrorParser
from kvfabric.usage import EXIT_USAGE, UsageError

# name -> (module, one-line help). Modules are imported lazily (vLLM's import alone takes ~12 s).
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("kvfabric.demo", "run a built-in workload through vLLM's real scheduler on CPU and report (no GPU)"),
    "collector": ("kvfabric.collector.main", "run the collector: Unix-socket ingest, DuckDB, REST API, /metrics"),
    "query": ("kvfabric.collector.query", "run a named family-analytics query against a DuckDB file"),
    "export": ("kvfabric.collector.export", "export events to hive-partitioned Parquet (by run)"),
    "replay": ("kvfabric.sim.replay", "replay a hash_ids trace through vLLM's real scheduler under a policy"),
    "whatif": ("kvfabric.analysis.whatif", "replay a recorded run under another policy or capacity, and the optimum"),
    "learn": ("kvfabric.learn.cli", "fit the learned policy's reuse model on a trace or a recorded run"),
    "bench": ("kvfabric.bench.command", "pressure benchmark against any OpenAI-compatible server (modes, scenarios)"),
    "ab": ("kvfabric.bench.ab", "A/B policies on a scenario: fresh servers, one collector, Markdown + PNG report"),
    "sim-serve": ("kvfabric.sim.serve", "vLLM's real OpenAI server on CPU with a simulated model (H200 timings)"),
    "status": ("kvfabric.collector.status", "list the engines a running collector hears from (before any request)"),
    "fleet": ("kvfabric.collector.fleet", "per host and engine: hit rate, evictions, wasted prefill, ingest lag, loss"),
}

_EPILOG = """\
examples:
  kvfabric demo                          # the whole stack on CPU, report at the end
  kvfabric collector --db kv.duckdb      # serve ingest + REST on the default socket and 127.0.0.1:8321
  kvfabric query run_summary --db kv.duckdb --run demo
  kvfabric export --db kv.duckdb --out parquet/
  kvfabric fleet --lake postgres:dbname=kvf --data s3://bucket/kvf --since 1h

turn the hook on inside vLLM:  KVFABRIC_LIFECYCLE=1 vllm serve ...   (see README)
"""


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The ``kvfabric`` parser; only subcommand ``only`` gets its options (its module is imported for that).

    Every parser reports a bad option as one line and exit status 2 (:class:`~kvfabric.argtypes.OneLineErrorParser`)
    and shows every option's default in ``--help`` (:class:`~kvfabric.argtypes.HelpFormatter`, set after
    ``configure`` so a subcommand that picks its own formatter still shows them)."""
    parser = OneLineErrorParser(
        prog="kvfabric",
        description="KVFabric: see and steer what happens to vLLM's KV cache.",
        epilog=_EPILOG,
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"kvfabric {kvfabric.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, formatter_class=HelpFormatter)
        if name == only:
            importlib.import_module(module).configure(p)
            p.formatter_class = HelpFormatter
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    if command not in SUBCOMMANDS:
        command = None
    try:
        parser = build_parser(only=command)
    except ModuleNotFoundError as exc:
        print(f"kvfabric {command}: not available in this install ({exc})", file=sys.stderr)
        return 2
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a bad option (already reported on one line): its status
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    if args.command is None:
        parser.print_help()
        return 0
    module = importlib.import_module(SUBCOMMANDS[args.command][0])
    try:
        return int(module.run(args) or 0)
    except UsageError as exc:
        print(f"kvfabric {args.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:
        # A path the user gave that cannot be read or written, reached somewhere no narrower handler names it:
        # still one line that names the path. An OSError without a path is not known to be the user's: raise.
        if exc.filename is None:
            raise
        where = exc.filename if exc.filename2 is None else f"{exc.filename} -> {exc.filename2}"
        print(f"kvfabric {args.command}: {where}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
