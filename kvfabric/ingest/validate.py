"""Validation of what a sink sends: the stream's schema + metadata, then each record batch.

Everything here is pure (no I/O) so it can be tested without sockets. Checks are vectorised (pyarrow.compute on
whole columns), never per row, because they run on the ingest hot path.

Refusals come in two sizes: :class:`BadStream` (the schema or the framing is unusable: the connection closes) and
:class:`BadBatch` (one batch's content breaks the contract: only that batch is refused, counted, and the stream goes
on, because the Arrow framing around it is intact).

Invariants a batch that passes :func:`check_batch` guarantees to the writer:
  * its schema is exactly :data:`kvfabric.contract.schema.EVENT_SCHEMA` (normalised: nullability flags and metadata
    of the sender are dropped), so batches of different streams concatenate without casts;
  * every row's ``run_id`` and ``engine`` equal the stream metadata's (nulls are filled in with them);
  * ``seq``, ``ts_ns`` and ``event`` hold no nulls, ``seq`` is one non-negative value over the batch, and every
    ``event`` is one of :data:`kvfabric.contract.schema.EVENT_TYPES`: the INSERT into DuckDB's NOT NULL columns
    cannot fail;
  * every non-null ``reason`` is one of :data:`kvfabric.contract.schema.EVICTION_REASONS` (it becomes a metric label).
  * every string is valid UTF-8 and at most ``max_string_bytes`` long (DuckDB would refuse invalid UTF-8 and abort
    the whole coalesced transaction; a 100 MiB request id would be stored and served back by the API).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvfabric.contract import protocol as P
from kvfabric.contract import schema as S
from kvfabric.ingest import defaults as D
from kvfabric.ingest.errors import (
    INVALID_UTF8,
    OVERSIZED,
    SCHEMA_MISMATCH,
    SCHEMA_VERSION,
    VALUE_TOO_LONG,
    BadBatch,
    BadStream,
)

MAX_META_VALUE_CHARS = P.MAX_META_VALUE_CHARS  # (kvfabric.contract.protocol: the hook checks its settings against them)
MAX_SETTINGS_CHARS = P.MAX_SETTINGS_CHARS

_KNOWN_EVENTS = frozenset(S.EVENT_TYPES)
_KNOWN_REASONS = frozenset(S.EVICTION_REASONS)
_EVENT = S.COLUMNS.index("event")
_FREE_TEXT_COLUMNS = tuple(
    i for i, f in enumerate(S.EVENT_SCHEMA) if f.type == pa.string() and f.name not in ("event", "run_id", "engine")
)
"""String columns whose values are not known in advance (request_id, family, policy): validated in full."""


def _free_text(col: pa.Array, name: str, seq: int) -> int:
    """Check a free-text string column; return the byte length of its longest value.

    Works on the offsets and data buffers with numpy: ASCII-only data (every byte < 0x80, the usual case) is
    valid UTF-8 without further work; anything else is validated in full by Arrow."""
    _, off_buf, data_buf = col.buffers()
    offsets = np.frombuffer(off_buf, dtype=np.int32, count=len(col) + 1, offset=col.offset * 4)
    first, last = int(offsets[0]), int(offsets[-1])
    if first < 0 or last < first or last > (data_buf.size if data_buf is not None else 0):
        raise BadBatch(SCHEMA_MISMATCH, f"column {name} has inconsistent offsets", seq)
    if last > first and np.frombuffer(data_buf, dtype=np.uint8, count=last - first, offset=first).max() >= 0x80:
        _checked_text(col, name, seq, decode=False)
    lengths = np.diff(offsets)
    if lengths.min() < 0:
        raise BadBatch(SCHEMA_MISMATCH, f"column {name} has inconsistent offsets", seq)
    return int(lengths.max())


def _checked_text(values: pa.Array, name: str, seq: int, *, decode: bool = True) -> list[object]:
    """``values`` as Python strings, after checking they are valid UTF-8 (else :class:`BadBatch`)."""
    try:
        values.validate(full=True)
    except pa.ArrowInvalid as e:
        if "utf8" in str(e).lower():
            raise BadBatch(INVALID_UTF8, f"column {name} holds invalid UTF-8 ({e})", seq) from e
        raise BadBatch(SCHEMA_MISMATCH, f"column {name} is malformed ({e})", seq) from e
    return values.to_pylist() if decode else []


@dataclass(frozen=True)
class StreamMeta:
    """The metadata a stream starts with (docs/design.md §4), parsed and checked."""

    stream_id: str
    engine: str
    run_id: str
    schema_version: int
    block_size: int
    num_blocks: int
    policy: str
    vllm_version: str | None = None
    settings: str | None = None  # JSON text, as sent
    protocol: int = 1  # metadata kvfabric.protocol: 2 = the collector acknowledges commits (contract/protocol.py)
    host: str | None = None  # metadata kvfabric.host (optional: absent from older hooks)
    dp_rank: int | None = None  # metadata kvfabric.dp_rank (optional)
    source: str = S.SOURCE_PLUGIN  # metadata kvfabric.source (absent: the plugin); kv_events: kvfabric.kvevents


@dataclass(frozen=True)
class BatchLimits:
    """Caps on one record batch: over ``max_rows``/``max_bytes`` the stream is refused (``oversized``); a string
    value over ``max_string_bytes`` refuses that batch only (``value_too_long``)."""

    max_rows: int = D.MAX_BATCH_ROWS
    max_bytes: int = D.MAX_BATCH_BYTES
    max_string_bytes: int = D.MAX_STRING_BYTES


@dataclass(frozen=True)
class BatchInfo:
    """What the writer needs to know about a checked batch without looking at it again."""

    seq: int
    rows: int
    nbytes: int
    min_ts_ns: int
    max_ts_ns: int


def _same_columns(schema: pa.Schema) -> str | None:
    """None when ``schema`` has EVENT_SCHEMA's names and types in order (metadata and nullability ignored)."""
    got = [(f.name, f.type) for f in schema]
    want = [(f.name, f.type) for f in S.EVENT_SCHEMA]
    if got == want:
        return None
    got_names = [n for n, _ in got]
    want_names = [n for n, _ in want]
    if got_names != want_names:
        missing = [n for n in want_names if n not in got_names]
        extra = [n for n in got_names if n not in want_names]
        if missing or extra:
            return f"columns differ: missing {missing}, unexpected {extra}"
        return "columns are in a different order than kvfabric.contract.schema.COLUMNS"
    bad = [f"{n}: {t} (expected {w})" for (n, t), (_, w) in zip(got, want, strict=True) if t != w]
    return "column types differ: " + "; ".join(bad)


def _decode(metadata: dict[bytes, bytes] | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in (metadata or {}).items():
        try:
            out[k.decode("utf-8")] = v.decode("utf-8")
        except UnicodeDecodeError as e:
            raise BadStream(INVALID_UTF8, f"schema metadata is not valid UTF-8 (key {k[:40]!r}: {e})") from e
    return out


def _positive_int(meta: dict[str, str], key: str) -> int:
    try:
        value = int(meta[key])
    except ValueError as e:
        raise BadStream(SCHEMA_MISMATCH, f"metadata {key}={meta[key][:40]!r} is not an integer") from e
    if value <= 0:
        raise BadStream(SCHEMA_MISMATCH, f"metadata {key}={value} must be positive")
    return value


def parse_stream_meta(schema: pa.Schema) -> StreamMeta:
    """Check a stream's schema against the contract and return its metadata.

    Order of checks matters for the reported reason: a sender of another schema version most likely also has other
    columns, and "wrong version" is the message that tells its operator what to do.
    """
    meta = _decode(schema.metadata)
    if S.META_SCHEMA_VERSION not in meta:
        raise BadStream(SCHEMA_MISMATCH, f"schema metadata lacks {S.META_SCHEMA_VERSION}")
    raw_version = meta[S.META_SCHEMA_VERSION]
    try:
        version = int(raw_version)
    except ValueError as e:
        raise BadStream(SCHEMA_VERSION, f"schema version {raw_version[:40]!r} is not an integer") from e
    if version != S.SCHEMA_VERSION:
        raise BadStream(
            SCHEMA_VERSION, f"schema version {version} is not supported (this collector speaks {S.SCHEMA_VERSION})"
        )
    problem = _same_columns(schema)
    if problem:
        raise BadStream(SCHEMA_MISMATCH, problem)
    missing = [k for k in S.REQUIRED_META if not meta.get(k)]
    if missing:
        raise BadStream(SCHEMA_MISMATCH, f"schema metadata lacks {', '.join(missing)}")
    for key, value in meta.items():
        limit = MAX_SETTINGS_CHARS if key == S.META_SETTINGS else MAX_META_VALUE_CHARS
        if len(value) > limit:
            raise BadStream(SCHEMA_MISMATCH, f"metadata {key} is {len(value)} characters (limit {limit})")
    raw_protocol = meta.get(P.META_PROTOCOL, "1")
    try:
        protocol = int(raw_protocol)
    except ValueError:
        protocol = -1
    if protocol not in P.SUPPORTED_PROTOCOLS:
        raise BadStream(
            SCHEMA_VERSION,
            f"protocol {raw_protocol[:40]!r} is not supported (this collector speaks {P.SUPPORTED_PROTOCOLS})",
        )
    settings = meta.get(S.META_SETTINGS)
    if settings is not None:
        try:
            json.loads(settings)
        except ValueError as e:
            raise BadStream(SCHEMA_MISMATCH, f"metadata {S.META_SETTINGS} is not JSON") from e
    source = meta.get(S.META_SOURCE) or S.SOURCE_PLUGIN
    if source not in S.SOURCES:
        raise BadStream(SCHEMA_MISMATCH, f"metadata {S.META_SOURCE}={source[:40]!r} is not one of {S.SOURCES}")
    raw_rank = meta.get(S.META_DP_RANK)
    dp_rank = None
    if raw_rank:
        try:
            dp_rank = int(raw_rank)
        except ValueError as e:
            raise BadStream(SCHEMA_MISMATCH, f"metadata {S.META_DP_RANK}={raw_rank[:40]!r} is not an integer") from e
        if not 0 <= dp_rank < 2**31:
            raise BadStream(SCHEMA_MISMATCH, f"metadata {S.META_DP_RANK}={dp_rank} is out of range")
    return StreamMeta(
        stream_id=meta[S.META_STREAM_ID],
        engine=meta[S.META_ENGINE],
        run_id=meta[S.META_RUN_ID],
        schema_version=version,
        block_size=_positive_int(meta, S.META_BLOCK_SIZE),
        num_blocks=_positive_int(meta, S.META_NUM_BLOCKS),
        policy=meta[S.META_POLICY],
        vllm_version=meta.get(S.META_VLLM_VERSION) or None,
        settings=settings,
        protocol=protocol,
        host=meta.get(S.META_HOST) or None,
        dp_rank=dp_rank,
        source=source,
    )


def check_batch(
    batch: pa.RecordBatch, limits: BatchLimits, meta: StreamMeta
) -> tuple[pa.RecordBatch, BatchInfo]:
    """Check one batch of an already accepted stream; return it normalised to EVENT_SCHEMA plus its summary.

    Every row must carry the stream's ``run_id`` and ``engine`` (a null is filled in with the stream's value; another
    value refuses the batch): the ``streams`` table is then an exact index of the events (run listings and
    block-size joins rely on it).

    Raises :class:`BadStream` (``oversized``: the connection closes) or :class:`BadBatch` (``invalid_utf8``,
    ``value_too_long``, ``schema_mismatch``: only this batch is refused). Empty batches are legal and carry no
    sequence number: callers skip them (``BatchInfo.seq`` is -1).
    """
    rows = batch.num_rows
    nbytes = batch.nbytes
    if rows > limits.max_rows:
        raise BadStream(OVERSIZED, f"batch of {rows} rows exceeds the limit of {limits.max_rows}")
    if nbytes > limits.max_bytes:
        raise BadStream(OVERSIZED, f"batch of {nbytes} bytes exceeds the limit of {limits.max_bytes}")
    if rows == 0:
        return batch, BatchInfo(seq=-1, rows=0, nbytes=0, min_ts_ns=0, max_ts_ns=0)
    try:  # buffer sizes against lengths and offsets (cheap; the content checks below rely on it)
        batch.validate()
    except pa.ArrowInvalid as e:
        raise BadBatch(SCHEMA_MISMATCH, f"malformed batch ({e})") from e
    seq_col = batch.column(0)
    if seq_col.null_count:
        raise BadBatch(SCHEMA_MISMATCH, f"column seq holds {seq_col.null_count} nulls (not nullable)")
    seq_range = pc.min_max(seq_col).as_py()
    if seq_range["min"] != seq_range["max"]:
        raise BadBatch(SCHEMA_MISMATCH, f"seq varies inside one batch ({seq_range['min']}..{seq_range['max']})")
    seq = int(seq_range["min"])
    if seq < 0:
        raise BadBatch(SCHEMA_MISMATCH, f"seq {seq} is negative")
    # No string reaches Python (where a bad byte raises UnicodeDecodeError) or DuckDB (which refuses invalid UTF-8
    # at INSERT time, aborting the transaction of every batch coalesced with it) unchecked. Columns with known
    # values are checked on their few distinct values (event) or compared as bytes with the stream's (run_id,
    # engine: equal to a valid string means valid); the free-text ones are scanned with numpy (ASCII needs no
    # more) and their longest value is capped. Cost measured: ~0.05 us a row.
    columns = batch.columns
    ts_col = batch.column(1)
    event_col = batch.column(_EVENT)
    for name, col in (("ts_ns", ts_col), ("event", event_col)):
        if col.null_count:
            raise BadBatch(SCHEMA_MISMATCH, f"column {name} holds {col.null_count} nulls (not nullable)", seq)
    unknown = set(_checked_text(pc.unique(event_col), "event", seq)) - _KNOWN_EVENTS  # a dozen values at most
    if unknown:
        shown = sorted(str(u)[:40] for u in unknown)[:5]
        raise BadBatch(SCHEMA_MISMATCH, f"unknown event types {shown}", seq)
    reason_col = batch.column(S.COLUMNS.index("reason"))
    if reason_col.null_count < rows:
        # Eviction reasons become a metric label: only the documented values may enter (bounded cardinality).
        bad_reasons = set(_checked_text(pc.unique(reason_col).drop_null(), "reason", seq)) - _KNOWN_REASONS
        if bad_reasons:
            shown = sorted(str(u)[:40] for u in bad_reasons)[:5]
            raise BadBatch(SCHEMA_MISMATCH, f"unknown eviction reasons {shown} (known: {sorted(_KNOWN_REASONS)})",
                           seq)
    for name, want in (("run_id", meta.run_id), ("engine", meta.engine)):
        i = S.COLUMNS.index(name)
        col = columns[i]
        if col.null_count:  # a row that does not say is the stream's (costs a copy of this column only)
            col = columns[i] = pc.fill_null(col, want)
        same = pc.equal(col, want)
        if not pc.all(same).as_py():
            others = _checked_text(pc.unique(pc.filter(col, pc.invert(same))), name, seq)
            shown = [str(v)[:40] for v in others[:3]]
            raise BadBatch(SCHEMA_MISMATCH, f"rows carry {name} {shown} but the stream metadata says {want!r}", seq)
    for i in _FREE_TEXT_COLUMNS:
        col = columns[i]
        if col.null_count == len(col):
            continue
        longest = _free_text(col, S.COLUMNS[i], seq)
        if longest > limits.max_string_bytes:
            raise BadBatch(
                VALUE_TOO_LONG,
                f"column {S.COLUMNS[i]} holds a value of {longest} bytes (limit {limits.max_string_bytes})",
                seq,
            )
    ts_range = pc.min_max(ts_col).as_py()
    normalised = pa.RecordBatch.from_arrays(columns, schema=S.EVENT_SCHEMA)
    return normalised, BatchInfo(
        seq=seq,
        rows=rows,
        nbytes=nbytes,
        min_ts_ns=int(ts_range["min"]),
        max_ts_ns=int(ts_range["max"]),
    )
