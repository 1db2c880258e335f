"""The sink <-> collector wire protocol beyond the Arrow stream itself (docs/design.md §7).

A sink connects to the collector's Unix socket and writes one Arrow IPC stream whose schema metadata carries
:data:`META_PROTOCOL`. With protocol 2 the collector writes *acknowledgements* back on the same socket, as fixed
16-byte frames (:data:`ACK_FRAME`: magic ``KVFA``, kind, 3 pad bytes, a signed 64-bit value, little-endian):

``HELLO last_seq``
    Sent once, right after the collector accepted the stream's schema and before it reads any batch. ``last_seq``
    is the highest sequence number of this stream id the database has committed (-1 if none). The sink sends no
    batch before HELLO: a connection the collector accepts and closes at once (connection limit, peer not allowed,
    shutdown) therefore costs the sink nothing, its rows stay in its buffers. A new sink process adopting an
    existing stream id starts numbering at ``last_seq + 1``; a reconnecting sink forgets (as committed) the
    batches it still holds up to ``last_seq`` and resends the rest, in order.
``COMMITTED seq``
    Every batch this *connection* carried with a sequence number <= ``seq`` is accounted for by the collector:
    committed to DuckDB in a transaction that also advanced the stream's ``last_seq``, recognised as a duplicate
    of a committed batch, or refused and counted (``kvfabric_refused_batches_total``, the stream's
    ``refused_rows``). Cumulative: only the newest value matters, so the collector may coalesce them.
``REFUSED seq``
    The batch ``seq`` was refused (its content broke the contract, e.g. invalid UTF-8): its rows are counted by the
    collector, never stored; the sink must not resend it. A later ``COMMITTED`` covers it too.

Protocol 1 (no :data:`META_PROTOCOL` key) is the original one-way stream: the collector writes nothing back and a
sink counts a batch delivered when the socket write returns. The collector accepts both; the sink of this version
speaks 2 only.

The collector deduplicates on (stream id, seq): a batch whose ``seq`` is not above the stream's committed
``last_seq`` is a resend and is not stored again, unless it fills a gap it left open less than a grace period
ago (out-of-order arrival between two connections of one stream).

When the handshake happens: the hook's forwarder connects, sends its schema and waits for HELLO as soon as it
starts (when vLLM builds the scheduler), before any request, and holds the connection while the engine is idle,
reconnecting whenever it ends. The collector lists the streams it holds (``GET /api/v1/engines``, ``kvfabric
status``) from their schema metadata: the keys of :mod:`kvfabric.contract.schema`, plus the optional :data:`META_HOST`,
:data:`META_PID` and :data:`META_KVFABRIC_VERSION` (absent from older hooks: shown as unknown).
"""

from __future__ import annotations

import os
import socket
import struct
from dataclasses import dataclass

META_PROTOCOL = "kvfabric.protocol"
PROTOCOL_VERSION = 2
SUPPORTED_PROTOCOLS = (1, 2)

# Optional stream metadata, for the collector's list of engines (not needed to store or analyse events).
META_HOST = "kvfabric.host"
"""The engine's host name (an engine id set by ``KVFABRIC_ENGINE_ID`` need not contain it)."""
META_PID = "kvfabric.pid"
"""The engine process's pid (the vLLM EngineCore that built the scheduler), decimal."""
META_KVFABRIC_VERSION = "kvfabric.version"
"""The hook's KVFabric version (a collector of another version is worth knowing about)."""

MAX_META_VALUE_CHARS = 4096
"""Longest value of one stream metadata key (stream id, engine, run id, ...): the collector refuses a stream with a
longer one. They end up in logs and in the streams table."""

MAX_SETTINGS_CHARS = 65536
"""Longest settings JSON (``kvfabric.settings`` metadata) the collector accepts."""

MAX_LABEL_CHARS = 1024
"""Longest run id or engine label the collector serves: the REST API refuses a longer run id, engine or family
filter (``kvfabric.api.params.MAX_TEXT``), so the hook accepts no longer ``KVFABRIC_RUN_ID`` or
``KVFABRIC_ENGINE_ID``."""

MAX_BATCH_ROWS = 1_000_000
"""Most rows in one record batch the collector accepts by default (``--max-batch-rows``); a longer batch closes the
stream."""

MAX_BATCH_BYTES = 256 * 1024 * 1024
"""Most bytes in one record batch the collector accepts by default (``--max-batch-bytes``)."""

ACK_MAGIC = b"KVFA"
ACK_FRAME = struct.Struct("<4sBxxxq")
HELLO = 1
COMMITTED = 2
REFUSED = 3
ACK_KINDS = (HELLO, COMMITTED, REFUSED)


class ProtocolError(Exception):
    """The peer wrote bytes that are not acknowledgement frames."""


def encode_ack(kind: int, value: int) -> bytes:
    """One 16-byte frame."""
    return ACK_FRAME.pack(ACK_MAGIC, kind, value)


class AckDecoder:
    """Incremental decoder: feed it whatever ``recv`` returned, get whole frames back (partial ones are kept)."""

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, data: bytes) -> list[tuple[int, int]]:
        buf = self._pending + data
        frames: list[tuple[int, int]] = []
        size = ACK_FRAME.size
        end = len(buf) - len(buf) % size
        for off in range(0, end, size):
            magic, kind, value = ACK_FRAME.unpack_from(buf, off)
            if magic != ACK_MAGIC or kind not in ACK_KINDS:
                raise ProtocolError(f"not an acknowledgement frame: {buf[off:off + size]!r}")
            frames.append((kind, value))
        self._pending = buf[end:]
        return frames


@dataclass(frozen=True)
class PeerCredentials:
    """SO_PEERCRED of a Unix socket peer: the process that connected (collector side) or that listens (sink side)."""

    pid: int
    uid: int
    gid: int


def peer_credentials(sock: socket.socket) -> PeerCredentials | None:
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except (OSError, AttributeError):
        return None
    return PeerCredentials(*struct.unpack("3i", raw))


def untrusted_listener(creds: PeerCredentials | None, socket_path: str) -> str | None:
    """Why the process listening on ``socket_path`` must not receive this process's events, or None if it may.

    A sink trusts a collector that runs as its own user or as root, or as the user who alone controls the socket's
    directory (that directory and every one above it belong to root or to that user and are writable by nobody
    else: e.g. ``/run/kvfabric`` of a ``kvfabric`` service user). Anything else, typically another user's listener
    at a guessable path under /tmp, gets nothing: not even the stream's metadata.
    """
    if creds is None:
        return "the listener's credentials cannot be read (SO_PEERCRED)"
    me = os.geteuid()
    if creds.uid in (me, 0):
        return None
    directory = os.path.dirname(os.path.realpath(socket_path))
    if _controlled_by(directory, creds.uid):
        return None
    return (f"it runs as uid {creds.uid}, neither this user ({me}) nor root, and {directory} is not a directory "
            f"that only uid {creds.uid} controls")


def _controlled_by(directory: str, uid: int) -> bool:
    try:
        st = os.stat(directory)
    except OSError:
        return False
    if st.st_uid != uid or st.st_mode & 0o022:
        return False
    parent = os.path.dirname(directory)
    while True:
        try:
            pst = os.stat(parent)
        except OSError:
            return False
        if pst.st_uid not in (0, uid) or pst.st_mode & 0o022:  # a shared (even sticky) dir: anyone adds entries
            return False
        if parent == os.path.dirname(parent):
            return True
        parent = os.path.dirname(parent)


def probe_listener(socket_path: str, timeout_s: float = 1.0) -> str | None:
    """Why no collector this process may stream to answers on ``socket_path``, or None when one does.

    "Answers" means a listener accepted a connection and passed :func:`untrusted_listener`. The probe sends nothing
    (the collector counts a connection closed before its first byte as a readiness probe, not an error) and takes
    one connect, bounded by ``timeout_s``: meant for start-up (the plugin's line in vLLM's log), never for a hot
    path. It does not prove the collector's ingest works; the forwarder's own HELLO does that, and the collector's
    list of engines shows it.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout_s)
        try:
            sock.connect(socket_path)
        except OSError as exc:
            return exc.strerror or str(exc)
        return untrusted_listener(peer_credentials(sock), socket_path)
    finally:
        sock.close()


DEFAULT_SOCKET_NAME = "kvfabric.sock"


def default_socket_path() -> str:
    """Where the engine's sink and the collector meet by default: a directory private to this user.

    ``$XDG_RUNTIME_DIR/kvfabric/kvfabric.sock`` when ``$XDG_RUNTIME_DIR`` is a directory of this user (systemd
    creates it per login, mode 0700), else ``/tmp/kvfabric-<uid>/kvfabric.sock``. The collector creates the
    directory 0700 and refuses one that another user owns or may write to. Never a shared path such as
    ``/tmp/kvfabric.sock``: any local user could listen there first and receive a run's metadata and events (the
    sink also refuses a listener of another user: see :func:`untrusted_listener`).
    """
    uid = os.geteuid()
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isabs(runtime):
        try:
            st = os.stat(runtime)
        except OSError:
            st = None
        if st is not None and os.path.isdir(runtime) and st.st_uid == uid:
            return os.path.join(runtime, "kvfabric", DEFAULT_SOCKET_NAME)
    return os.path.join("/tmp", f"kvfabric-{uid}", DEFAULT_SOCKET_NAME)
