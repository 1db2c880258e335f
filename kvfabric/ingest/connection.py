"""One sink connection: read one Arrow IPC stream, validate it, hand its batches to the writer queue.

Whatever a peer sends, the outcome is confined to its own connection:
  * a refused or cut stream produces one log line naming the peer/stream and the reason (rate-limited per reason,
    lines left out are counted), one increment of ``kvfabric_bad_streams_total{reason}``, and the connection
    closes; batches queued before the problem are kept (they are committed like any other);
  * a batch whose *content* breaks the contract (invalid UTF-8, a value over the string cap, unknown event types,
    ...) is refused alone: counted in ``kvfabric_refused_batches_total{reason}`` and the stream's
    ``refused_rows``, answered with ``REFUSED seq`` (protocol 2), and the stream goes on with its next batch;
  * a quiet connection may be closed at a message boundary (idle, or evicted to make room): nothing is lost.

With protocol 2 (kvfabric/contract/protocol.py) the connection sends HELLO as soon as the schema is accepted, and the
writer acknowledges committed batches through the connection's :class:`~kvfabric.ingest.acks.AckChannel`.

The stream is entered in the collector's list of engines (:class:`~kvfabric.ingest.engines.EngineRegistry`) when
its schema is accepted, before any batch: the hook connects when vLLM builds its scheduler, so an engine is listed
before its first request. Each batch queued adds to its count; how the connection ended (by the engine's side, or
closed by this collector) decides whether it is shown as idle or disconnected.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

import pyarrow as pa

from kvfabric.contract import schema as S
from kvfabric.contract.protocol import PeerCredentials, peer_credentials
from kvfabric.ingest import defaults as D
from kvfabric.ingest.acks import AckChannel
from kvfabric.ingest.engines import EngineRegistry
from kvfabric.ingest.errors import (
    ACKS_NOT_READ,
    GARBAGE,
    SCHEMA_MISMATCH,
    TRUNCATED,
    BadBatch,
    BadStream,
    ConnectionClosed,
    ShutdownCut,
    ShutdownRequested,
)
from kvfabric.ingest.metrics import CollectorMetrics
from kvfabric.ingest.queue import BatchQueue, BatchReceived, BatchRefused, QueueClosed, StreamOpened
from kvfabric.ingest.ratelimit import RateLimitedLog
from kvfabric.ingest.source import SocketSource
from kvfabric.ingest.validate import BatchLimits, check_batch, parse_stream_meta

__all__ = ["IngestContext", "PeerCredentials", "peer_credentials", "peer_label", "serve_connection"]

log = logging.getLogger("kvfabric.ingest")

_STOP = (BadStream, ShutdownRequested, ShutdownCut, ConnectionClosed)


@dataclass
class IngestContext:
    """What every connection shares: where batches go, limits, deadlines, and the server's stop signal."""

    queue: BatchQueue
    metrics: CollectorMetrics
    limits: BatchLimits
    handshake_timeout_s: float
    stopping: threading.Event
    drain_deadline: list[float]  # one element, written by the server before it sets ``stopping``
    resume_seq: Callable[[str], int] = lambda _stream_id: -1  # HELLO's value (the writer's committed state)
    message_timeout_s: float = D.MESSAGE_TIMEOUT_S
    idle_timeout_s: float = D.IDLE_TIMEOUT_S
    rlog: RateLimitedLog | None = None
    engines: EngineRegistry | None = None  # the streams this collector holds, for GET /api/v1/engines

    def log(self, level: int, key: str, msg: str, *args: object) -> None:
        if self.rlog is None:
            log.log(level, msg, *args)
        else:
            self.rlog.log(level, key, msg, *args)


def peer_label(sock: socket.socket, conn_no: int) -> str:
    """``conn#N pid=P uid=U`` from SO_PEERCRED (Unix socket clients have no address worth printing)."""
    creds = peer_credentials(sock)
    if creds is None:
        return f"conn#{conn_no}"
    return f"conn#{conn_no} pid={creds.pid} uid={creds.uid}"


def serve_connection(sock: socket.socket, source: SocketSource, peer: str, ctx: IngestContext) -> None:
    """Read one stream from ``sock`` until it ends, is refused, or the collector stops; always closes ``sock``."""
    label = peer
    batches = rows = 0
    opened = False
    ack: AckChannel | None = None
    stream_id = ""
    # How the connection ended, for the list of engines: whether this collector closed it, and why.
    by_collector, why = True, "the connection ended"
    try:
        try:
            reader = pa.ipc.open_stream(source)
        except _STOP:
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
        if meta.protocol >= 2:
            ack = AckChannel(sock)
            channel = ack

            def poll() -> None:
                channel.flush()
                if channel.stalled:
                    raise BadStream(ACKS_NOT_READ, "the peer does not read its acknowledgements")

            source.on_poll = poll
            ack.hello(ctx.resume_seq(meta.stream_id))
        ctx.queue.put(StreamOpened(meta=meta, peer=peer))
        ctx.metrics.open_streams.inc()
        ctx.metrics.open_run(meta.run_id, meta.engine, meta.policy, meta.vllm_version, meta.block_size,
                             meta.num_blocks)
        opened = True
        stream_id = meta.stream_id
        if ctx.engines is not None:
            creds = peer_credentials(sock)
            raw = {k.decode("utf-8", "replace"): v.decode("utf-8", "replace")
                   for k, v in (reader.schema.metadata or {}).items()}
            ctx.engines.opened(meta, raw, creds.pid if creds is not None else 0)
        log.info("%s connected (block_size %d, policy %r, protocol %d)", label, meta.block_size, meta.policy,
                 meta.protocol)
        while True:
            try:
                batch = reader.read_next_batch()
            except StopIteration:
                break
            except _STOP:
                raise
            except Exception as e:
                reason = TRUNCATED if source.eof else GARBAGE
                raise BadStream(reason, f"cannot decode the message after batch {batches}: {e}") from e
            source.mark_boundary()
            ctx.metrics.ingest_batches.inc()
            try:
                normalised, info = check_batch(batch, ctx.limits, meta)
            except BadBatch as e:
                _refuse_batch(ctx, label, meta.stream_id, batch.num_rows, e, ack)
                continue
            except BadStream:
                raise
            except Exception as e:  # whatever else a crafted batch provokes stays a counted refusal
                bad = BadBatch(SCHEMA_MISMATCH, f"unreadable batch ({type(e).__name__}: {e})")
                _refuse_batch(ctx, label, meta.stream_id, batch.num_rows, bad, ack)
                continue
            if info.rows == 0:
                continue
            ctx.queue.put(BatchReceived(stream_id=meta.stream_id, batch=normalised, info=info, ack=ack))
            batches += 1
            rows += info.rows
            if ctx.engines is not None:
                ctx.engines.received(meta.stream_id, info.seq, info.rows)
        by_collector, why = False, "the engine ended its stream"
        log.info("%s ended after %d batches, %d rows", label, batches, rows)
    except BadStream as e:
        # A stream cut off by its peer (its process died mid-message) ended on the engine's side.
        by_collector, why = not source.eof, f"{e.reason}: {e.message}"
        ctx.metrics.bad_streams.labels(reason=e.reason).inc()
        ctx.log(
            logging.WARNING, f"stream:{e.reason}",
            "kvfabric ingest: refused %s: %s: %s (connection closed; %d batches, %d rows accepted before are kept)",
            label, e.reason, e.message, batches, rows,
        )
    except ConnectionClosed as e:
        why = e.message
        ctx.metrics.connections_closed.labels(reason=e.reason).inc()
        ctx.log(logging.INFO, f"closed:{e.reason}", "%s %s (%d batches, %d rows on it; nothing lost)", label,
                e.message, batches, rows)
    except ShutdownRequested:
        why = "the collector stopped"
        log.info("%s closed by collector shutdown after %d batches, %d rows (nothing lost)", label, batches, rows)
    except ShutdownCut:
        why = "the collector stopped"
        log.warning(
            "%s cut by collector shutdown inside a batch after %d batches: that batch was not received (a "
            "protocol-2 sink resends it to the next collector)", label, batches,
        )
    except QueueClosed:
        why = "the collector stopped"
        log.warning("%s: collector stopped before a batch could be queued (a protocol-2 sink resends it)", label)
    finally:
        if ack is not None:
            ack.close()
        source.release()
        if opened:
            ctx.metrics.open_streams.dec()
            if ctx.engines is not None:
                ctx.engines.closed(stream_id, by_collector=by_collector, why=why)
        try:
            sock.close()
        except OSError:
            pass


def _refuse_batch(
    ctx: IngestContext, label: str, stream_id: str, nrows: int, e: BadBatch, ack: AckChannel | None
) -> None:
    """One batch refused for its content: log (rate-limited), tell a protocol-2 sink, let the writer count it."""
    ctx.log(
        logging.WARNING, f"batch:{e.reason}",
        "kvfabric ingest: refused batch seq %s of %s: %s: %s (%d rows not stored, counted; the stream goes on)",
        e.seq if e.seq is not None else "?", label, e.reason, e.message, nrows,
    )
    if ack is not None and e.seq is not None:
        ack.refused(e.seq)
    ctx.queue.put(BatchRefused(stream_id=stream_id, seq=e.seq, refused_rows=nrows, reason=e.reason, ack=ack))
