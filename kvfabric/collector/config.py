"""Collector settings and their command-line form (shared by ``python -m kvfabric.collector`` and ``kvfabric
collector``): :func:`add_arguments` + :func:`config_from_args` turn flags into a :class:`CollectorConfig`, and
:meth:`CollectorConfig.to_argv` turns it back into flags for a child process.
"""

from __future__ import annotations

import argparse
import ipaddress
import socket
from dataclasses import dataclass, field

from kvfabric import settings
from kvfabric.argtypes import (
    duckdb_setting,
    duration,
    duration_text,
    nonneg_float,
    nonneg_int,
    port,
    positive_float,
    positive_int,
)
from kvfabric.contract.protocol import default_socket_path
from kvfabric.ingest import IngestSettings
from kvfabric.ingest import defaults as D
from kvfabric.ingest.retention import Retention
from kvfabric.ingest.server import parse_uids
from kvfabric.kvevents.spec import KvEventsSpec, check_unique, engine_metrics_targets, parse_spec
from kvfabric.lake import LakeLocation

TOKEN_ENV = "KVFABRIC_API_TOKEN"


@dataclass
class CollectorConfig:
    """Everything one collector process needs. Defaults follow docs/design.md §7.

    ``token`` None means "take ``$KVFABRIC_API_TOKEN`` if set"; an empty token disables auth. ``port`` 0 binds a
    free port (read it back from :attr:`Collector.http_url`).
    """

    db_path: str = D.DB_PATH
    socket_path: str = field(default_factory=default_socket_path)
    host: str = D.HTTP_HOST
    port: int = D.HTTP_PORT
    token: str | None = None
    http: bool = True
    socket_mode: int = D.SOCKET_MODE
    max_connections: int = D.MAX_CONNECTIONS
    handshake_timeout_s: float = D.HANDSHAKE_TIMEOUT_S
    drain_timeout_s: float = D.DRAIN_TIMEOUT_S
    max_batch_rows: int = D.MAX_BATCH_ROWS
    max_batch_bytes: int = D.MAX_BATCH_BYTES
    max_string_bytes: int = D.MAX_STRING_BYTES
    max_buffered_bytes: int = D.MAX_BUFFERED_BYTES
    message_timeout_s: float = D.MESSAGE_TIMEOUT_S
    idle_timeout_s: float = D.IDLE_TIMEOUT_S
    coalesce_rows: int = D.COALESCE_ROWS
    coalesce_ms: int = D.COALESCE_MS
    checkpoint_threshold: str | None = None  # None: DuckDB's default (16MB)
    # Queries needing more than the limit spill to disk. "" = DuckDB's default.
    memory_limit: str = D.MEMORY_LIMIT
    allow_uids: tuple[str, ...] = ()  # extra uids (numbers or user names) that may stream into the socket
    allow_remote_without_token: bool = False
    max_label_runs: int | None = None  # None: $KVFABRIC_MAX_LABEL_RUNS or 64
    lake: str | None = None  # a DuckLake catalog: the lake backend instead of db_path (with ``data``)
    data: str | None = None  # the lake's data path: a folder or s3://bucket/prefix
    read_only: bool = False  # serve queries on the lake, no socket, no writes
    retain_s: float = D.RETAIN_S  # 0: keep everything
    maintenance_interval_s: float = D.MAINTENANCE_INTERVAL_S
    kv_events: tuple[str, ...] = ()  # --kv-events SPECs: vLLM KV-event publishers to subscribe to
    engine_metrics: tuple[str, ...] = ()  # --engine-metrics [ENGINE=]URL: engines' /metrics (prefix-cache counters)

    def kv_event_specs(self) -> tuple[KvEventsSpec, ...]:
        """The ``--kv-events`` specs, checked (:class:`~kvfabric.kvevents.spec.SpecError`, a ValueError, names the
        one at fault)."""
        if (self.kv_events or self.engine_metrics) and self.read_only:
            raise ValueError("--kv-events and --engine-metrics ingest: a --read-only collector takes neither")
        specs = tuple(parse_spec(text) for text in self.kv_events)
        check_unique(specs)
        return specs

    def lake_location(self) -> LakeLocation | None:
        """The lake, checked (ValueError names the flag at fault); None for the DuckDB file."""
        if self.lake is None and self.data is None:
            if self.read_only:
                raise ValueError("--read-only is for a lake: give --lake CATALOG --data PATH")
            return None
        if self.lake is None or self.data is None:
            raise ValueError("--lake and --data go together: the catalog and where its Parquet files live")
        return LakeLocation.parse(self.lake, self.data)

    def store_label(self) -> str:
        """What the logs name as the store."""
        location = self.lake_location()
        return location.describe() if location is not None else f"db={self.db_path}"

    def resolved_token(self) -> str | None:
        token = self.token if self.token is not None else settings.read(TOKEN_ENV)
        return token or None

    def ingest_settings(self) -> IngestSettings:
        specs = self.kv_event_specs()
        return IngestSettings(
            db_path=self.db_path,
            socket_path=self.socket_path,
            socket_mode=self.socket_mode,
            max_connections=self.max_connections,
            handshake_timeout_s=self.handshake_timeout_s,
            drain_timeout_s=self.drain_timeout_s,
            max_batch_rows=self.max_batch_rows,
            max_batch_bytes=self.max_batch_bytes,
            max_string_bytes=self.max_string_bytes,
            max_buffered_bytes=self.max_buffered_bytes,
            message_timeout_s=self.message_timeout_s,
            idle_timeout_s=self.idle_timeout_s,
            coalesce_rows=self.coalesce_rows,
            coalesce_ms=self.coalesce_ms,
            checkpoint_threshold=self.checkpoint_threshold,
            memory_limit=self.memory_limit or None,
            allow_uids=parse_uids(self.allow_uids),
            lake=self.lake_location(),
            maintenance=Retention(lake=self.lake is not None, retain_s=self.retain_s),
            maintenance_interval_s=self.maintenance_interval_s,
            kv_events=specs,
            engine_metrics=tuple(engine_metrics_targets(specs, self.engine_metrics)),
        )

    def to_argv(self) -> list[str]:
        """Flags reproducing this config (the token is left out: pass it as $KVFABRIC_API_TOKEN, not on argv)."""
        argv = [
            "--db", self.db_path, "--socket", self.socket_path, "--host", self.host, "--port", str(self.port),
            "--socket-mode", f"{self.socket_mode:o}", "--max-connections", str(self.max_connections),
            "--handshake-timeout", f"{self.handshake_timeout_s:g}", "--drain-timeout", f"{self.drain_timeout_s:g}",
            "--max-batch-rows", str(self.max_batch_rows), "--max-batch-bytes", str(self.max_batch_bytes),
            "--coalesce-rows", str(self.coalesce_rows), "--coalesce-ms", str(self.coalesce_ms),
            "--max-string-bytes", str(self.max_string_bytes), "--max-buffered-bytes", str(self.max_buffered_bytes),
            "--message-timeout", f"{self.message_timeout_s:g}", "--idle-timeout", f"{self.idle_timeout_s:g}",
        ]
        if not self.http:
            argv.append("--no-http")
        if self.checkpoint_threshold:
            argv += ["--checkpoint-threshold", self.checkpoint_threshold]
        argv += ["--memory-limit", self.memory_limit]
        for uid in self.allow_uids:
            argv += ["--allow-uid", uid]
        if self.allow_remote_without_token:
            argv.append("--allow-remote-without-token")
        if self.max_label_runs is not None:
            argv += ["--max-label-runs", str(self.max_label_runs)]
        if self.lake is not None:
            argv += ["--lake", self.lake]
        if self.data is not None:
            argv += ["--data", self.data]
        if self.read_only:
            argv.append("--read-only")
        argv += ["--retain", duration_text(self.retain_s),
                 "--maintenance-interval", duration_text(self.maintenance_interval_s)]
        for spec in self.kv_events:
            argv += ["--kv-events", spec]
        for target in self.engine_metrics:
            argv += ["--engine-metrics", target]
        return argv


class InsecureBind(ValueError):
    """A non-loopback HTTP bind without a token, not explicitly allowed."""


def is_loopback(host: str) -> bool:
    """True when every address ``host`` names is a loopback address (an unresolvable name counts as not)."""
    name = host.strip().strip("[]")
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(name, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)


def check_http_exposure(config: CollectorConfig) -> None:
    """Refuse to serve every run's data to a network without a token, unless the operator said so explicitly."""
    if not config.http or config.resolved_token() or config.allow_remote_without_token or is_loopback(config.host):
        return
    raise InsecureBind(
        f"--host {config.host} is not a loopback address and no token is set: anyone who can reach the port would "
        f"read every run's data. Set ${TOKEN_ENV} (or --token), bind 127.0.0.1, or pass "
        "--allow-remote-without-token if that is really intended"
    )


def _mode(text: str) -> int:
    try:
        value = int(text, 8)
    except ValueError:
        value = -1
    if value not in (0o600, 0o660):
        raise argparse.ArgumentTypeError(f"must be 600 (owner only) or 660 (owner and group), got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The collector's flags, for ``python -m kvfabric.collector`` and the ``kvfabric collector`` subcommand."""
    d = CollectorConfig()
    parser.add_argument("--db", dest="db_path", default=d.db_path, help="DuckDB file (default: %(default)s)")
    parser.add_argument("--socket", dest="socket_path", default=d.socket_path,
                        help="Unix socket sinks connect to (default: %(default)s)")
    parser.add_argument("--host", default=d.host,
                        help="HTTP bind address (default: %(default)s). A non-loopback address needs a token "
                        f"(${TOKEN_ENV} or --token) unless --allow-remote-without-token is given")
    parser.add_argument("--port", type=port, default=d.port, help="HTTP port, 0 = any free (default: %(default)s)")
    parser.add_argument("--token", default=None,
                        help=f"bearer token for /api/v1 and /metrics (prefer ${TOKEN_ENV}: argv is visible to ps)")
    parser.add_argument("--allow-remote-without-token", action="store_true",
                        help="serve REST and /metrics on a non-loopback --host without a token (anyone who can "
                        "reach the port reads every run's data); refused unless given")
    parser.add_argument("--no-http", dest="http", action="store_false", help="ingest only, no REST/metrics")
    parser.add_argument("--socket-mode", type=_mode, default=f"{d.socket_mode:o}",
                        help="socket file mode: 600 (owner only) or 660 (owner and group) (default: %(default)s)")
    parser.add_argument("--allow-uid", dest="allow_uids", action="append", default=[], metavar="UID",
                        help="a uid or user name that may stream into the socket besides this user, root and (with "
                        "--socket-mode 660) the socket's group; repeatable")
    parser.add_argument("--max-connections", type=positive_int, default=d.max_connections,
                        help="sink connections at once; when full, the quietest one is closed to make room "
                        "(default: %(default)s)")
    parser.add_argument("--handshake-timeout", dest="handshake_timeout_s", type=positive_float,
                        default=d.handshake_timeout_s,
                        help="seconds a new connection has to send its schema (default: %(default)s)")
    parser.add_argument("--drain-timeout", dest="drain_timeout_s", type=nonneg_float, default=d.drain_timeout_s,
                        help="seconds connections may keep sending after SIGTERM (default: %(default)s)")
    parser.add_argument("--message-timeout", dest="message_timeout_s", type=positive_float, default=d.message_timeout_s,
                        help="seconds a message may take from its first byte to its last (default: %(default)s)")
    parser.add_argument("--idle-timeout", dest="idle_timeout_s", type=positive_float, default=d.idle_timeout_s,
                        help="seconds a stream may stay silent before it is closed; sinks reconnect when they have "
                        "data (default: %(default)s)")
    parser.add_argument("--max-batch-rows", type=positive_int, default=d.max_batch_rows,
                        help="most rows in one message (record batch) accepted (default: %(default)s)")
    parser.add_argument("--max-batch-bytes", type=positive_int, default=d.max_batch_bytes,
                        help="largest message (record batch) accepted (default: %(default)s)")
    parser.add_argument("--max-buffered-bytes", type=positive_int, default=d.max_buffered_bytes,
                        help="bytes all connections together may hold in partly received messages "
                        "(default: %(default)s)")
    parser.add_argument("--max-string-bytes", type=positive_int, default=d.max_string_bytes,
                        help="longest string value; a batch with a longer one is refused (default: %(default)s)")
    parser.add_argument("--checkpoint-threshold", type=duckdb_setting("checkpoint_threshold", empty_ok=False),
                        default=None, metavar="SIZE",
                        help="WAL size at which DuckDB checkpoints, e.g. 16MB (default: DuckDB's)")
    parser.add_argument("--memory-limit", type=duckdb_setting("memory_limit"), default=d.memory_limit, metavar="SIZE",
                        help="DuckDB's memory limit: bounds its cache of the database, which otherwise grows with the "
                        "file; queries that need more spill to disk; '' = DuckDB's default, 80%% of RAM "
                        "(default: %(default)s)")
    parser.add_argument("--coalesce-rows", type=positive_int, default=d.coalesce_rows,
                        help="rows per DuckDB insert the writer aims for (default: %(default)s)")
    parser.add_argument("--coalesce-ms", type=nonneg_int, default=d.coalesce_ms,
                        help="longest a received batch waits for others to share its insert (default: %(default)s)")
    parser.add_argument("--lake", default=None, metavar="CATALOG",
                        help="store in a DuckLake lake instead of --db: 'postgres:dbname=... host=... port=... "
                        "user=...' (a catalog many collectors share), 'sqlite:FILE' or a DuckDB FILE (one host); "
                        "needs --data and the lake extra (pip install 'kvfabric[lake]')")
    parser.add_argument("--data", default=None, metavar="PATH",
                        help="the lake's Parquet files: a folder or s3://bucket/prefix (endpoint, region and keys from "
                        "AWS_ENDPOINT_URL, AWS_REGION, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, or a DuckDB secret)")
    parser.add_argument("--read-only", action="store_true",
                        help="serve REST and /metrics on the lake, ingest nothing (no socket): the one place a "
                        "team's dashboards and analysts query")
    parser.add_argument("--retain", dest="retain_s", type=duration, default=duration_text(d.retain_s),
                        metavar="DURATION",
                        help="delete events older than this (90s, 15m, 12h, 7d, 2w; 0 or off keeps everything) "
                        "(default: %(default)s)")
    parser.add_argument("--maintenance-interval", dest="maintenance_interval_s", type=duration,
                        default=duration_text(d.maintenance_interval_s), metavar="DURATION",
                        help="how often retention runs, and on a lake the merging of small files and the removal "
                        "of files no snapshot needs (default: %(default)s)")
    parser.add_argument("--kv-events", dest="kv_events", action="append", default=[], metavar="SPEC",
                        help="subscribe to a vLLM (or SGLang) KV-event publisher (--kv-events-config) and store its "
                        "events like the plugin's: tcp://HOST:PORT[,replay=tcp://HOST:PORT][,engine=NAME][,run=RUN]"
                        "[,topic=T][,metrics=URL][,host=H][,hwm=N] (defaults: engine kv-events@HOST:PORT, run "
                        f"default, any topic, hwm {D.KV_EVENTS_RCVHWM}); repeatable, one per engine or DP rank")
    parser.add_argument("--engine-metrics", dest="engine_metrics", action="append", default=[],
                        metavar="[ENGINE=]URL",
                        help="an engine's Prometheus /metrics: its prefix-cache query and hit counters are read every "
                        f"{D.ENGINE_METRICS_INTERVAL_S:g} s into prefix_cache_counters rows (ENGINE may be left out "
                        "with exactly one --kv-events); repeatable")
    parser.add_argument("--max-label-runs", type=positive_int, default=None,
                        help="distinct run labels in /metrics before '_other' (default: $KVFABRIC_MAX_LABEL_RUNS, 64)")


def config_from_args(args: argparse.Namespace) -> CollectorConfig:
    """Flags -> config. Raises ValueError on limits that contradict each other."""
    if args.max_buffered_bytes < args.max_batch_bytes:
        raise ValueError(f"--max-buffered-bytes ({args.max_buffered_bytes}) must be at least --max-batch-bytes "
                         f"({args.max_batch_bytes}): a message of the largest allowed size could never be received")
    config = CollectorConfig(
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
        max_string_bytes=args.max_string_bytes,
        max_buffered_bytes=args.max_buffered_bytes,
        message_timeout_s=args.message_timeout_s,
        idle_timeout_s=args.idle_timeout_s,
        coalesce_rows=args.coalesce_rows,
        coalesce_ms=args.coalesce_ms,
        checkpoint_threshold=args.checkpoint_threshold,
        memory_limit=args.memory_limit,
        allow_uids=tuple(args.allow_uids),
        allow_remote_without_token=args.allow_remote_without_token,
        max_label_runs=args.max_label_runs,
        lake=args.lake,
        data=args.data,
        read_only=args.read_only,
        retain_s=args.retain_s,
        maintenance_interval_s=args.maintenance_interval_s or D.MAINTENANCE_INTERVAL_S,
        kv_events=tuple(args.kv_events),
        engine_metrics=tuple(args.engine_metrics),
    )
    config.lake_location()  # --lake / --data / --read-only checked before anything starts
    engine_metrics_targets(config.kv_event_specs(), config.engine_metrics)  # --kv-events / --engine-metrics too
    return config
