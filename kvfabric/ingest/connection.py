"""One sink connection: read one Arrow IPC stream, validate it, hand its batches to the writer queue.

Whatever a peer sends, the outcome is confined to its own connection: a refused or cut stream produces exactly
one log line naming the peer/stream and the reason, one increment of ``kvfabric_bad_streams_total{reason}``, and
the connection closes. Batches queued before the problem are kept (they are committed like any other).
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
from dataclasses import dataclass

import pyarrow as pa

from kvfabric import schema as S
from kvfabric.ingest.errors import GARBAGE, TRUNCATED, BadStream, ShutdownCut, ShutdownRequested
from kvfabric.ingest.metrics import CollectorMetrics
from kvfabric.ingest.queue import BatchQueue, BatchReceived, QueueClosed, StreamOpened
from kvfabric.ingest.source import SocketSource
from kvfabric.ingest.validate import BatchLimits, check_batch, parse_stream_meta

log = logging.getLogger("kvfabric.ingest")


@dataclass
class IngestContext:
    """What every connection shares: where batches go, limits, and the server's stop signal."""

    queue: BatchQueue
    metrics: CollectorMetrics
    limits: BatchLimits
    handshake_timeout_s: float
    stopping: threading.Event
    drain_deadline: list[float]  # one element, written by the server before it sets ``stopping``


def peer_label(sock: socket.socket, conn_no: int) -> str:
    """``conn#N pid=P uid=U`` from SO_PEERCRED (Unix socket clients have no address worth printing)."""
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, _gid = struct.unpack("3i", creds)
        return f"conn#{conn_no} pid={pid} uid={uid}"
    except (OSError, AttributeError):
        return f"conn#{conn_no}"


def serve_connection(sock: socket.socket, peer: str, ctx: IngestContext) -> None:
    """Read one stream from ``sock`` until it ends, is refused, or the collector stops; always closes ``sock``."""
    source = SocketSource(
        sock,
        max_read_bytes=ctx.limits.max_bytes,
        handshake_timeout_s=ctx.handshake_timeout_s,
        stopping=ctx.stopping,
        drain_deadline=ctx.drain_deadline,
    )
    label = peer
    batches = rows = 0
    opened = False
    try:
        try:
            reader = pa.ipc.open_stream(source)
        except (BadStream, ShutdownRequested, ShutdownCut):
            raise
        except Exception as e:
            if source.bytes_read == 0:  # a readiness probe or a client that changed its mind: not an error
                log.debug("%s closed without sending anything", peer)
                return
            reason = TRUNCATED if source.eof else GARBAGE
            raise BadStream(reason, f"cannot read the stream schema ({source.bytes_read} bytes): {e}") from e
        try:
            meta = parse_stream_meta(reader.schema)
        except BadStream:
            sid = (reader.schema.metadata or {}).get(S.META_STREAM_ID.encode())
            if sid is not None:  # name the stream in the refusal when it said who it is
                label = f"stream {sid.decode('utf-8', 'replace')[:80]!r} ({peer})"
            raise
        source.end_handshake()
        source.mark_boundary()
        label = f"stream {meta.stream_id!r} (run {meta.run_id!r}, engine {meta.engine!r}, {peer})"
        ctx.queue.put(StreamOpened(meta=meta, peer=peer))
        ctx.metrics.open_streams.inc()
        ctx.metrics.open_run(meta.run_id, meta.engine, meta.policy, meta.vllm_version, meta.block_size,
                             meta.num_blocks)
        opened = True
        log.info("%s connected (block_size %d, policy %r)", label, meta.block_size, meta.policy)
        while True:
            try:
                batch = reader.read_next_batch()
            except StopIteration:
                break
            except (BadStream, ShutdownRequested, ShutdownCut):
                raise
            except Exception as e:
                reason = TRUNCATED if source.eof else GARBAGE
                raise BadStream(reason, f"cannot decode the message after batch {batches}: {e}") from e
            source.mark_boundary()
            ctx.metrics.ingest_batches.inc()
            normalised, info = check_batch(batch, ctx.limits, meta)
            if info.rows == 0:
                continue
            ctx.queue.put(BatchReceived(stream_id=meta.stream_id, batch=normalised, info=info))
            batches += 1
            rows += info.rows
        log.info("%s ended after %d batches, %d rows", label, batches, rows)
    except BadStream as e:
        ctx.metrics.bad_streams.labels(reason=e.reason).inc()
        log.warning(
            "kvfabric ingest: refused %s: %s: %s (connection closed; %d batches, %d rows accepted before are kept)",
            label, e.reason, e.message, batches, rows,
        )
    except ShutdownRequested:
        log.info("%s closed by collector shutdown after %d batches, %d rows (nothing lost)", label, batches, rows)
    except ShutdownCut:
        log.warning(
            "%s cut by collector shutdown inside a batch after %d batches: that batch is lost and shows as a "
            "sequence gap when the stream reconnects", label, batches,
        )
    except QueueClosed:
        log.warning("%s: collector stopped before a batch could be queued; it shows as a sequence gap", label)
    finally:
        if opened:
            ctx.metrics.open_streams.dec()
        try:
            sock.close()
        except OSError:
            pass
