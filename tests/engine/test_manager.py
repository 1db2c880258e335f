"""The hook on vLLM's real KVCacheManager/BlockPool, driven exactly as vLLM's own test_prefix_caching.py does.

vLLM's expectations (block ids, free-queue order, ref counts, eviction order) are asserted unchanged with the hook
installed, and the hook's events are checked against what that sequence must produce.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from support.pools import BLOCK, bare_manager
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.request import Request

from kvfabric.contract import schema as S
from kvfabric.engine.config import load_hook_settings
from kvfabric.engine.install import Installation, build_hook

pytestmark = pytest.mark.vllm


def make_manager(num_blocks: int, hooked: bool, native: bool = True) -> tuple[KVCacheManager, Installation | None]:
    manager = bare_manager(num_blocks, max_model_len=8192)
    inst = None
    if hooked:
        settings = load_hook_settings({"KVFABRIC_LIFECYCLE": "1", "KVFABRIC_SINK": "none", "KVFABRIC_RUN_ID": "t",
                                       "KVFABRIC_NATIVE": "1" if native else "0"})
        inst = build_hook(manager, settings, block_size=BLOCK, engine="test", outlet="local")
        assert inst is not None
    return manager, inst


def make_request(rid: str, tokens: list[int]) -> Request:
    params = SamplingParams(max_tokens=17)
    params.update_from_generation_config({}, eos_token_id=100)
    return Request(request_id=rid, prompt_token_ids=tokens, sampling_params=params, pooling_params=None,
                   block_hasher=get_request_block_hasher(BLOCK, sha256))


def events(inst: Installation) -> list[dict[str, Any]]:
    return [dict(zip(S.EMIT_COLUMNS, row, strict=True)) for row in inst.drain()]


def admit(manager: KVCacheManager, req: Request, prompt_len: int) -> list[int]:
    computed, num_computed, _ = manager.get_computed_blocks(req)
    blocks = manager.allocate_slots(req, prompt_len - num_computed, len(computed.blocks[0]) * BLOCK, computed)
    assert blocks is not None
    return blocks.get_block_ids()[0]


def run_vllm_test_prefill(manager: KVCacheManager) -> list[Any]:
    """vLLM's test_prefill (tests/v1/core/test_prefix_caching.py), returning what it observed."""
    seen: list[Any] = []
    common = [i for i in range(3) for _ in range(16)]
    req0 = make_request("0", common + [3] * 7)
    seen.append(admit(manager, req0, 55))
    req1 = make_request("1", common + [3] * 5)
    seen.append(admit(manager, req1, 53))
    seen.append([b.ref_cnt for b in manager.block_pool.blocks])
    manager.free(req0)
    manager.free(req1)
    seen.append([b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()])
    req2 = make_request("2", common + [3] * 6)
    seen.append(admit(manager, req2, 54))
    manager.free(req2)
    req3 = make_request("3", [99] * (16 * 10))
    seen.append(admit(manager, req3, 160))
    seen.append([b.ref_cnt for b in manager.block_pool.blocks])
    seen.append(manager.block_pool.free_block_queue.num_free_blocks)
    return seen


def test_vllm_prefill_expectations_hold_with_hook_and_events_are_exact() -> None:
    plain, _ = make_manager(11, hooked=False)
    hooked, inst = make_manager(11, hooked=True)
    assert inst is not None
    expected = run_vllm_test_prefill(plain)
    observed = run_vllm_test_prefill(hooked)
    # vLLM's own pinned expectations, then identity with the un-hooked run.
    assert expected[0] == [1, 2, 3, 4]
    assert expected[1] == [5]
    assert expected[3] == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    assert expected[5] == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    assert observed == expected

    ev = events(inst)
    kinds = Counter(e["event"] for e in ev)
    assert kinds[S.PREFIX_LOOKUP] == 4
    assert kinds[S.BLOCK_SEALED] == 3 + 10  # req0's three common blocks, req3's ten blocks
    assert kinds[S.BLOCK_TOUCHED] == 6  # req1 and req2 hit the three common blocks
    lookups = {e["request_id"]: e for e in ev if e["event"] == S.PREFIX_LOOKUP}
    assert [lookups[r]["hit_tokens"] for r in "0123"] == [0, 48, 48, 0]
    assert [lookups[r]["prompt_tokens"] for r in "0123"] == [55, 53, 54, 160]
    assert lookups["0"]["family"] == lookups["1"]["family"] == lookups["2"]["family"] != lookups["3"]["family"]

    evicted = [e for e in ev if e["event"] == S.BLOCK_EVICTED]
    # Eviction order is vLLM's LRU order: tails before trunks; each carried its whole life story.
    assert [e["block_id"] for e in evicted] == [3, 2, 1]
    assert [e["depth"] for e in evicted] == [2, 1, 0]
    assert all(e["share_degree"] == 3 and e["hit_count"] == 2 for e in evicted)
    assert all(e["request_id"] == "3" for e in evicted)
    assert all(e["reason"] == S.EVICT_PRESSURE and e["ref_count"] == 0 for e in evicted)
    sealed = {e["block_id"]: e for e in ev if e["event"] == S.BLOCK_SEALED and e["request_id"] == "0"}
    assert [e["block_hash"] for e in evicted] == [sealed[b]["block_hash"] for b in (3, 2, 1)]
    assert sealed[2]["parent_hash"] == sealed[1]["block_hash"] and sealed[1]["parent_hash"] is None
    assert sealed[1]["branch_factor"] == 0
    # Frees: req0 and req1 released the shared blocks (ref 2 -> 1 -> 0); the partial blocks went straight to 0.
    freed = [e for e in ev if e["event"] == S.BLOCK_FREED]
    changed = [e for e in ev if e["event"] == S.REF_COUNT_CHANGED]
    assert sorted(e["block_id"] for e in changed) == [1, 2, 3]
    assert {e["block_id"] for e in freed} >= {1, 2, 3, 4, 5}
    assert kinds[S.BLOCK_REBUILT] == 0


def test_rebuilt_and_regretful_eviction_detected() -> None:
    manager, inst = make_manager(6, hooked=True)  # 5 usable blocks
    assert inst is not None
    family = [7] * 16 + [8] * 16 + [9] * 16
    a = make_request("a", family + [1] * 4)
    admit(manager, a, 52)
    manager.free(a)
    b = make_request("b", [5] * 64 + [1])  # needs all 5 blocks: evicts a's three cached blocks
    admit(manager, b, 65)
    manager.free(b)
    c = make_request("c", family + [2] * 4)  # a's prefix again: it was evicted, so it is rebuilt
    assert admit(manager, c, 52)
    ev = events(inst)
    evicted = [e for e in ev if e["event"] == S.BLOCK_EVICTED and e["request_id"] == "b"]
    assert len(evicted) == 3
    rebuilt = [e for e in ev if e["event"] == S.BLOCK_REBUILT]
    assert len(rebuilt) == 3
    assert sorted(e["block_hash"] for e in rebuilt) == sorted(e["block_hash"] for e in evicted)
    assert all(e["age_ns"] is not None and e["age_ns"] >= 0 for e in rebuilt)
    lookup_c = next(e for e in ev if e["event"] == S.PREFIX_LOOKUP and e["request_id"] == "c")
    assert lookup_c["hit_tokens"] == 0
    assert lookup_c["count"] == 3  # three regretful evictions: all wanted again within the window


@pytest.mark.parametrize("native", [True, False], ids=["compiled", "python"])
def test_sealed_blocks_carry_the_digests_vllm_stored_with_and_without_a_mask(native: bool) -> None:
    """A seal's digests come from the request's hashes (one slice) unless a mask leaves blocks uncached; either
    way each is the digest of the hash vLLM stored in the block (which appends the group id to the request's)."""
    manager, inst = make_manager(11, hooked=True, native=native)
    assert inst is not None
    pool = manager.block_pool
    admit(manager, make_request("x", [i // BLOCK for i in range(4 * BLOCK)] + [9]), 4 * BLOCK + 1)
    stored = {b.block_id: S.hash64(b.block_hash) for b in pool.blocks if b.block_hash is not None}
    sealed = {e["block_id"]: e["block_hash"] for e in events(inst) if e["event"] == S.BLOCK_SEALED}
    assert len(sealed) == 4 and sealed == stored
    assert all(len(b.block_hash) > 8 for b in pool.blocks if b.block_hash is not None)  # (the group id)

    masked = make_request("y", [50 + i // BLOCK for i in range(3 * BLOCK)])
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(masked, blocks, 0, 3, BLOCK, 0, block_mask=[True, False, True])
    ev = [e for e in events(inst) if e["event"] == S.BLOCK_SEALED]
    assert blocks[1].block_hash is None  # vLLM left the masked block uncached: no life starts there
    assert [e["block_id"] for e in ev] == [blocks[0].block_id, blocks[2].block_id]
    assert [e["block_hash"] for e in ev] == [S.hash64(blocks[0].block_hash), S.hash64(blocks[2].block_hash)]


class _Broken(list):
    def append(self, item: object) -> None:
        raise RuntimeError("injected")


def test_hook_errors_never_reach_vllm() -> None:
    manager, inst = make_manager(11, hooked=True)
    assert inst is not None
    inst.recorder.log = _Broken()  # every record now fails to be kept
    req = make_request("x", [1] * 40)
    assert admit(manager, req, 40) == [1, 2, 3]
    manager.free(req)
    assert inst.recorder.errors == 1 and not inst.recorder.on
    assert manager.block_pool.free_block_queue.num_free_blocks == 10


def test_reset_prefix_cache_drops_every_cached_block_with_its_reason() -> None:
    manager, inst = make_manager(11, hooked=True)
    assert inst is not None
    req = make_request("x", [1] * 40)
    admit(manager, req, 40)
    manager.free(req)
    assert manager.reset_prefix_cache()
    ev = events(inst)
    assert [e["event"] for e in ev][-1] == S.CACHE_RESET
    dropped = [e for e in ev if e["event"] == S.BLOCK_EVICTED]
    assert sorted(e["block_id"] for e in dropped) == [1, 2]  # the two full blocks of x were cached
    assert {e["reason"] for e in dropped} == {S.EVICT_RESET}
    again = make_request("y", [1] * 40)  # the same prefix, computed again after the reset: rebuilt
    admit(manager, again, 40)
    rebuilt = [e for e in events(inst) if e["event"] == S.BLOCK_REBUILT]
    assert len(rebuilt) == 2


def test_connector_eviction_keeps_the_ref_count_and_says_why() -> None:
    manager, inst = make_manager(11, hooked=True)
    assert inst is not None
    req = make_request("x", [1] * 40)
    assert admit(manager, req, 40) == [1, 2, 3]
    manager.evict_blocks({1, 2, 7})  # block 7 is not cached: vLLM skips it, so do we
    ev = [e for e in events(inst) if e["event"] == S.BLOCK_EVICTED]
    assert [(e["block_id"], e["reason"], e["ref_count"]) for e in ev] == [
        (1, S.EVICT_CONNECTOR, 1), (2, S.EVICT_CONNECTOR, 1)]
    assert manager.block_pool.blocks[1].block_hash is None  # vLLM did evict them
