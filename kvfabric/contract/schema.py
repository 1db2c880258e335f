"""The event contract shared by the hook, the sinks, the collector and every query.

One wide table: every event is one row of :data:`EVENT_SCHEMA`, with the columns an event type does not use left
null. Column names are the public contract (docs/design.md §4); ``SCHEMA_VERSION`` changes whenever a column is added,
removed or retyped, and the collector refuses streams whose version it does not know.

Invariants:
  * the hook emits rows as plain tuples in :data:`COLUMNS` order *minus* ``seq`` (the sink stamps the batch
    sequence number), so the hot path never touches Arrow;
  * ``block_hash``/``parent_hash`` are signed 64-bit digests of vLLM's block hash (see :func:`hash64`), stable across
    processes when vLLM's own hash is (set ``PYTHONHASHSEED`` on vLLM 0.26).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence

import pyarrow as pa

SCHEMA_VERSION = 3

# Event types (docs/design.md §4). Strings, not an enum, because they are stored and queried as text.
PREFIX_LOOKUP = "prefix_lookup"
BLOCK_ALLOCATED = "block_allocated"
BLOCK_SEALED = "block_sealed"
BLOCK_TOUCHED = "block_touched"
REF_COUNT_CHANGED = "ref_count_changed"
BLOCK_FREED = "block_freed"
CACHE_ADMISSION_LIMITED = "cache_admission_limited"
EVICTION_CANDIDATES_RANKED = "eviction_candidates_ranked"
BLOCK_EVICTED = "block_evicted"
BLOCK_REBUILT = "block_rebuilt"
CACHE_RESET = "cache_reset"
SINK_DROPPED = "sink_dropped"
PREFIX_CACHE_COUNTERS = "prefix_cache_counters"  # an engine's own prefix-cache counters, per scrape (kv-events source)

# Why a block_evicted row's block lost its content (docs/design.md §4). ``pressure``: get_new_blocks reused it for a
# new allocation; ``connector``: a KV connector evicted it through evict_blocks; ``reset``: a prefix-cache reset
# dropped it (one row per cached block, before ``cache_reset``). Null means the emitter did not know.
EVICT_PRESSURE = "pressure"
EVICT_CONNECTOR = "connector"
EVICT_RESET = "reset"
EVICTION_REASONS: tuple[str, ...] = (EVICT_PRESSURE, EVICT_CONNECTOR, EVICT_RESET)

EVENT_TYPES: tuple[str, ...] = (
    PREFIX_LOOKUP,
    BLOCK_ALLOCATED,
    BLOCK_SEALED,
    BLOCK_TOUCHED,
    REF_COUNT_CHANGED,
    BLOCK_FREED,
    CACHE_ADMISSION_LIMITED,
    EVICTION_CANDIDATES_RANKED,
    BLOCK_EVICTED,
    BLOCK_REBUILT,
    CACHE_RESET,
    SINK_DROPPED,
    PREFIX_CACHE_COUNTERS,
)

# (name, type, meaning). Order is the tuple order the hook emits (``seq`` excluded, it is stamped by the sink).
_FIELDS: tuple[tuple[str, pa.DataType, str], ...] = (
    ("ts_ns", pa.int64(), "wall clock of the event, ns since the epoch"),
    ("step", pa.int64(), "scheduler step (calls to Scheduler.schedule) in this engine"),
    ("engine", pa.string(), "engine instance id and data-parallel rank"),
    ("run_id", pa.string(), "KVFABRIC_RUN_ID of the emitting process"),
    ("event", pa.string(), "event type, one of EVENT_TYPES"),
    ("request_id", pa.string(), "vLLM request id, null where vLLM gives no request (deferred frees)"),
    ("block_id", pa.int32(), "KV block id in the pool"),
    ("block_hash", pa.int64(), "64-bit digest of the block's vLLM hash"),
    ("parent_hash", pa.int64(), "digest of the previous block of the chain, null at the root"),
    ("family", pa.string(), "prefix family of the request that sealed the block (or of the request)"),
    ("depth", pa.int32(), "blocks from the root: the root block has depth 0"),
    ("ref_count", pa.int32(), "vLLM ref count after the event"),
    ("hit_count", pa.int32(), "prefix-cache hits on this block since it was sealed"),
    ("share_degree", pa.int32(), "distinct requests that used the block since it was sealed"),
    ("branch_factor", pa.int32(), "distinct child blocks seen sealed after this one"),
    ("prompt_tokens", pa.int32(), "prefix_lookup: prompt tokens of the request; prefix_cache_counters: the "
                                  "engine's prefix-cache queries (tokens) since the previous scrape"),
    ("hit_tokens", pa.int32(), "prefix_lookup: prompt tokens served from the prefix cache; prefix_cache_counters: "
                               "the engine's prefix-cache hits (tokens) since the previous scrape"),
    ("retain_score", pa.float64(), "policy's retain score (higher = keep)"),
    ("protected", pa.bool_(), "the policy marked the block protected at the event"),
    ("policy", pa.string(), "eviction policy in force"),
    ("count", pa.int64(), "sink_dropped: events lost; cache_admission_limited: blocks not cached; "
                          "eviction_candidates_ranked: candidates considered; prefix_lookup: regretful evictions"),
    ("age_ns", pa.int64(), "block_rebuilt: ns since its eviction; block_evicted: ns since its last use"),
    ("reason", pa.string(), "block_evicted: why the block lost its content: pressure, connector or reset"),
    # schema 3: where an event comes from and whose it is (appended: older columns keep their positions)
    ("host", pa.string(), "host name of the emitting machine (KVFABRIC_HOST, else socket.gethostname())"),
    ("dp_rank", pa.int32(), "vLLM data-parallel rank of the emitting engine (0 without data parallelism)"),
    ("tenant", pa.string(), "cache_salt of the request (or of the request that sealed the block); null: none"),
    ("lora", pa.string(), "LoRA adapter name of the request (or of the request that sealed the block); null: none"),
)

EMIT_COLUMNS: tuple[str, ...] = tuple(name for name, _, _ in _FIELDS)
"""Column order of the tuples the hook emits."""

COLUMNS: tuple[str, ...] = ("seq", *EMIT_COLUMNS)
"""Column order on the wire and in storage: the batch sequence number first."""

EVENT_SCHEMA = pa.schema(
    [pa.field("seq", pa.int64(), nullable=False)]
    + [pa.field(name, typ, nullable=name not in ("ts_ns", "event")) for name, typ, _ in _FIELDS]
)

COLUMN_DOCS: dict[str, str] = {"seq": "per-stream batch sequence number (gap detection)"} | {
    name: doc for name, _, doc in _FIELDS
}

# Keys of the schema metadata every stream starts with (bytes on the wire, str here).
META_SCHEMA_VERSION = "kvfabric.schema_version"
META_STREAM_ID = "kvfabric.stream_id"
META_ENGINE = "kvfabric.engine"
META_RUN_ID = "kvfabric.run_id"
META_VLLM_VERSION = "kvfabric.vllm_version"
META_BLOCK_SIZE = "kvfabric.block_size"
META_NUM_BLOCKS = "kvfabric.num_blocks"
META_POLICY = "kvfabric.policy"
META_SETTINGS = "kvfabric.settings"  # JSON object of the settings in force (HookSettings.as_metadata)
# Optional keys (absent from older hooks; not in REQUIRED_META): the per-stream constants of the ``host`` and
# ``dp_rank`` columns, stamped on every row by the expander.
META_HOST = "kvfabric.host"  # host name (KVFABRIC_HOST, else socket.gethostname()); = protocol.META_HOST
META_DP_RANK = "kvfabric.dp_rank"  # vLLM data-parallel rank, decimal
# Where a stream's events come from (optional; absent = ``plugin``): the hook inside vLLM, or vLLM's standard
# KV-event stream (``--kv-events-config``) that a collector subscribed to (kvfabric.kvevents).
META_SOURCE = "kvfabric.source"
SOURCE_PLUGIN = "plugin"
SOURCE_KV_EVENTS = "kv_events"
SOURCES: tuple[str, ...] = (SOURCE_PLUGIN, SOURCE_KV_EVENTS)
REQUIRED_META: tuple[str, ...] = (
    META_SCHEMA_VERSION,
    META_STREAM_ID,
    META_ENGINE,
    META_RUN_ID,
    META_BLOCK_SIZE,
    META_NUM_BLOCKS,
    META_POLICY,
)


def stream_schema(meta: dict[str, str]) -> pa.Schema:
    """The event schema carrying one stream's metadata (all values as strings)."""
    return EVENT_SCHEMA.with_metadata({k: str(v) for k, v in meta.items()})


def hash64(block_hash: object) -> int | None:
    """Signed 64-bit digest of a vLLM block hash (bytes in 0.26/0.33, int in older releases).

    vLLM's hashes are cryptographic digests (sha256 by default) optionally followed by a group id, so their first
    eight bytes are already uniformly distributed: taking them is enough and costs no hashing on the hot path.
    """
    if type(block_hash) is bytes:  # vLLM 0.26/0.33's BlockHash: the one type the hot path sees, checked first
        return int.from_bytes(block_hash[:8], "little", signed=True)
    if block_hash is None:
        return None
    if isinstance(block_hash, (bytes, bytearray, memoryview)):
        return int.from_bytes(bytes(block_hash[:8]), "little", signed=True)
    if isinstance(block_hash, int):
        v = block_hash & 0xFFFFFFFFFFFFFFFF
        return v - (1 << 64) if v >= 1 << 63 else v
    inner = getattr(block_hash, "block_hash", None)  # old BlockHashWithGroupId namedtuple
    if inner is not None and inner is not block_hash:
        return hash64(getattr(inner, "hash_value", inner))
    return hash64(hash(block_hash))


def hash64_all(block_hashes: Sequence[object]) -> list[int | None]:
    """:func:`hash64` of each of ``block_hashes``, in one call (a record's worth on the hot path), so the two agree
    on every input. The usual record (vLLM's hashes: bytes of one length, at least 8) is read in one ``struct``
    call over their concatenation; anything else goes value by value."""
    n = len(block_hashes)
    if n > 1:
        try:
            lengths = set(map(len, block_hashes))
            joined = b"".join(block_hashes)  # type: ignore[arg-type]
        except TypeError:  # (a None, an int or a str among them)
            lengths = set()
        if len(lengths) == 1 and (size := lengths.pop()) >= 8:
            unpack = _UNPACKERS.get((n, size))
            if unpack is None:
                if len(_UNPACKERS) >= 512:  # (bounded: one per record length seen)
                    _UNPACKERS.clear()
                unpack = _UNPACKERS[n, size] = struct.Struct("<" + f"q{size - 8}x" * n).unpack
            return list(unpack(joined))
    from_bytes = int.from_bytes
    return [from_bytes(h[:8], "little", signed=True) if type(h) is bytes else hash64(h)  # type: ignore[index]
            for h in block_hashes]


_UNPACKERS: dict[tuple[int, int], Callable[[bytes], tuple[int, ...]]] = {}
"""``hash64_all``'s readers, by (hashes, bytes each)."""


def family_of_hash(h: int) -> str:
    """Family id derived from a block digest: 16 hex digits, stable and short enough to read."""
    return f"{h & 0xFFFFFFFFFFFFFFFF:016x}"
