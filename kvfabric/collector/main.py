"""``python -m kvfabric.collector``: run one collector until SIGTERM/SIGINT (flushing on the way out)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

import duckdb

from kvfabric.collector.config import InsecureBind, add_arguments, config_from_args
from kvfabric.collector.service import Collector
from kvfabric.ingest.server import SocketInUse, UnsafeSocketDirectory
from kvfabric.ingest.store import IncompatibleDatabase

log = logging.getLogger("kvfabric.collector")


def configure(parser: argparse.ArgumentParser) -> None:
    """The collector's flags (shared by ``kvfabric collector`` and ``python -m kvfabric.collector``)."""
    add_arguments(parser)
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m kvfabric.collector",
        description="KVFabric collector: Arrow event streams on a Unix socket -> DuckDB; REST + /metrics over HTTP.",
    )
    configure(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    """Run a collector in this process. Returns 0 after a clean stop, 1 when the final flush was not clean (the log
    says what was not committed and why), 2 when it could not start."""
    logging.basicConfig(
        level=getattr(logging, args.log_level), stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("uvicorn").setLevel(max(logging.WARNING, logging.getLogger().level))  # its banner is noise
    try:
        collector = Collector(config_from_args(args))
        clean = collector.serve_forever()
    except (SocketInUse, UnsafeSocketDirectory, InsecureBind, IncompatibleDatabase, duckdb.IOException, OSError,
            ValueError) as e:
        log.error("kvfabric collector could not start: %s", e)
        return 2
    return 0 if clean else 1


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvfabric.collector``."""
    return run(build_parser().parse_args(argv))
