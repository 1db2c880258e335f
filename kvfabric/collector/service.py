"""The collector: ingest (socket -> DuckDB) and the HTTP API in one process, started and stopped as one.

Start order: database + writer, socket server, HTTP; then one ready line. Stop order: HTTP (no new queries),
socket server drain, writer flush + CHECKPOINT, database close. The writer's DuckDB connection is the only one
that writes; HTTP queries use cursors of the same database instance (the file lock allows no other process).
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time
from types import FrameType

import duckdb
import uvicorn

from kvfabric.api import create_app
from kvfabric.collector.config import CollectorConfig, check_http_exposure
from kvfabric.ingest import CollectorMetrics, IngestPipeline
from kvfabric.queries import DatabaseUnavailable, QueryRunner

log = logging.getLogger("kvfabric.collector")


def _bind_tcp(host: str, port: int) -> socket.socket:
    family, type_, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, type_, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(addr)
    sock.listen(128)
    sock.setblocking(False)
    return sock


class Collector:
    """One collector. ``start()``/``stop()`` run it on background threads (tests, ``kvfabric demo``);
    ``serve_forever()`` runs it until SIGTERM/SIGINT (the process form)."""

    def __init__(self, config: CollectorConfig) -> None:
        self.config = config
        self.metrics = CollectorMetrics(config.max_label_runs)
        self.pipeline = IngestPipeline(config.ingest_settings(), self.metrics)
        self._http_sock: socket.socket | None = None
        self._http_server: uvicorn.Server | None = None
        self._http_thread: threading.Thread | None = None
        self._started = False
        self.http_url: str | None = None
        self._lake_reader: duckdb.DuckDBPyConnection | None = None  # --read-only: the lake, attached read-only
        self._reader_lock = threading.Lock()

    # -- lifecycle ------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start everything; returns once the socket accepts and HTTP answers. Raises on any startup failure
        (:class:`~kvfabric.collector.config.InsecureBind` before anything is opened)."""
        check_http_exposure(self.config)
        if self.config.read_only:
            self._lake_reader = self.pipeline.settings.backend.open_read_only(
                memory_limit=self.config.memory_limit or None)
        else:
            self.pipeline.start()
        try:
            if self.config.http:
                self._start_http()
        except BaseException:
            self.pipeline.stop()
            raise
        self._started = True
        self.metrics.up.set_function(lambda: 1.0 if self._serving() else 0.0)
        log.info(
            "kvfabric collector: socket=%s http=%s %s%s",
            "off (read-only)" if self.config.read_only else self.config.socket_path, self.http_url or "off",
            self.config.store_label(), " (read-only)" if self.config.read_only else "",
        )

    def _start_http(self) -> None:
        runner = QueryRunner(self._read_only_connection if self.config.read_only else self.pipeline.reader_connection)
        app = create_app(
            runner, registry=self.metrics.registry, health=self.health, token=self.config.resolved_token() or ""
        )  # "" (not None): the config already consulted $KVFABRIC_API_TOKEN; empty means no auth
        app.state.engines = self.pipeline.engines  # GET /api/v1/engines (kvfabric/api/routers/engines.py)
        sock = _bind_tcp(self.config.host, self.config.port)
        self._http_sock = sock
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        self.http_url = f"http://{shown}:{port}"
        # log_config=None: leave logging to the process (uvicorn would otherwise install its own handlers).
        cfg = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off", timeout_graceful_shutdown=3)
        server = uvicorn.Server(cfg)
        self._http_server = server
        self._http_thread = threading.Thread(
            target=server.run, kwargs={"sockets": [sock]}, name="kvfabric-http", daemon=True
        )
        self._http_thread.start()
        deadline = time.monotonic() + 15.0
        while not server.started:
            if not self._http_thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"HTTP server did not start on {self.http_url}")
            time.sleep(0.01)

    def _read_only_connection(self) -> duckdb.DuckDBPyConnection:
        with self._reader_lock:
            if self._lake_reader is None:
                raise DatabaseUnavailable("the lake is not attached (collector stopping)")
            return self.pipeline.settings.backend.cursor(self._lake_reader)

    def _serving(self) -> bool:
        if self.config.read_only:
            return self._started
        writer = self.pipeline.writer
        return self._started and writer is not None and writer.healthy

    def stop(self) -> bool:
        """Stop in the order of the module docstring; everything received is committed (or the log says how much
        was not, and why). Returns whether the flush was clean. Idempotent."""
        started = self._started
        self._started = False
        if self._http_server is not None:
            self._http_server.should_exit = True
            if self._http_thread is not None:
                self._http_thread.join(10.0)
            self._http_server = None
        if self._http_sock is not None:
            self._http_sock.close()
            self._http_sock = None
        with self._reader_lock:
            if self._lake_reader is not None:
                self._lake_reader.close()
                self._lake_reader = None
        report = self.pipeline.stop()
        if not started:
            return report.clean
        if report.clean:
            log.info("kvfabric collector stopped; %s flushed", self.config.store_label())
        else:
            log.error("kvfabric collector stopped WITHOUT a clean flush of %s: %s; %d received rows not "
                      "committed", self.config.store_label(), report.problem or "unknown problem",
                      report.uncommitted_rows)
        return report.clean

    def __enter__(self) -> Collector:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def serve_forever(self) -> bool:
        """Start, serve until SIGTERM or SIGINT, then stop (flushing). Call from the main thread. Returns whether
        the final flush was clean (everything received committed and checkpointed)."""
        stop = threading.Event()

        def on_signal(signum: int, _frame: FrameType | None) -> None:
            log.info("received %s, flushing and stopping", signal.Signals(signum).name)
            stop.set()

        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        clean = False
        try:
            self.start()
            while not stop.wait(0.5):
                pass
        finally:
            clean = self.stop()
            for s, h in previous.items():
                signal.signal(s, h)
        return clean

    # -- introspection --------------------------------------------------------------------------------------
    def health(self, authorized: bool = False) -> dict[str, object]:
        """/healthz body: ``status`` is ``ok`` while the writer thread lives and DuckDB accepts writes, else
        ``failing`` (HTTP 503). File paths and error texts (which name files) only for ``authorized`` callers."""
        if self.config.read_only:
            return {"status": "ok" if self._lake_reader is not None else "failing", "storage": "read-only",
                    "open_streams": 0, "writer_queue_rows": 0, "commits": 0}
        writer = self.pipeline.writer
        server = self.pipeline.server
        body: dict[str, object] = {
            "status": "ok",
            "storage": "ok",
            "open_streams": server.open_connections if server else 0,
            "writer_queue_rows": writer.pending_rows if writer else 0,
            "commits": writer.commits if writer else 0,
        }
        if authorized:
            body["db_path"] = self.config.db_path
            body["socket_path"] = self.config.socket_path
        detail: str | None = None
        if writer is None or not writer.alive:
            body["status"] = "failing"
            body["problem"] = "writer not running"
            detail = str(writer.failed) if writer is not None and writer.failed else "stopped"
        elif writer.storage_problem is not None:
            body["status"] = body["storage"] = "failing"
            since = writer.storage_failed_since or time.time()
            body["problem"] = (f"storage failing for {time.time() - since:.0f} s: ingest held "
                               f"({writer.pending_rows} rows waiting), retrying")
            detail = writer.storage_problem
        if authorized and detail:
            body["detail"] = detail
        self._kv_events_health(body, authorized)
        return body

    def _kv_events_health(self, body: dict[str, object], authorized: bool) -> None:
        """Each KV-event subscriber and engine-metrics scraper; a dead subscriber thread fails the collector (a
        publisher that went away does not: it is followed, and shown)."""
        subscribers = self.pipeline.kv_subscribers
        scrapers = self.pipeline.engine_scrapers
        if subscribers:
            body["kv_events"] = [s.status(authorized) for s in subscribers]
            dead = [s.spec.engine for s in subscribers if s.failed]
            if dead and body["status"] == "ok":
                body["status"] = "failing"
                body["problem"] = f"kv-events subscriber(s) stopped on an error: {', '.join(dead)}"
        if scrapers:
            body["engine_metrics"] = [s.status(authorized) for s in scrapers]
