"""The collector's defaults, one table: every default of a ``kvfabric collector`` flag, of
:class:`~kvfabric.ingest.IngestSettings` and of the ingest classes' keyword arguments is read from here, and nowhere
else declares a number of its own. It sits in ``ingest`` because the collector imports ingest, never the reverse.

Limits that are part of the wire contract (largest batch, longest label) are the contract's
(:mod:`kvfabric.contract.protocol`); this table refers to them.
"""

from __future__ import annotations

from kvfabric.contract import protocol as P

# ---- where the collector listens and stores ----
DB_PATH = "kvfabric.duckdb"
HTTP_HOST = "127.0.0.1"  # loopback: a wider bind needs a token (kvfabric.collector.config.check_http_exposure)
HTTP_PORT = 8321
SOCKET_MODE = 0o600  # owner only; 0o660 lets the socket's group stream too
MEMORY_LIMIT = "256MB"  # DuckDB's cache otherwise grows with the file, up to 80 % of RAM (collector_memory.md)

# ---- connections ----
MAX_CONNECTIONS = 64
HANDSHAKE_TIMEOUT_S = 10.0
DRAIN_TIMEOUT_S = 5.0
MESSAGE_TIMEOUT_S = 30.0
IDLE_TIMEOUT_S = 300.0

# ---- what one batch, and all connections together, may hold ----
MAX_BATCH_ROWS = P.MAX_BATCH_ROWS
MAX_BATCH_BYTES = P.MAX_BATCH_BYTES
MAX_STRING_BYTES = 4096
MAX_BUFFERED_BYTES = 512 * 1024 * 1024  # partly received messages, all connections together

# ---- the writer ----
QUEUE_MAX_ROWS = 2_000_000
QUEUE_MAX_BYTES = 512 * 1024 * 1024
COALESCE_ROWS = 245_760
COALESCE_MS = 100
GAP_GRACE_S = 5.0

# ---- retention and compaction (both backends; run by the writer thread) ----
RETAIN_S = 7 * 86400.0  # --retain 7d: events older than this are deleted; 0 keeps everything
MAINTENANCE_INTERVAL_S = 300.0  # how often retention and compaction run
