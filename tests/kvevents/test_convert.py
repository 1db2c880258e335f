"""The conversion of KV events into event rows (docs/design.md §4, "vLLM's KV events"), on hand-built batches, and
against the plugin's expander: on one simulated block pool, both sources write the same sealed, evicted, rebuilt and
reset rows (the same hashes, parents, depths, families, rebuild ages)."""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from typing import Any

import msgspec
import pyarrow as pa
import pytest

from kvfabric.contract import records as R
from kvfabric.contract import schema as S
from kvfabric.kvevents.convert import Converter, digest
from kvfabric.kvevents.wire import decode_batch
from kvfabric.lifecycle.expander import Expander

NS = 1_000_000_000
COL = {name: i for i, name in enumerate(S.EMIT_COLUMNS)}


def stored(hashes: list[Any], parent: Any = None, **extra: Any) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": [0] * 16 * len(hashes), "block_size": 16, "lora_id": None, "medium": "GPU",
            "lora_name": None, **extra}


def removed(hashes: list[Any], medium: str | None = "GPU") -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}


CLEARED = {"type": "AllBlocksCleared"}


def convert(conv: Converter, ts_s: int, *events: dict[str, Any], rank: int | None = None) -> list[dict[str, Any]]:
    batch = decode_batch(msgspec.msgpack.encode([float(ts_s), list(events), rank]))
    return [dict(zip(S.EMIT_COLUMNS, row, strict=True)) for row in conv.convert(batch).rows()]


def pick(rows: list[dict[str, Any]], *names: str) -> list[tuple]:
    return [tuple(r[n] for n in names) for r in rows]


def fam(h: int) -> str:
    return S.family_of_hash(h)


def test_stored_blocks_are_sealed_along_their_chain_with_depth_family_tenant_and_lora() -> None:
    conv = Converter(engine="e", run_id="r", host="h")
    rows = convert(conv, 1, stored([1, 2], extra_keys=[["adapter", "salt-a"], None], lora_name="adapter"),
                   stored([3], 2, lora_name="adapter"), rank=2)
    assert pick(rows, "event", "block_hash", "parent_hash", "depth", "family", "tenant", "lora") == [
        ("block_sealed", 1, None, 0, fam(1), "salt-a", "adapter"),
        ("block_sealed", 2, 1, 1, fam(1), "salt-a", "adapter"),
        ("block_sealed", 3, 2, 2, fam(1), "salt-a", "adapter"),
    ]
    assert {(r["ts_ns"], r["engine"], r["run_id"], r["host"], r["dp_rank"], r["step"], r["block_id"], r["policy"])
            for r in rows} == {(NS, "e", "r", "h", 2, None, None, None)}
    # A second child of 2: its branch factor shows on the rows written after.
    rows = convert(conv, 2, stored([4], 2), removed([2]))
    assert pick(rows, "event", "block_hash", "branch_factor", "depth", "reason", "age_ns") == [
        ("block_sealed", 4, 0, 2, None, None), ("block_evicted", 2, 2, 1, None, None)]


def test_a_block_whose_parent_is_unknown_has_no_depth_family_or_tenant() -> None:
    conv = Converter(engine="e", run_id="r")
    rows = convert(conv, 1, stored([7, 8], 99, extra_keys=[["salt"], None]))
    assert pick(rows, "block_hash", "parent_hash", "depth", "family", "tenant") == [
        (7, 99, None, None, None), (8, 7, None, None, None)]


@pytest.mark.parametrize(("keys", "lora", "tenant"), [
    (["s1"], None, "s1"),
    (["ad", "s1"], "ad", "s1"),
    (["ad", ["mm-hash", 0], "s1", b"embeds"], "ad", "s1"),  # multimodal pair and prompt-embeds digest
    (["ad"], "ad", None),  # the LoRA name only: no salt
    (["a", "b"], None, None),  # two strings: cannot tell which is the salt
    ([["mm-hash", 3]], None, None),
])
def test_the_tenant_is_the_root_blocks_one_salt_string(keys: list[Any], lora: str | None,
                                                        tenant: str | None) -> None:
    rows = convert(Converter(engine="e", run_id="r"), 1, stored([1], extra_keys=[keys], lora_name=lora))
    assert rows[0]["tenant"] == tenant


def test_removed_then_stored_again_is_rebuilt_with_its_age_as_the_expander_counts_it() -> None:
    conv = Converter(engine="e", run_id="r")
    convert(conv, 1, stored([1, 2]))
    assert pick(convert(conv, 3, removed([2])), "event", "block_hash", "depth", "family") == [
        ("block_evicted", 2, 1, fam(1))]
    rows = convert(conv, 10, stored([2], 1))
    assert pick(rows, "event", "block_hash", "age_ns") == [("block_sealed", 2, None), ("block_rebuilt", 2, 7 * NS)]
    assert pick(convert(conv, 11, stored([2], 1)), "event") == [("block_sealed",)]  # the rebuild counted once


def test_copies_are_counted_and_a_reset_evicts_each_live_copy_then_resets() -> None:
    conv = Converter(engine="e", run_id="r")
    convert(conv, 1, stored([1, 2]), stored([1, 2]))  # two copies (two requests computed the same prefix)
    convert(conv, 2, removed([2]))  # one copy of 2 left
    rows = convert(conv, 3, CLEARED)
    assert pick(rows, "event", "block_hash", "reason") == [
        ("block_evicted", 1, "reset"), ("block_evicted", 1, "reset"), ("block_evicted", 2, "reset"),
        ("cache_reset", None, None)]
    assert rows[-1]["count"] is None
    assert pick(convert(conv, 4, CLEARED), "event") == [("cache_reset",)]  # nothing live any more
    assert pick(convert(conv, 5, stored([1])), "event", "age_ns") == [("block_sealed", None),
                                                                      ("block_rebuilt", 2 * NS)]


def test_removal_of_a_hash_never_seen_stored_is_an_eviction_all_the_same() -> None:
    rows = convert(Converter(engine="e", run_id="r"), 1, removed([5]))
    assert pick(rows, "event", "block_hash", "parent_hash", "depth", "family") == [
        ("block_evicted", 5, None, None, None)]


def test_other_media_are_skipped_and_counted() -> None:
    conv = Converter(engine="e", run_id="r")
    batch = decode_batch(msgspec.msgpack.encode([1.0, [stored([1], medium="CPU"), removed([1], medium="STORAGE"),
                                                       stored([2], medium=None)]]))
    out = conv.convert(batch)
    assert (out.skipped_medium, list(out.columns()["event"]), out.events) == (2, ["block_sealed"], {"BlockStored": 2,
                                                                                 "BlockRemoved": 1})


def test_every_map_is_bounded_oldest_first() -> None:
    conv = Converter(engine="e", run_id="r", evicted_memory=2, known_memory=3, live_memory=2)
    convert(conv, 1, stored([1]), stored([2]), stored([3]))
    assert len(conv.live) == 2 and conv.forgotten_live == 1 and list(conv.live) == [2, 3]
    convert(conv, 2, removed([1, 2, 3]))
    assert list(conv.evicted) == [2, 3]  # 1 forgotten: storing it again is not a rebuild
    assert pick(convert(conv, 3, stored([1]), stored([3])), "event", "block_hash") == [
        ("block_sealed", 1), ("block_sealed", 3), ("block_rebuilt", 3)]
    assert len(conv.known) == 3


def test_bytes_hashes_give_the_plugins_digest_and_ints_their_signed_value() -> None:
    raw = hashlib.sha256(b"block").digest()
    assert digest(raw) == S.hash64(raw)  # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0: exactly the plugin's digest
    as_int = int.from_bytes(raw, "big") & (2**64 - 1)  # vLLM's maybe_convert_block_hash (=1, its default)
    assert digest(as_int) == int.from_bytes(raw[-8:], "big", signed=True)
    assert digest(2**64 - 1) == -1 and digest(5) == 5


def test_rows_and_record_batch_agree() -> None:
    conv = Converter(engine="e", run_id="r", host="h")
    batch = decode_batch(msgspec.msgpack.encode([2.5, [stored([1, 2], extra_keys=[["t"], None]), removed([2]),
                                                       CLEARED], 3]))
    out = conv.convert(batch)
    record = out.record_batch(seq=7)
    assert record.schema.equals(S.EVENT_SCHEMA)
    table = pa.Table.from_batches([record])
    assert [tuple(r.values()) for r in table.to_pylist()] == [(7, *row) for row in out.rows()]


# ---- against the plugin's expander ---------------------------------------------------------------------------

def _raw(*parts: object) -> bytes:
    return hashlib.sha256(repr(parts).encode()).digest()


def _pool_run(steps: int, seed: int) -> tuple[list[list[tuple]], list[list[dict[str, Any]]]]:
    """One block pool driven by random requests: per step, the plugin's call records and vLLM's KV events of the
    same calls (get_new_blocks evicting cached blocks, cache_full_blocks storing, a twin computing the same
    prefix into other blocks, frees, a prefix-cache reset now and then)."""
    rng = random.Random(seed)
    n = 32
    free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, n))
    hash_of: dict[int, bytes] = {}
    cached: dict[bytes, list[int]] = {}
    ref = [0] * n
    records: list[list[tuple]] = []
    events: list[list[dict[str, Any]]] = []
    for step in range(steps):
        ts = (step + 1) * NS
        recs: list[tuple] = []
        evs: list[dict[str, Any]] = []
        held: list[list[int]] = []
        for r in range(rng.choice((1, 2))):
            rid = f"s{step}r{r}"
            f, tail, length = rng.randrange(4), rng.randrange(3), rng.randint(1, 5)
            chain = [_raw(f, d) if d < 2 else _raw(f, tail, d) for d in range(length)]
            copies = 2 if rng.random() < 0.15 else 1
            hits: list[int] = []
            for h in chain:
                if not cached.get(h):
                    break
                hits.append(cached[h][0])
            k = len(hits)
            for _copy in range(copies):
                for b in hits:
                    free.pop(b, None)
                    ref[b] += 1
                if hits:
                    recs.append((R.TOUCHED, ts, step, rid, hits, [ref[b] for b in hits]))
                ids = [free.popitem(last=False)[0] for _ in chain[k:]]
                for b in ids:
                    if b in hash_of:  # get_new_blocks evicts what the block cached
                        h = hash_of.pop(b)
                        cached[h].remove(b)
                        evs.append(removed([h]))
                    ref[b] = 1
                recs.append((R.ALLOCATED, ts, step, rid, ids, None))
                if ids:
                    parent = chain[k - 1] if k else None
                    recs.append((R.SEALED, ts, step, rid, S.family_of_hash(S.hash64(chain[0])), k,
                                 hits[-1] if k else None, ids, chain[k:], parent))
                    evs.append(stored(chain[k:], parent))
                    for b, h in zip(ids, chain[k:], strict=True):
                        hash_of[b] = h
                        cached.setdefault(h, []).append(b)
                held.append(hits + ids)
        for blocks in held:
            for b in blocks:
                ref[b] -= 1
            recs.append((R.FREED, ts, step, None, blocks[::-1], [ref[b] for b in blocks[::-1]]))
            free.update((b, None) for b in blocks[::-1] if ref[b] == 0)
        if step % 17 == 16:  # every block is free at the end of a step: a prefix-cache reset succeeds
            recs.append((R.RESET, ts, step))
            evs.append(CLEARED)
            hash_of.clear()
            cached.clear()
        records.append(recs)
        events.append(evs)
    return records, events


KEEP = (S.BLOCK_SEALED, S.BLOCK_EVICTED, S.BLOCK_REBUILT, S.CACHE_RESET)


def _project(row: tuple) -> tuple:
    """What both sources know of a row: KV events cannot tell pressure from connector evictions (reason null, a
    reset's excepted), nor an evicted block's idle time."""
    event = row[COL["event"]]
    age = row[COL["age_ns"]] if event == S.BLOCK_REBUILT else None
    reason = row[COL["reason"]] if row[COL["reason"]] == S.EVICT_RESET else None
    return (event, row[COL["block_hash"]], row[COL["parent_hash"]], row[COL["depth"]], row[COL["family"]], reason,
            age)


def test_on_one_pool_both_sources_write_the_same_block_story() -> None:
    records, events = _pool_run(400, seed=11)
    plugin_rows: list[tuple] = []
    expander = Expander(num_blocks=32, emit=plugin_rows.append, engine="e", run_id="r")
    conv = Converter(engine="e", run_id="r")
    totals: dict[str, int] = {}
    for step, (recs, evs) in enumerate(zip(records, events, strict=True)):
        plugin_rows.clear()
        expander.apply(recs)
        mine = conv.convert(decode_batch(msgspec.msgpack.encode([float(step + 1), evs])))
        want = sorted((_project(r) for r in plugin_rows if r[COL["event"]] in KEEP), key=repr)
        got = sorted((_project(r) for r in mine.rows()), key=repr)  # (a reset's rows: in block order there)
        assert got == want, f"step {step}"
        for p in got:
            totals[p[0]] = totals.get(p[0], 0) + 1
    # The run exercised every rule: pressure evictions, rebuilds, copies, resets.
    assert totals[S.BLOCK_REBUILT] > 20 and totals[S.BLOCK_EVICTED] > 100 and totals[S.CACHE_RESET] == 23
    sealed_twice = sum(1 for evs in events for i, e in enumerate(evs) if e["type"] == "BlockStored"
                       and any(o["type"] == "BlockStored" and o["block_hashes"] == e["block_hashes"] for o in evs[:i]))
    assert sealed_twice > 10


def test_a_tenant_or_lora_over_the_string_cap_is_left_null_and_counted() -> None:
    conv = Converter(engine="e", run_id="r", max_string_bytes=8)
    rows = convert(conv, 1, stored([1], extra_keys=[["é" * 5]], lora_name="adapter-with-a-long-name"),
                   stored([2], extra_keys=[["short"]], lora_name="ok"))
    assert pick(rows, "block_hash", "tenant", "lora") == [(1, None, None), (2, "short", "ok")]
    assert conv.clipped == 2  # (10 UTF-8 bytes of "é" over 8; the LoRA name too)
