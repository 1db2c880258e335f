"""Validation, queueing and parameter parsing as pure functions (no sockets, no processes)."""

from __future__ import annotations

import threading
import time

import pyarrow as pa
import pytest
from support.collector_testkit import batch, meta

from kvfabric.contract import schema as S
from kvfabric.ingest.errors import (
    INVALID_UTF8,
    OVERSIZED,
    SCHEMA_MISMATCH,
    SCHEMA_VERSION,
    VALUE_TOO_LONG,
    BadBatch,
    BadStream,
)
from kvfabric.ingest.queue import BatchQueue, BatchReceived
from kvfabric.ingest.validate import BatchInfo, BatchLimits, StreamMeta, check_batch, parse_stream_meta
from kvfabric.queries import BadParameter, Cursor, parse_block_hash

META = StreamMeta("s", "e0", "r", 1, 16, 100, "lru")


def _reason(fn, *args) -> str:
    with pytest.raises((BadStream, BadBatch)) as info:
        fn(*args)
    return info.value.reason


def test_a_sink_schema_is_accepted_and_its_metadata_parsed() -> None:
    m = parse_stream_meta(S.stream_schema(meta("s1", "runA", "e0", block_size=32)))
    assert (m.stream_id, m.run_id, m.engine, m.block_size, m.num_blocks, m.policy) == (
        "s1", "runA", "e0", 32, 1000, "lru",
    )
    assert m.vllm_version == "0.33.0" and m.settings == '{"policy": "lru"}'


def test_nullability_flags_of_the_sender_do_not_matter() -> None:
    sent = S.stream_schema(meta("s", "r", "e"))
    relaxed = pa.schema([f.with_nullable(True) for f in S.EVENT_SCHEMA], metadata=sent.metadata)
    assert parse_stream_meta(relaxed).stream_id == "s"


@pytest.mark.parametrize(
    ("schema", "reason"),
    [
        (S.stream_schema(meta("s", "r", "e", version=S.SCHEMA_VERSION + 1)), SCHEMA_VERSION),
        (S.stream_schema(meta("s", "r", "e", version="one")), SCHEMA_VERSION),
        (S.EVENT_SCHEMA, SCHEMA_MISMATCH),  # no metadata at all
        (S.EVENT_SCHEMA.remove(3).with_metadata(meta("s", "r", "e")), SCHEMA_MISMATCH),
        (S.EVENT_SCHEMA.set(1, pa.field("ts_ns", pa.int32())).with_metadata(meta("s", "r", "e")), SCHEMA_MISMATCH),
        (S.stream_schema({**meta("s", "r", "e"), S.META_BLOCK_SIZE: "0"}), SCHEMA_MISMATCH),
        (S.stream_schema({k: v for k, v in meta("s", "r", "e").items() if k != S.META_POLICY}), SCHEMA_MISMATCH),
        (S.stream_schema({**meta("s", "r", "e"), S.META_SETTINGS: "{not json"}), SCHEMA_MISMATCH),
    ],
    ids=["version-2", "version-text", "no-metadata", "missing-column", "retyped-column", "block-size-0",
         "no-policy", "settings-not-json"],
)
def test_bad_schemas_are_refused_with_their_reason(schema: pa.Schema, reason: str) -> None:
    assert _reason(parse_stream_meta, schema) == reason


def test_a_valid_batch_is_normalised_and_summarised() -> None:
    b = batch([{"ts_ns": 5, "event": "block_evicted", "run_id": "r", "engine": "e0"},
               {"ts_ns": 3, "event": "prefix_lookup", "run_id": "r", "engine": "e0"}], seq=7)
    out, info = check_batch(b, BatchLimits(), META)
    assert info == BatchInfo(seq=7, rows=2, nbytes=b.nbytes, min_ts_ns=3, max_ts_ns=5)
    assert out.schema.equals(S.EVENT_SCHEMA, check_metadata=True)


@pytest.mark.parametrize(
    ("rows", "seq_override", "reason"),
    [
        ([{"ts_ns": 1, "event": "no_such_event"}], None, SCHEMA_MISMATCH),
        ([{"ts_ns": 1, "event": None}], None, SCHEMA_MISMATCH),
        ([{"ts_ns": None, "event": "cache_reset"}], None, SCHEMA_MISMATCH),
        ([{"ts_ns": 1, "event": "cache_reset", "run_id": "other"}], None, SCHEMA_MISMATCH),
        ([{"ts_ns": 1, "event": "cache_reset"}] * 2, [0, 1], SCHEMA_MISMATCH),
        ([{"ts_ns": 1, "event": "cache_reset"}] * 3, None, OVERSIZED),
    ],
    ids=["unknown-event", "null-event", "null-ts", "foreign-run", "seq-varies", "too-many-rows"],
)
def test_bad_batches_are_refused(rows, seq_override, reason) -> None:
    rows = [{"run_id": "r", "engine": "e0", **r} for r in rows]
    b = batch(rows, seq=1)
    if seq_override is not None:
        b = b.set_column(0, "seq", pa.array(seq_override, pa.int64()))
    assert _reason(check_batch, b, BatchLimits(max_rows=2), META) == reason


def _with_bytes(b: pa.RecordBatch, column: str, raw: bytes) -> pa.RecordBatch:
    """``b`` with ``column`` replaced by string values holding ``raw`` (no UTF-8 check on the way in)."""
    i = S.COLUMNS.index(column)
    values = pa.array([raw] * b.num_rows, pa.binary()).view(pa.string())
    return b.set_column(i, S.EVENT_SCHEMA.field(i), values)


@pytest.mark.parametrize("column", ["event", "run_id", "engine", "request_id", "family", "policy"])
def test_invalid_utf8_in_any_string_column_refuses_the_batch_only(column: str) -> None:
    b = batch([{"ts_ns": 1, "event": "cache_reset", "run_id": "r", "engine": "e0"}], seq=3)
    with pytest.raises(BadBatch) as info:
        check_batch(_with_bytes(b, column, b"\xff\xfeok"), BatchLimits(), META)
    assert info.value.reason == INVALID_UTF8 and info.value.seq == 3 and column in info.value.message


def test_invalid_utf8_in_metadata_refuses_the_stream_naming_the_cause() -> None:
    schema = S.EVENT_SCHEMA.with_metadata({**{k.encode(): v.encode() for k, v in meta("s", "r", "e").items()},
                                           S.META_ENGINE.encode(): b"\xc3\x28"})
    with pytest.raises(BadStream) as info:
        parse_stream_meta(schema)
    assert info.value.reason == INVALID_UTF8 and "not valid UTF-8" in info.value.message


def test_a_string_over_the_cap_refuses_the_batch() -> None:
    b = batch([{"ts_ns": 1, "event": "cache_reset", "run_id": "r", "engine": "e0", "request_id": "x" * 101}], seq=0)
    assert _reason(check_batch, b, BatchLimits(max_string_bytes=100), META) == VALUE_TOO_LONG
    check_batch(b, BatchLimits(max_string_bytes=101), META)  # at the cap: accepted


def test_rows_without_run_or_engine_take_the_streams() -> None:
    b = batch([{"ts_ns": 1, "event": "cache_reset"}, {"ts_ns": 2, "event": "cache_reset", "engine": "e0"}], seq=0)
    out, _ = check_batch(b, BatchLimits(), META)
    assert out.column(S.COLUMNS.index("run_id")).to_pylist() == ["r", "r"]
    assert out.column(S.COLUMNS.index("engine")).to_pylist() == ["e0", "e0"]


def test_queue_blocks_producers_beyond_its_bound_and_coalesces_for_the_writer() -> None:
    q = BatchQueue(max_rows=10, max_bytes=1 << 30)
    b = batch([{"ts_ns": 1, "event": "cache_reset"}] * 4, seq=0)
    item = BatchReceived("s", b, BatchInfo(0, 4, b.nbytes, 1, 1))
    q.put(item)
    q.put(item)  # 8 rows queued
    third_done = threading.Event()

    def producer() -> None:
        q.put(item)  # would make 12 > 10: must wait for the consumer
        third_done.set()

    t = threading.Thread(target=producer)
    t.start()
    time.sleep(0.2)
    assert not third_done.is_set(), "put beyond the row bound must block (backpressure)"
    taken = q.get_many(target_rows=8, window_s=0.0)
    assert taken is not None and len(taken) == 2
    assert third_done.wait(2.0)
    t.join()
    q.close()
    assert q.get_many(8, 0.0) == [item]  # what was queued before close is still delivered
    assert q.get_many(8, 0.0) is None


def test_block_hash_forms() -> None:
    assert parse_block_hash("-5") == -5
    assert parse_block_hash("+1234567890123456") == 1234567890123456  # signed decimal, not hex
    assert parse_block_hash("ffffffffffffffff") == -1  # 16 hex digits = family-id form
    assert parse_block_hash(S.family_of_hash(-42)) == -42
    assert parse_block_hash("0x10") == 16
    for bad in ("xyz", "0x1" + "0" * 16, "99999999999999999999", ""):
        with pytest.raises(BadParameter):
            parse_block_hash(bad)


def test_cursor_round_trip_and_garbage() -> None:
    c = Cursor(ts_ns=1_700_000_000_000_000_123, row_key=42)
    assert Cursor.decode(c.encode()) == Cursor(1_700_000_000_000_000_123, 42)
    for bad in ("zzz", "", "djI6MTox"):  # the last is base64 of "v2:1:1"
        with pytest.raises(BadParameter):
            Cursor.decode(bad)
    # Forged cursors whose numbers do not fit a BIGINT are refused before any SQL runs.
    for ts, key in ((1 << 63, 1), (-(1 << 63) - 1, 1), (1, 1 << 63), (1, -1)):
        with pytest.raises(BadParameter, match="out of range"):
            Cursor.decode(Cursor(ts, key).encode())
