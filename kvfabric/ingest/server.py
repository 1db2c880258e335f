"""The Unix-socket server that accepts sink connections (one thread per connection, bounded in number).

Socket file: the parent directory is created (0700) if missing; an existing one must belong to this user (or root)
and must not be writable by others unless it is sticky (like /tmp), otherwise another user could replace the socket.
A stale socket file (nobody listening) is replaced, a live one (another collector) or a non-socket file at the
path is an error, never deleted. The socket is chmod'ed *before* listen(), so there is no moment where it accepts
connections with looser permissions.

Who may connect (SO_PEERCRED, checked right after accept, before anything is read): this collector's own uid,
root, the uids of ``allow_uids``, and, when the socket is group-accessible (mode 0660), members of the socket's
group. Anyone else is closed at once and counted (``kvfabric_connections_refused_total{reason="peer_not_allowed"}``):
the file mode is the first fence, this check the second (a umask or chmod mistake does not open the collector).

Connection slots (``max_connections``): a legitimate stream must always get in. When all slots are taken, the
connection that has been quiet the longest is closed to make room, at a message boundary so nothing is lost
(connections still in their handshake first, then streams idle between messages; both only after at least
:data:`EVICT_MIN_QUIET_S` of silence). Only when every connection is busy is the newcomer closed; a protocol-2
sink sends nothing before the collector's HELLO, so that costs it nothing but a retry. A hook's sink holds its
connection while its engine idles (so the collector lists the engine, kvfabric/ingest/engines.py): each engine takes
one slot, and with more engines than slots the idle ones take turns.

Stopping (:meth:`StreamServer.stop`) loses nothing a sink managed to send before it: connections already in the
listen backlog are still accepted, and every connection reads on until it is idle at a message boundary (or the
drain deadline passes), so the writer can commit all of it.
"""

from __future__ import annotations

import errno
import grp
import logging
import os
import pwd
import socket
import stat
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvfabric.contract.protocol import PeerCredentials, peer_credentials
from kvfabric.ingest import defaults as D
from kvfabric.ingest.budget import ByteBudget
from kvfabric.ingest.connection import IngestContext, peer_label, serve_connection
from kvfabric.ingest.errors import CONNECTION_LIMIT, PEER_NOT_ALLOWED
from kvfabric.ingest.source import SocketSource

log = logging.getLogger("kvfabric.ingest")

ACCEPT_POLL_S = 0.2
EVICT_MIN_QUIET_S = 1.0
"""A connection is a candidate for eviction only after this long without a whole message."""


class SocketInUse(RuntimeError):
    """Another process is listening on the socket path (or the path is not a socket)."""


class UnsafeSocketDirectory(RuntimeError):
    """The socket's directory could let another user replace the socket."""


def _prepare_path(path: str) -> None:
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        os.makedirs(parent, mode=0o700, exist_ok=True)
    _check_directory(parent)
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


def _check_directory(parent: str) -> None:
    st = os.stat(parent)
    me = os.geteuid()
    if st.st_uid not in (me, 0):
        raise UnsafeSocketDirectory(
            f"socket directory {parent} belongs to uid {st.st_uid}, not to this user ({me}): its owner could replace "
            "the socket; use a directory of your own (the default is private: see "
            "kvfabric.contract.protocol.default_socket_path)"
        )
    if st.st_mode & 0o022:
        if not st.st_mode & stat.S_ISVTX:
            raise UnsafeSocketDirectory(
                f"socket directory {parent} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}): they "
                "could replace the socket; use a directory only you can write to"
            )
        log.warning("socket directory %s is shared (sticky, mode %o): sinks of other users will not trust this "
                    "collector; prefer a private directory", parent, stat.S_IMODE(st.st_mode))


@dataclass(frozen=True)
class PeerPolicy:
    """Who may stream into this collector (see module docstring)."""

    own_uid: int = field(default_factory=os.geteuid)
    allow_uids: frozenset[int] = frozenset()
    allow_gids: frozenset[int] = frozenset()

    def allows(self, creds: PeerCredentials | None) -> bool:
        if creds is None:
            return False
        if creds.uid in (self.own_uid, 0) or creds.uid in self.allow_uids:
            return True
        if not self.allow_gids:
            return False
        if creds.gid in self.allow_gids:
            return True
        return any(_is_member(creds.uid, gid) for gid in self.allow_gids)


def _is_member(uid: int, gid: int) -> bool:
    """Supplementary membership (SO_PEERCRED carries only the primary gid)."""
    try:
        name = pwd.getpwuid(uid).pw_name
        return name in grp.getgrgid(gid).gr_mem
    except KeyError:
        return False


def parse_uids(values: Iterable[str]) -> frozenset[int]:
    """Numeric uids or user names (``--allow-uid``); raises ValueError naming an unknown user."""
    out: set[int] = set()
    for v in values:
        v = v.strip()
        if v.isdigit():
            out.add(int(v))
            continue
        try:
            out.add(pwd.getpwnam(v).pw_uid)
        except KeyError as e:
            raise ValueError(f"unknown user {v!r}") from e
    return frozenset(out)


@dataclass
class _Conn:
    sock: socket.socket
    source: SocketSource
    peer: str
    accepted: float


class StreamServer:
    """Accepts connections on ``socket_path`` and runs :func:`serve_connection` for each in its own thread."""

    def __init__(
        self,
        socket_path: str,
        ctx: IngestContext,
        *,
        max_connections: int = D.MAX_CONNECTIONS,
        socket_mode: int = D.SOCKET_MODE,
        budget: ByteBudget | None = None,
        allow_uids: frozenset[int] = frozenset(),
    ) -> None:
        self.socket_path = socket_path
        self._ctx = ctx
        self._max_connections = max_connections
        self._mode = socket_mode
        self._budget = budget
        self._allow_uids = allow_uids
        self.policy = PeerPolicy(allow_uids=allow_uids)
        self._listener: socket.socket | None = None
        self._inode: int | None = None
        self._accept_thread: threading.Thread | None = None
        self._conns: dict[threading.Thread, _Conn] = {}
        self._lock = threading.Lock()
        self._conn_no = 0

    def start(self) -> None:
        _prepare_path(self.socket_path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(self.socket_path)
        os.chmod(self.socket_path, self._mode)  # before listen(): nobody can connect yet
        st = os.stat(self.socket_path)
        self._inode = st.st_ino
        if self._mode & 0o070:  # the operator opened the socket to its group: its members may stream
            self.policy = PeerPolicy(allow_uids=self._allow_uids, allow_gids=frozenset({st.st_gid}))
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
                self._ctx.log(logging.ERROR, "accept", "accept failed: %s", e)
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

    def _refuse(self, conn: socket.socket, peer: str, reason: str, why: str) -> None:
        self._ctx.metrics.connections_refused.labels(reason=reason).inc()
        self._ctx.log(logging.WARNING, f"refused:{reason}", "kvfabric ingest: refused %s: %s", peer, why)
        conn.close()

    def _spawn(self, conn: socket.socket) -> None:
        creds = peer_credentials(conn)
        with self._lock:
            self._conn_no += 1
            conn_no = self._conn_no
        peer = peer_label(conn, conn_no)
        if not self.policy.allows(creds):
            self._refuse(conn, peer, PEER_NOT_ALLOWED,
                         f"uid {creds.uid if creds else '?'} may not stream into this collector (allowed: its own "
                         "uid, root, --allow-uid, and the socket's group when its mode is 660)")
            return
        source = SocketSource(
            conn,
            max_read_bytes=self._ctx.limits.max_bytes,
            handshake_timeout_s=self._ctx.handshake_timeout_s,
            stopping=self._ctx.stopping,
            drain_deadline=self._ctx.drain_deadline,
            budget=self._budget,
            message_timeout_s=self._ctx.message_timeout_s,
            idle_timeout_s=self._ctx.idle_timeout_s,
        )
        with self._lock:
            live = [c for c in self._conns.values() if not c.source.evict_requested]
            if len(live) >= self._max_connections:
                victim = _pick_victim(live, time.monotonic())
                if victim is None:
                    self._refuse(conn, peer, CONNECTION_LIMIT,
                                 f"{len(live)} connections open (the limit), all of them active")
                    return
                # The victim's thread closes it within one poll, at a message boundary: nothing is lost, and its
                # sink reconnects (a hook's at once, to stay listed; docs/design.md §7).
                victim.source.evict_requested = True
            t = threading.Thread(target=self._serve, args=(conn, source, peer), name=f"kvfabric-{peer}", daemon=True)
            self._conns[t] = _Conn(conn, source, peer, time.monotonic())
        t.start()

    def _serve(self, conn: socket.socket, source: SocketSource, peer: str) -> None:
        try:
            serve_connection(conn, source, peer, self._ctx)
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
        for t, c in stuck.items():  # blocked outside a read (a full queue): unblock by shutting down
            log.warning("%s still open after the drain deadline; closing it", t.name)
            try:
                c.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            t.join(1.0)
        try:
            if self._inode is not None and os.stat(self.socket_path).st_ino == self._inode:
                os.unlink(self.socket_path)
        except FileNotFoundError:
            pass


def _pick_victim(conns: list[_Conn], now: float) -> _Conn | None:
    """The connection to close for a newcomer: the longest-waiting handshake, else the longest-idle stream."""
    handshakes = [c for c in conns if c.source.in_handshake and now - c.accepted >= EVICT_MIN_QUIET_S]
    if handshakes:
        return min(handshakes, key=lambda c: c.accepted)
    idle = [c for c in conns if not c.source.in_handshake and c.source.at_boundary
            and now - c.source.last_boundary >= EVICT_MIN_QUIET_S]
    if idle:
        return min(idle, key=lambda c: c.source.last_boundary)
    return None
