"""vLLM's KV-event wire format, decoded with msgspec as vLLM encodes it (``vllm/distributed/kv_events.py``).

A message is three ZMQ frames: ``topic``, ``seq`` (8 bytes, big-endian, unsigned) and the msgpack payload of a
``KVEventBatch``: an array ``[ts, events, data_parallel_rank]`` (the rank omitted when None). Each event is a tagged
struct, the tag being the class name, in one of two encodings:

  * map: ``{"type": "BlockStored", "block_hashes": [...], ...}`` (vLLM 0.26 and 0.33; fields at their defaults
    omitted);
  * array: ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, ...]`` (older
    vLLM and SGLang; trailing fields at their defaults omitted).

:data:`BLOCK_STORED_FIELDS` and :data:`BLOCK_REMOVED_FIELDS` declare each event's fields once, in vLLM's order,
and both encodings are built from them. Fields this collector does not read are :class:`msgspec.Raw` (kept
undecoded: ``token_ids`` costs nothing, and their type is never checked). Unknown fields (a newer vLLM's) are
ignored in both encodings, missing trailing ones take their defaults, and an event of an unknown type is skipped
and counted (:attr:`DecodedBatch.unknown_events`). Anything else is a :class:`WireError` with a reason of
:data:`DECODE_ERROR_REASONS`: the message is counted and dropped, nothing else is affected.

Block hashes are ints (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``, vLLM's default: the last 8 bytes of the sha256
digest, big-endian) or bytes (``=0``: the digest itself).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

# Why a message could not be used (kvfabric_kv_events_decode_errors_total{reason}).
FRAMES = "frames"  # not three frames, or a seq frame that is not 8 bytes
GARBAGE = "garbage"  # not msgpack
TRUNCATED = "truncated"  # msgpack cut short
SHAPE = "shape"  # msgpack, but not a KVEventBatch (or an event of a known type with fields of the wrong type)
TOPIC = "topic"  # a topic other than the spec's (ZMQ matches subscriptions by prefix)
DECODE_ERROR_REASONS: tuple[str, ...] = (FRAMES, GARBAGE, TRUNCATED, SHAPE, TOPIC)

STORED = "BlockStored"
REMOVED = "BlockRemoved"
CLEARED = "AllBlocksCleared"
EVENT_KINDS: tuple[str, ...] = (STORED, REMOVED, CLEARED)

END_SEQ = 0xFFFF_FFFF_FFFF_FFFF
"""The replay socket's end marker: seq -1 as 8 signed bytes (read unsigned, like every seq)."""

BlockHash = int | bytes
_RAW = msgspec.Raw()

BLOCK_STORED_FIELDS: tuple[tuple[str, Any, Any], ...] = (
    ("block_hashes", list[BlockHash], msgspec.NODEFAULT),
    ("parent_block_hash", BlockHash | None, None),
    ("token_ids", msgspec.Raw, _RAW),
    ("block_size", int, 0),  # 0: the publisher did not say
    ("lora_id", msgspec.Raw, _RAW),
    ("medium", str | None, None),
    ("lora_name", str | None, None),
    ("extra_keys", msgspec.Raw, _RAW),  # read only for a chain's first block (its cache_salt), see convert.py
    ("group_idx", int | None, None),
    ("kv_cache_spec_kind", msgspec.Raw, _RAW),
    ("kv_cache_spec_sliding_window", msgspec.Raw, _RAW),
    ("locality", msgspec.Raw, _RAW),
    ("ownership", msgspec.Raw, _RAW),  # vLLM 0.33
    ("session_id", msgspec.Raw, _RAW),  # vLLM 0.33
    ("lookahead_token_ids", msgspec.Raw, _RAW),  # vLLM 0.33
)
"""BlockStored's fields in vLLM's order (0.26: up to ``locality``; 0.33 adds the last three)."""

BLOCK_REMOVED_FIELDS: tuple[tuple[str, Any, Any], ...] = (
    ("block_hashes", list[BlockHash], msgspec.NODEFAULT),
    ("medium", str | None, None),
    ("group_idx", int | None, None),
    ("locality", msgspec.Raw, _RAW),
    ("ownership", msgspec.Raw, _RAW),  # vLLM 0.33
)


def _event_types(array_like: bool) -> tuple[type, type, type]:
    def make(name: str, fields: tuple[tuple[str, Any, Any], ...]) -> type:
        spec = [(n, t) if d is msgspec.NODEFAULT else (n, t, d) for n, t, d in fields]
        return msgspec.defstruct(("Array" if array_like else "Map") + name, spec, tag=name, tag_field="type",
                                 array_like=array_like, gc=False)

    return make(STORED, BLOCK_STORED_FIELDS), make(REMOVED, BLOCK_REMOVED_FIELDS), make(CLEARED, ())


MapBlockStored, MapBlockRemoved, MapAllBlocksCleared = _event_types(array_like=False)
ArrayBlockStored, ArrayBlockRemoved, ArrayAllBlocksCleared = _event_types(array_like=True)
KIND: dict[type, str] = {
    MapBlockStored: STORED, MapBlockRemoved: REMOVED, MapAllBlocksCleared: CLEARED,
    ArrayBlockStored: STORED, ArrayBlockRemoved: REMOVED, ArrayAllBlocksCleared: CLEARED,
}
"""Decoded event class -> its kind (both encodings have the same attribute names)."""

_MAP_EVENT = MapBlockStored | MapBlockRemoved | MapAllBlocksCleared  # type: ignore[operator]
_ARRAY_EVENT = ArrayBlockStored | ArrayBlockRemoved | ArrayAllBlocksCleared  # type: ignore[operator]


def _batch_type(name: str, events: Any) -> type:
    return msgspec.defstruct(name, [("ts", float), ("events", list[events]),
                                    ("data_parallel_rank", int | None, None)], array_like=True, gc=False)


_MAP_BATCH = msgspec.msgpack.Decoder(_batch_type("MapKVEventBatch", _MAP_EVENT))
_ARRAY_BATCH = msgspec.msgpack.Decoder(_batch_type("ArrayKVEventBatch", _ARRAY_EVENT))
_RAW_BATCH = msgspec.msgpack.Decoder(_batch_type("RawKVEventBatch", msgspec.Raw))
_MAP_ONE = msgspec.msgpack.Decoder(_MAP_EVENT)
_ARRAY_ONE = msgspec.msgpack.Decoder(_ARRAY_EVENT)
_ANY = msgspec.msgpack.Decoder()
_MAP_HEADS = frozenset([*range(0x80, 0x90), 0xDE, 0xDF])
_ARRAY_HEADS = frozenset([*range(0x90, 0xA0), 0xDC, 0xDD])


class WireError(ValueError):
    """A message that cannot be used: ``reason`` is one of :data:`DECODE_ERROR_REASONS`."""

    def __init__(self, reason: str, message: str) -> None:
        assert reason in DECODE_ERROR_REASONS, reason
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class DecodedBatch:
    """One ``KVEventBatch``: ``events`` are Map*/Array* structs (see :data:`KIND`), in the publisher's order."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None
    unknown_events: int = 0  # events of a type this collector does not know, skipped


@dataclass(frozen=True)
class Message:
    """One ZMQ message of the stream (live or replayed)."""

    topic: bytes
    seq: int
    payload: bytes


def split_message(frames: list[bytes]) -> Message:
    """``(topic, seq, payload)`` frames -> :class:`Message`; raises :class:`WireError` (``frames``)."""
    if len(frames) != 3:
        raise WireError(FRAMES, f"a message of {len(frames)} frames (expected topic, seq, payload)")
    topic, seq, payload = frames
    if len(seq) != 8:
        raise WireError(FRAMES, f"a seq frame of {len(seq)} bytes (expected 8, big-endian)")
    return Message(topic, int.from_bytes(seq, "big"), payload)


def decode_batch(payload: bytes) -> DecodedBatch:
    """A payload -> :class:`DecodedBatch`; raises :class:`WireError` (``garbage``, ``truncated``, ``shape``).

    The whole batch is decoded in one msgspec call in the usual case (every event in one encoding, every type
    known); otherwise event by event, to skip unknown types and to say which event is malformed."""
    for decoder in (_MAP_BATCH, _ARRAY_BATCH):
        try:
            b = decoder.decode(payload)
        except msgspec.ValidationError:
            continue
        except msgspec.DecodeError as e:
            raise _undecodable(e, len(payload)) from e
        return DecodedBatch(b.ts, b.events, b.data_parallel_rank)
    return _decode_event_by_event(payload)


def _decode_event_by_event(payload: bytes) -> DecodedBatch:
    try:
        b = _RAW_BATCH.decode(payload)
    except msgspec.ValidationError as e:
        raise WireError(SHAPE, f"not a KVEventBatch [ts, events, data_parallel_rank]: {e}") from e
    except msgspec.DecodeError as e:  # (the first two decoders would have raised it already)
        raise _undecodable(e, len(payload)) from e
    events: list[Any] = []
    unknown = 0
    for i, raw in enumerate(b.events):
        data = memoryview(raw)
        head = data[0] if len(data) else -1
        decoder = _MAP_ONE if head in _MAP_HEADS else _ARRAY_ONE if head in _ARRAY_HEADS else None
        if decoder is None:
            raise WireError(SHAPE, f"event {i} is neither a map nor an array")
        try:
            events.append(decoder.decode(data))
        except msgspec.ValidationError as e:
            tag = _tag(data)
            if isinstance(tag, str) and tag not in EVENT_KINDS:
                unknown += 1  # a newer publisher's event type: skipped, counted
                continue
            raise WireError(SHAPE, f"event {i}: {e}") from e
    return DecodedBatch(b.ts, events, b.data_parallel_rank, unknown)


def _tag(data: memoryview) -> object:
    value = _ANY.decode(data)
    if isinstance(value, dict):
        return value.get("type")
    if isinstance(value, list) and value:
        return value[0]
    return None


def _undecodable(e: msgspec.DecodeError, size: int) -> WireError:
    if "truncated" in str(e).lower():
        return WireError(TRUNCATED, f"msgpack payload of {size} bytes cut short ({e})")
    return WireError(GARBAGE, f"payload of {size} bytes is not msgpack ({e})")


def cache_salt(extra_keys: msgspec.Raw, block: int, lora_name: str | None) -> str | None:
    """The ``cache_salt`` among a chain's first block's extra keys, when it can be told apart, else None.

    vLLM 0.26 and 0.33 publish, per block, the LoRA name (when the request has one), multimodal keys as
    ``[identifier, offset]`` pairs, the cache salt (first block only) and prompt-embedding digests as bytes: after
    the LoRA name, the salt is the only string. So: the one string left, if exactly one is left."""
    if not len(extra_keys):
        return None
    try:
        keys = _ANY.decode(extra_keys)
    except msgspec.DecodeError:
        return None
    if not isinstance(keys, list) or block >= len(keys) or not isinstance(keys[block], list):
        return None
    strings = [k for k in keys[block] if isinstance(k, str)]
    if lora_name is not None and strings and strings[0] == lora_name:
        strings.pop(0)
    return strings[0] if len(strings) == 1 else None
