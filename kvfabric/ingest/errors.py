"""Why a stream, a batch or a connection was refused or cut: the ``reason`` labels of the collector's metrics.

The reasons are part of the metric contract (docs/metrics.md). A refused stream never affects other streams or rows
already committed, only the connection it came on; a refused batch costs only its own rows (they are counted).
"""

from __future__ import annotations

# kvfabric_bad_streams_total{reason}: the connection is closed.
GARBAGE = "garbage"
SCHEMA_VERSION = "schema_version"
SCHEMA_MISMATCH = "schema_mismatch"
OVERSIZED = "oversized"
HANDSHAKE_TIMEOUT = "handshake_timeout"
TRUNCATED = "truncated"
SLOW_MESSAGE = "slow_message"
INVALID_UTF8 = "invalid_utf8"
ACKS_NOT_READ = "acks_not_read"

BAD_STREAM_REASONS: tuple[str, ...] = (
    GARBAGE,
    SCHEMA_VERSION,
    SCHEMA_MISMATCH,
    OVERSIZED,
    HANDSHAKE_TIMEOUT,
    TRUNCATED,
    SLOW_MESSAGE,
    INVALID_UTF8,
    ACKS_NOT_READ,
)

# kvfabric_refused_batches_total{reason}: one batch is not stored (its rows are counted), the stream goes on.
VALUE_TOO_LONG = "value_too_long"
STORE_FAILED = "store_failed"
UNDECODABLE = "undecodable"  # a KV-event message (kvfabric.kvevents) whose payload could not be decoded
REFUSED_BATCH_REASONS: tuple[str, ...] = (INVALID_UTF8, VALUE_TOO_LONG, SCHEMA_MISMATCH, STORE_FAILED, UNDECODABLE)

# kvfabric_connections_refused_total{reason}: closed right after accept(), before anything is read.
CONNECTION_LIMIT = "connection_limit"
PEER_NOT_ALLOWED = "peer_not_allowed"
REFUSED_CONNECTION_REASONS: tuple[str, ...] = (CONNECTION_LIMIT, PEER_NOT_ALLOWED)

# kvfabric_connections_closed_total{reason}: a healthy but quiet connection closed by the collector at a message
# boundary (nothing is lost; a sink reconnects when it has something to send).
IDLE = "idle"
EVICTED = "evicted"
CLOSED_CONNECTION_REASONS: tuple[str, ...] = (IDLE, EVICTED)


class BadStream(Exception):
    """A stream the collector refuses (or cuts): ``reason`` is one of :data:`BAD_STREAM_REASONS`."""

    def __init__(self, reason: str, message: str) -> None:
        if reason not in BAD_STREAM_REASONS:
            raise ValueError(f"unknown bad-stream reason {reason!r}")
        super().__init__(message)
        self.reason = reason
        self.message = message


class BadBatch(Exception):
    """One record batch the collector refuses while the stream goes on: ``reason`` in :data:`REFUSED_BATCH_REASONS`.

    ``seq`` is the batch's sequence number when it could be read (None when the ``seq`` column itself is bad).
    """

    def __init__(self, reason: str, message: str, seq: int | None = None) -> None:
        if reason not in REFUSED_BATCH_REASONS:
            raise ValueError(f"unknown refused-batch reason {reason!r}")
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.seq = seq


class ConnectionClosed(Exception):
    """The collector closes a quiet connection at a message boundary (``reason``: CLOSED_CONNECTION_REASONS)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


class ShutdownRequested(Exception):
    """The collector is stopping and the connection reached a point where it can end without losing a batch."""


class ShutdownCut(Exception):
    """The collector is stopping and the drain deadline passed in the middle of a batch (that batch is lost)."""
