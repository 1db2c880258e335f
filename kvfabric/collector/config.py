"""Collector settings and their command-line form (shared by ``python -m kvfabric.collector`` and ``kvfabric
collector``): :func:`add_arguments` + :func:`config_from_args` turn flags into a :class:`CollectorConfig`, and
:meth:`CollectorConfig.to_argv` turns it back into flags for a child process.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from kvfabric.config import DEFAULT_DB_PATH, DEFAULT_HTTP_HOST, DEFAULT_HTTP_PORT, default_socket_path
from kvfabric.ingest import IngestSettings

TOKEN_ENV = "KVFABRIC_API_TOKEN"


@dataclass
class CollectorConfig:
    """Everything one collector process needs. Defaults follow docs/design.md §7.

    ``token`` None means "take ``$KVFABRIC_API_TOKEN`` if set"; an empty token disables auth. ``port`` 0 binds a
    free port (read it back from :attr:`Collector.http_url`).
    """

    db_path: str = DEFAULT_DB_PATH
    socket_path: str = field(default_factory=default_socket_path)
    host: str = DEFAULT_HTTP_HOST
    port: int = DEFAULT_HTTP_PORT
    token: str | None = None
    http: bool = True
    socket_mode: int = 0o600
    max_connections: int = 64
    handshake_timeout_s: float = 10.0
    drain_timeout_s: float = 5.0
    max_batch_rows: int = 1_000_000
    max_batch_bytes: int = 256 * 1024 * 1024
    coalesce_rows: int = 245_760
    coalesce_ms: int = 100
    max_label_runs: int | None = None  # None: $KVFABRIC_MAX_LABEL_RUNS or 64

    def resolved_token(self) -> str | None:
        token = self.token if self.token is not None else os.environ.get(TOKEN_ENV)
        return token or None

    def ingest_settings(self) -> IngestSettings:
        return IngestSettings(
            db_path=self.db_path,
            socket_path=self.socket_path,
            socket_mode=self.socket_mode,
            max_connections=self.max_connections,
            handshake_timeout_s=self.handshake_timeout_s,
            drain_timeout_s=self.drain_timeout_s,
            max_batch_rows=self.max_batch_rows,
            max_batch_bytes=self.max_batch_bytes,
            coalesce_rows=self.coalesce_rows,
            coalesce_ms=self.coalesce_ms,
        )

    def to_argv(self) -> list[str]:
        """Flags reproducing this config (the token is left out: pass it as $KVFABRIC_API_TOKEN, not on argv)."""
        argv = [
            "--db", self.db_path, "--socket", self.socket_path, "--host", self.host, "--port", str(self.port),
            "--socket-mode", f"{self.socket_mode:o}", "--max-connections", str(self.max_connections),
            "--handshake-timeout", f"{self.handshake_timeout_s:g}", "--drain-timeout", f"{self.drain_timeout_s:g}",
            "--max-batch-rows", str(self.max_batch_rows), "--max-batch-bytes", str(self.max_batch_bytes),
            "--coalesce-rows", str(self.coalesce_rows), "--coalesce-ms", str(self.coalesce_ms),
        ]
        if not self.http:
            argv.append("--no-http")
        if self.max_label_runs is not None:
            argv += ["--max-label-runs", str(self.max_label_runs)]
        return argv


def _mode(text: str) -> int:
    value = int(text, 8)
    if value not in (0o600, 0o660):
        raise argparse.ArgumentTypeError("socket mode must be 600 (owner) or 660 (owner and group)")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The collector's flags, for ``python -m kvfabric.collector`` and the ``kvfabric collector`` subcommand."""
    d = CollectorConfig()
    parser.add_argument("--db", dest="db_path", default=d.db_path, help="DuckDB file (default: %(default)s)")
    parser.add_argument("--socket", dest="socket_path", default=d.socket_path,
                        help="Unix socket sinks connect to (default: %(default)s)")
    parser.add_argument("--host", default=d.host, help="HTTP bind address (default: %(default)s)")
    parser.add_argument("--port", type=int, default=d.port, help="HTTP port, 0 = any free (default: %(default)s)")
    parser.add_argument("--token", default=None,
                        help=f"bearer token for /api/v1 and /metrics (prefer ${TOKEN_ENV}: argv is visible to ps)")
    parser.add_argument("--no-http", dest="http", action="store_false", help="ingest only, no REST/metrics")
    parser.add_argument("--socket-mode", type=_mode, default=d.socket_mode, help="600 (default) or 660")
    parser.add_argument("--max-connections", type=int, default=d.max_connections)
    parser.add_argument("--handshake-timeout", dest="handshake_timeout_s", type=float, default=d.handshake_timeout_s,
                        help="seconds a new connection has to send its schema (default: %(default)s)")
    parser.add_argument("--drain-timeout", dest="drain_timeout_s", type=float, default=d.drain_timeout_s,
                        help="seconds connections may keep sending after SIGTERM (default: %(default)s)")
    parser.add_argument("--max-batch-rows", type=int, default=d.max_batch_rows)
    parser.add_argument("--max-batch-bytes", type=int, default=d.max_batch_bytes)
    parser.add_argument("--coalesce-rows", type=int, default=d.coalesce_rows,
                        help="rows per DuckDB insert the writer aims for (default: %(default)s)")
    parser.add_argument("--coalesce-ms", type=int, default=d.coalesce_ms,
                        help="longest a received batch waits for others to share its insert (default: %(default)s)")
    parser.add_argument("--max-label-runs", type=int, default=None,
                        help="distinct run labels in /metrics before '_other' (default: $KVFABRIC_MAX_LABEL_RUNS, 64)")


def config_from_args(args: argparse.Namespace) -> CollectorConfig:
    return CollectorConfig(
        db_path=args.db_path,
        socket_path=args.socket_path,
        host=args.host,
        port=args.port,
        token=args.token,
        http=args.http,
        socket_mode=args.socket_mode,
        max_connections=args.max_connections,
        handshake_timeout_s=args.handshake_timeout_s,
        drain_timeout_s=args.drain_timeout_s,
        max_batch_rows=args.max_batch_rows,
        max_batch_bytes=args.max_batch_bytes,
        coalesce_rows=args.coalesce_rows,
        coalesce_ms=args.coalesce_ms,
        max_label_runs=args.max_label_runs,
    )
