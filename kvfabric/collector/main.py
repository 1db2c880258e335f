"""``python -m kvfabric.collector``: run one collector until SIGTERM/SIGINT (flushing on the way out)."""

from __future__ import annotations

import argparse
import errno
import gc
import logging
import sys
from collections.abc import Sequence

import duckdb

from kvfabric.argtypes import HelpFormatter, OneLineErrorParser
from kvfabric.collector.config import CollectorConfig, InsecureBind, add_arguments, config_from_args
from kvfabric.collector.service import Collector
from kvfabric.ingest.server import SocketInUse, UnsafeSocketDirectory
from kvfabric.ingest.store import IncompatibleDatabase
from kvfabric.lake import LakeUnavailable, MissingExtension
from kvfabric.usage import EXIT_USAGE, UsageError

log = logging.getLogger("kvfabric.collector")

GC_THRESHOLD = 50_000


def configure(parser: argparse.ArgumentParser) -> None:
    """The collector's flags (shared by ``kvfabric collector`` and ``python -m kvfabric.collector``)."""
    add_arguments(parser)
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="what the collector logs to stderr")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="python -m kvfabric.collector", formatter_class=HelpFormatter,
        description="KVFabric collector: Arrow event streams on a Unix socket -> DuckDB; REST + /metrics over HTTP.",
    )
    configure(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    """Run a collector in this process. Returns 0 after a clean stop, 1 when the final flush was not clean (the log
    says what was not committed and why). Raises :class:`~kvfabric.usage.UsageError` (one line, exit status 2) when
    it cannot start: the message names the option and the path or address at fault."""
    logging.basicConfig(
        level=getattr(logging, args.log_level), stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("uvicorn").setLevel(max(logging.WARNING, logging.getLogger().level))  # its banner is noise
    # Ingest allocates thousands of short-lived containers per batch (a KV-event batch's rows, their columns): with
    # CPython's default of a collection every 700 allocations, the cyclic GC cost more than converting the rows
    # (measured: 1.5 us of 2.6 us a row at 200k rows/s); every 50,000 it is noise.
    gc.set_threshold(GC_THRESHOLD, *gc.get_threshold()[1:])
    try:
        config = config_from_args(args)
    except ValueError as e:
        raise UsageError(str(e)) from None
    try:
        collector = Collector(config)
        clean = collector.serve_forever()
    except (SocketInUse, UnsafeSocketDirectory) as e:
        raise UsageError(f"could not start: --socket: {e}") from None
    except (InsecureBind, IncompatibleDatabase, ValueError) as e:
        raise UsageError(f"could not start: {e}") from None
    except (LakeUnavailable, MissingExtension) as e:
        raise UsageError(f"could not start: {e}") from None
    except duckdb.Error as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        if config.lake is not None:
            raise UsageError(f"could not start: the lake ({config.store_label()}) cannot be used: {first}") from None
        raise UsageError(f"could not start: --db {config.db_path} cannot be opened as the collector's database "
                         f"({first})") from None
    except OSError as e:
        raise UsageError(f"could not start: {startup_os_error(e, config)}") from None
    return 0 if clean else 1


def startup_os_error(e: OSError, config: CollectorConfig) -> str:
    """One line for an OSError met while starting: which option, which path or address, what the system said."""
    reason = e.strerror or str(e)
    if _raised_in(e, "_bind_tcp"):
        address = f"[{config.host}]:{config.port}" if ":" in config.host else f"{config.host}:{config.port}"
        if e.errno == errno.EADDRINUSE:
            return (f"--host/--port: {address} is already in use (another collector?); pass another --port, --port 0 "
                    "for any free one, or --no-http")
        return f"--host/--port: cannot listen on {address} ({reason})"
    if e.filename is not None:
        return f"{e.filename}: {reason}"
    # No path in the error: the one unnamed file operation at start-up is binding the Unix socket.
    if e.errno == errno.EADDRINUSE:
        return f"--socket {config.socket_path} is already in use (another collector?)"
    return f"--socket {config.socket_path}: cannot create the socket ({reason})"


def _raised_in(exc: BaseException, function: str) -> bool:
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_name == function:
            return True
        tb = tb.tb_next
    return False


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvfabric.collector``."""
    try:
        return run(build_parser().parse_args(argv))
    except UsageError as e:
        print(f"python -m kvfabric.collector: {e}", file=sys.stderr)
        return EXIT_USAGE
