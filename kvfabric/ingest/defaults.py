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

# ---- vLLM's KV-event stream (--kv-events; kvfabric.kvevents) ----
KV_EVENTS_RCVHWM = 10_000  # messages (batches) the SUB socket holds; past it ZMQ drops (the gap is then counted)
KV_EVENTS_REPLAY_TIMEOUT_S = 2.0  # longest wait for the replay socket's next frame before giving the range up
KV_EVENTS_REPLAY_ATTEMPTS = 3  # replay requests for one hole, as long as each one brings something
KV_EVENTS_RECONNECT_MS = (100, 2000)  # ZMQ's reconnect interval to a publisher that went away: first, longest
KV_EVENTS_EVICTED_MEMORY = 1_000_000  # evicted digests remembered for rebuilt detection: the expander's default
KV_EVENTS_KNOWN_MEMORY = 1 << 19  # digests whose depth, family and owner are remembered (parents of later blocks)
KV_EVENTS_LIVE_MEMORY = 1 << 20  # cached digests (with their copy counts) remembered for reset evictions
ENGINE_METRICS_INTERVAL_S = 5.0  # how often an engine's /metrics is read for its prefix-cache counters
ENGINE_METRICS_TIMEOUT_S = 2.0
