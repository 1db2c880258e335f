"""The Unix-socket server that accepts sink connections (one thread per connection, bounded in number).

Socket file: the parent directory is created (0700) if missing; a stale socket file (nobody listening) is
replaced, a live one (another collector) or a non-socket file at the path is an error, never deleted. The socket
is chmod'ed *before* listen(), so there is no moment where it accepts connections with looser permissions.

Stopping (:meth:`StreamServer.stop`) loses nothing a sink managed to send before it: connections already in the
listen backlog are still accepted, and every connection reads on until it is idle at a message boundary (or the
drain deadline passes), so the writer can commit all of it.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import stat
import threading
import time

from kvfabric.ingest.connection import IngestContext, peer_label, serve_connection

log = logging.getLogger("kvfabric.ingest")

ACCEPT_POLL_S = 0.2


class SocketInUse(RuntimeError):
    """Another process is listening on the socket path (or the path is not a socket)."""


def _prepare_path(path: str) -> None:
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        os.makedirs(parent, mode=0o700, exist_ok=True)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise SocketInUse(f"{path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except OSError as e:
        if e.errno in (errno.ECONNREFUSED, errno.ENOENT):
            log.info("replacing stale socket file %s", path)
            os.unlink(path)
            return
        raise SocketInUse(f"{path}: cannot tell whether it is in use ({e})") from e
    finally:
        probe.close()
    raise SocketInUse(f"{path} is in use by another collector")


class StreamServer:
    """Accepts connections on ``socket_path`` and runs :func:`serve_connection` for each in its own thread."""

    def __init__(
        self, socket_path: str, ctx: IngestContext, *, max_connections: int = 64, socket_mode: int = 0o600
    ) -> None:
        self.socket_path = socket_path
        self._ctx = ctx
        self._max_connections = max_connections
        self._mode = socket_mode
        self._listener: socket.socket | None = None
        self._inode: int | None = None
        self._accept_thread: threading.Thread | None = None
        self._conns: dict[threading.Thread, socket.socket] = {}
        self._lock = threading.Lock()
        self._conn_no = 0

    def start(self) -> None:
        _prepare_path(self.socket_path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(self.socket_path)
        os.chmod(self.socket_path, self._mode)  # before listen(): nobody can connect yet
        self._inode = os.stat(self.socket_path).st_ino
        sock.listen(128)
        sock.settimeout(ACCEPT_POLL_S)
        self._listener = sock
        self._accept_thread = threading.Thread(target=self._accept_loop, name="kvfabric-accept", daemon=True)
        self._accept_thread.start()

    @property
    def open_connections(self) -> int:
        with self._lock:
            return len(self._conns)

    def _accept_loop(self) -> None:
        assert self._listener is not None
        listener = self._listener
        while not self._ctx.stopping.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError as e:
                log.error("accept failed: %s", e)
                time.sleep(ACCEPT_POLL_S)
                continue
            self._spawn(conn)
        # Drain the backlog: a sink whose connect() succeeded may already have written its data.
        listener.setblocking(False)
        while True:
            try:
                conn, _ = listener.accept()
            except (BlockingIOError, OSError):
                break
            conn.setblocking(True)
            self._spawn(conn)
        listener.close()

    def _spawn(self, conn: socket.socket) -> None:
        with self._lock:
            self._conn_no += 1
            peer = peer_label(conn, self._conn_no)
            if len(self._conns) >= self._max_connections:
                log.warning("kvfabric ingest: refused %s: %d connections open (the limit)", peer, len(self._conns))
                conn.close()
                return
            t = threading.Thread(target=self._serve, args=(conn, peer), name=f"kvfabric-{peer}", daemon=True)
            self._conns[t] = conn
        t.start()

    def _serve(self, conn: socket.socket, peer: str) -> None:
        try:
            serve_connection(conn, peer, self._ctx)
        finally:
            with self._lock:
                self._conns.pop(threading.current_thread(), None)

    def stop(self, drain_timeout_s: float = 5.0) -> None:
        """Stop accepting, let connections drain (see module docstring), remove the socket file."""
        self._ctx.drain_deadline[0] = time.monotonic() + drain_timeout_s
        self._ctx.stopping.set()
        if self._accept_thread is not None:
            self._accept_thread.join()
        deadline = self._ctx.drain_deadline[0] + 1.0
        while True:
            with self._lock:
                threads = list(self._conns)
            if not threads or time.monotonic() >= deadline:
                break
            threads[0].join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            stuck = dict(self._conns)
        for t, conn in stuck.items():  # blocked outside a read (should not happen): unblock by shutting down
            log.warning("%s still open after the drain deadline; closing it", t.name)
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            t.join(1.0)
        try:
            if self._inode is not None and os.stat(self.socket_path).st_ino == self._inode:
                os.unlink(self.socket_path)
        except FileNotFoundError:
            pass
