"""Why a stream was refused or cut: the ``reason`` label of ``kvfabric_bad_streams_total``.

The reasons are part of the metric contract (docs/metrics.md); a refused stream never affects other streams or
rows already committed, only the connection it came on.
"""

from __future__ import annotations

GARBAGE = "garbage"
SCHEMA_VERSION = "schema_version"
SCHEMA_MISMATCH = "schema_mismatch"
OVERSIZED = "oversized"
HANDSHAKE_TIMEOUT = "handshake_timeout"
TRUNCATED = "truncated"

BAD_STREAM_REASONS: tuple[str, ...] = (
    GARBAGE,
    SCHEMA_VERSION,
    SCHEMA_MISMATCH,
    OVERSIZED,
    HANDSHAKE_TIMEOUT,
    TRUNCATED,
)


class BadStream(Exception):
    """A stream the collector refuses (or cuts): ``reason`` is one of :data:`BAD_STREAM_REASONS`."""

    def __init__(self, reason: str, message: str) -> None:
        if reason not in BAD_STREAM_REASONS:
            raise ValueError(f"unknown bad-stream reason {reason!r}")
        super().__init__(message)
        self.reason = reason
        self.message = message


class ShutdownRequested(Exception):
    """The collector is stopping and the connection reached a point where it can end without losing a batch."""


class ShutdownCut(Exception):
    """The collector is stopping and the drain deadline passed in the middle of a batch (that batch is lost)."""
