"""vLLM's KV-event wire format, decoded: vLLM 0.33's own structs (map-encoded, with its three new fields), vLLM
0.26's field set (map-encoded), the array form of older vLLM and SGLang, fields and event types this collector does
not know; and every kind of unusable message classified, never raised as anything else."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from vllm.distributed import kv_events as v033

from kvfabric.ingest.metrics import KV_DECODE_ERROR_REASONS, KV_EVENT_KINDS
from kvfabric.kvevents import wire
from kvfabric.kvevents.wire import WireError, cache_salt, decode_batch, split_message

pytestmark = pytest.mark.vllm

ENC = msgspec.msgpack.Encoder()


# vLLM 0.26.0's events, field for field (vllm/distributed/kv_events.py of that release): map-encoded, tagged.
class _Event026(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(_Event026):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None


class BlockRemoved(_Event026):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None


class AllBlocksCleared(_Event026):
    pass


class Batch026(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def test_vllm_033_batches_decode_with_every_field_this_collector_reads() -> None:
    digest = bytes(range(32))
    batch = v033.KVEventBatch(ts=12.5, data_parallel_rank=3, events=[
        v033.BlockStored(block_hashes=[digest, 2**64 - 1], parent_block_hash=7, token_ids=list(range(32)),
                         block_size=16, lora_id=4, medium="GPU", lora_name="ad", extra_keys=[("ad", "salt"), None],
                         group_idx=1, kv_cache_spec_kind="full", ownership="o", session_id="s",
                         lookahead_token_ids=[[1], [2]]),
        v033.BlockRemoved(block_hashes=[digest], medium="GPU", group_idx=1, ownership="o"),
        v033.AllBlocksCleared(),
    ])
    assert set(msgspec.msgpack.decode(ENC.encode(batch))[1][0]) >= {"type", "ownership", "session_id"}  # a map
    got = decode_batch(ENC.encode(batch))
    assert (got.ts, got.data_parallel_rank, got.unknown_events) == (12.5, 3, 0)
    stored, removed, _cleared = got.events
    assert [wire.KIND[type(e)] for e in got.events] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert (stored.block_hashes, stored.parent_block_hash, stored.block_size, stored.lora_name, stored.medium,
            stored.group_idx) == ([digest, 2**64 - 1], 7, 16, "ad", "GPU", 1)
    assert cache_salt(stored.extra_keys, 0, stored.lora_name) == "salt"
    assert (removed.block_hashes, removed.medium, removed.group_idx) == ([digest], "GPU", 1)


def test_vllm_026_batches_decode() -> None:
    batch = Batch026(ts=1.0, events=[
        BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=[0] * 32, block_size=16, lora_id=None,
                    medium="GPU", lora_name=None, extra_keys=[("salt-26",), None], locality="LOCAL"),
        BlockRemoved(block_hashes=[1], medium="GPU"), AllBlocksCleared()])
    got = decode_batch(ENC.encode(batch))
    assert got.data_parallel_rank is None
    assert [wire.KIND[type(e)] for e in got.events] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert got.events[0].block_hashes == [1, 2] and got.events[0].parent_block_hash is None
    assert cache_salt(got.events[0].extra_keys, 0, None) == "salt-26"


@pytest.mark.parametrize("events", [
    [["BlockStored", [1, 2], None, [0] * 32, 16, None, "GPU"], ["BlockRemoved", [1], "GPU"], ["AllBlocksCleared"]],
    [["BlockStored", [1, 2], None, [0] * 32, 16, None], ["BlockRemoved", [1]], ["AllBlocksCleared"]],  # no medium
    # trailing fields of a newer publisher: ignored
    [["BlockStored", [1, 2], None, [0] * 32, 16, None, "GPU", None, None, 0, "full", None, None, "x", "y", "z", 9],
     ["BlockRemoved", [1], "GPU", 0, None, None, "extra"], ["AllBlocksCleared", "extra"]],
])
def test_the_array_form_of_older_vllm_and_sglang_decodes(events: list[Any]) -> None:
    got = decode_batch(ENC.encode([3.0, events, 0]))
    assert [wire.KIND[type(e)] for e in got.events] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert (got.events[0].block_hashes, got.events[0].block_size, got.events[1].block_hashes) == ([1, 2], 16, [1])


def test_unknown_fields_are_ignored_and_unknown_event_types_skipped_and_counted() -> None:
    events = [{"type": "BlockStored", "block_hashes": [5], "parent_block_hash": None, "token_ids": [],
               "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None, "a_future_field": [1, 2]},
              {"type": "BlockMoved", "block_hashes": [5]},
              ["BlockRemoved", [5], "GPU"],  # (both encodings in one batch)
              ["BlockPinned", 1]]
    got = decode_batch(ENC.encode([1.0, events]))
    assert [wire.KIND[type(e)] for e in got.events] == ["BlockStored", "BlockRemoved"]
    assert got.unknown_events == 2


@pytest.mark.parametrize(("payload", "reason"), [
    (b"", "truncated"),
    (b"\xc1", "garbage"),
    (b"\x93\xcb\x00", "truncated"),
    (ENC.encode([1.0, [{"type": "BlockStored", "block_hashes": [1]}]])[:-1], "truncated"),
    (ENC.encode({"ts": 1.0}), "shape"),
    (ENC.encode([1.0, "events"]), "shape"),
    (ENC.encode(["now", []]), "shape"),
    (ENC.encode([1.0, [{"type": "BlockStored", "block_hashes": "x"}]]), "shape"),  # a known type, wrong field type
    (ENC.encode([1.0, [["BlockRemoved"]]]), "shape"),  # a required field missing
    (ENC.encode([1.0, [7]]), "shape"),
    (ENC.encode([1.0, []]) + b"\x00", "garbage"),  # trailing bytes
])
def test_an_unusable_payload_is_one_classified_error(payload: bytes, reason: str) -> None:
    with pytest.raises(WireError) as e:
        decode_batch(payload)
    assert e.value.reason == reason and str(e.value)


def test_frames_are_checked() -> None:
    msg = split_message([b"kv", (2**64 - 2).to_bytes(8, "big"), b"x"])
    assert (msg.topic, msg.seq, msg.payload) == (b"kv", 2**64 - 2, b"x")
    for frames in ([b"kv", b"\x00" * 8], [b"kv", b"\x00" * 7, b"p"], [b"a", b"b", b"c", b"d"]):
        with pytest.raises(WireError) as e:
            split_message(frames)
        assert e.value.reason == "frames"


def test_the_metric_labels_are_the_wire_reasons_and_kinds() -> None:
    assert wire.DECODE_ERROR_REASONS == KV_DECODE_ERROR_REASONS and wire.EVENT_KINDS == KV_EVENT_KINDS
