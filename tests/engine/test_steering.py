"""Steering through vLLM's real KVCacheManager/BlockPool: docs/design.md §3 invariants under random operations.

Every policy is driven by hypothesis-generated sequences of admissions (requests built from a few shared prefix
chains plus private tails), frees, raw ``get_new_blocks``/``free_blocks`` calls and prefix-cache resets, with the
hook installed exactly as in a server. After every operation the invariants are checked against vLLM's own
structures (the free list is walked, not trusted), and at every eviction the descendants-first rule is checked.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.pools import BLOCK, LIVE_POLICIES, admit, bare_manager, make_manager, make_request
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request

from kvfabric.contract import records as R
from kvfabric.contract import schema as S
from kvfabric.contract.records import expand_report
from kvfabric.engine.config import load_hook_settings
from kvfabric.engine.install import Installation, build_hook
from kvfabric.engine.probes import hash_is_a_field_property
from kvfabric.engine.steering.attach import attach_steering
from kvfabric.engine.steering.victims import Steering, freed_candidates, freed_candidates_py
from kvfabric.lifecycle.side_table import ALL_COLUMNS, CANDIDATE_COLUMNS, INDEX_COLUMNS, LEAN_COLUMNS
from kvfabric.policies import POLICY_NAMES
from kvfabric.policies.base import EvictionPolicy
from kvfabric.policies.native_index import NativeIndex

pytestmark = pytest.mark.vllm
REORDERING = tuple(p for p in POLICY_NAMES if p != "lru")








def free_list(pool: Any) -> list[Any]:
    """Walk vLLM's linked list (the truth), checking its links on the way."""
    q = pool.free_block_queue
    out = []
    prev = q.fake_free_list_head
    cur = prev.next_free_block
    while cur is not q.fake_free_list_tail:
        assert cur is not None and cur.prev_free_block is prev, "broken free-list links"
        out.append(cur)
        prev, cur = cur, cur.next_free_block
    return out


class Checker:
    """Wraps the pool's allocation with invariant checks, and the descendants-first rule at every eviction."""

    def __init__(self, manager: KVCacheManager, inst: Installation, steering: Steering | None, reorders: bool) -> None:
        self.pool = manager.block_pool
        self.inst = inst
        self.steering = steering
        self.reorders = reorders
        self.evictions = 0
        self.victims: list[int] = []
        self.violations: list[str] = []
        pool = self.pool
        original_get = type(pool).get_new_blocks

        def get_new_blocks(n: int) -> list[Any]:
            free_before = pool.get_num_free_blocks()
            keeper = steering.keeper if steering is not None else None
            cached = {b.block_id: b.block_hash for b in free_list(pool) if b.block_hash is not None}
            blocks = original_get(pool, n)  # never fails while n blocks are free (vLLM raises otherwise)
            assert len(blocks) == n <= free_before
            for blk in blocks:
                assert not blk.is_null, "the null block was handed out"
                assert blk.block_hash is None, "a reused block kept its hash"
                assert blk.ref_cnt == 1
                assert blk.prev_free_block is None and blk.next_free_block is None
            evicted = [blk.block_id for blk in blocks if blk.block_id in cached]
            self.evictions += len(evicted)
            if self.reorders and keeper is not None and evicted:
                # A free cached child of an evicted block must have gone before it (or with it, in this call).
                t = keeper.table
                for y in free_list(pool):
                    if y.block_hash is not None and t.parent_block[y.block_id] in evicted:
                        self.violations.append(f"evicted block {t.parent_block[y.block_id]} before its free "
                                               f"cached child {y.block_id}")
            return blocks

        pool.get_new_blocks = get_new_blocks  # type: ignore[method-assign]

    def check(self) -> None:
        assert not self.violations, self.violations[0]
        pool = self.pool
        free = free_list(pool)
        ids = {b.block_id for b in free}
        assert len(ids) == len(free) == pool.free_block_queue.num_free_blocks
        null = pool.null_block
        assert null.block_id not in ids and null.block_hash is None, "null block queued or hashed"
        for blk in pool.blocks:
            if blk.is_null:
                continue
            assert (blk.block_id in ids) == (blk.ref_cnt == 0), f"block {blk.block_id}: ref {blk.ref_cnt}"
        if self.steering is not None and self.steering.index is not None:
            index = self.steering.index
            held = {b for b in range(pool.num_gpu_blocks) if index.held[b]}
            assert held <= ids, "the index holds a block that is not free"
            cached_free = {b.block_id for b in free if b.block_hash is not None}
            assert cached_free <= held, "a cached free block is not a candidate"
            assert len(index) == len(held)
        assert self.inst.recorder.errors == 0 and self.inst.recorder.on


# Requests: one of three families (a chain of up to 4 shared blocks), a private tail, sometimes a session hint.
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("admit"), st.integers(0, 2), st.integers(0, 4), st.integers(1, 40), st.integers(0, 3)),
        st.tuples(st.just("free"), st.integers(0, 50)),
        st.tuples(st.just("raw"), st.integers(0, 8)),
        st.tuples(st.just("reset")),
    ),
    min_size=5,
    max_size=60,
)


def run_ops(ops: list[tuple], policy: str, num_blocks: int, anchor: int | None, *, one_by_one: bool = True,
            native: bool = True) -> Checker:
    """Run ``ops``, then free everything and evict all that is cached: one block per call (``one_by_one``, the
    eviction path's usual call) or in one call. ``checker.victims``: the cached blocks in the order they went.
    ``native``: the compiled victim index (else the Python one)."""
    manager, inst, steering = make_manager(num_blocks, policy, anchor, native=native)
    checker = Checker(manager, inst, steering, reorders=policy != "lru")
    pool = manager.block_pool
    running: list[Request] = []
    raw: list[Any] = []
    serial = 0
    for op in ops:
        if op[0] == "admit":
            _, fam, depth, tail, hint = op
            tokens = [1000 + fam * 10 + d for d in range(depth) for _ in range(BLOCK)]
            tokens += [5000 + serial * 50 + i for i in range(tail)]
            extra = None
            if hint == 1:
                extra = {"kvfabric_session": f"s{fam}"}
            elif hint == 2:
                extra = {"kvfabric_session": f"s{fam}", "kvfabric_session_end": True}
            req = make_request(f"r{serial}", tokens, extra)
            serial += 1
            if admit(manager, req) is not None:
                running.append(req)
        elif op[0] == "free" and running:
            manager.free(running.pop(op[1] % len(running)))
        elif op[0] == "raw":
            # Raw blocks stay allocated until the next raw operation, so evictions leave survivors behind.
            pool.free_blocks(reversed(raw))
            raw = pool.get_new_blocks(min(op[1], pool.get_num_free_blocks()))
        elif op[0] == "reset" and not running and not raw:
            assert manager.reset_prefix_cache()
        checker.check()
    pool.free_blocks(reversed(raw))
    while running:
        manager.free(running.pop())
        checker.check()
    # Then evict everything cached (the policy's order), checking every eviction.
    cached = {b.block_id for b in free_list(pool) if b.block_hash is not None}
    if one_by_one:
        taken = [pool.get_new_blocks(1)[0] for _ in range(pool.get_num_free_blocks())]
    else:
        taken = pool.get_new_blocks(pool.get_num_free_blocks())
    checker.victims = [b.block_id for b in taken if b.block_id in cached]
    checker.check()
    pool.free_blocks(taken)
    checker.check()
    return checker


@pytest.mark.parametrize("policy", POLICY_NAMES)
@settings(max_examples=35, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, num_blocks=st.integers(6, 24), anchor=st.sampled_from([None, 0, 2]))
def test_invariants_hold_under_random_operations(policy: str, ops: list[tuple], num_blocks: int,
                                                 anchor: int | None) -> None:
    run_ops(ops, policy, num_blocks, anchor)


@pytest.mark.parametrize("policy", REORDERING)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, num_blocks=st.integers(6, 24))
def test_one_block_at_a_time_evicts_what_one_call_for_all_evicts(policy: str, ops: list[tuple],
                                                                 num_blocks: int) -> None:
    """vLLM's usual eviction (one block per call: a decoding request's next block) takes a path of its own
    (``_evict_one``, ``HeapIndex.pop``); it hands out the same victims, in the same order, as the general path."""
    one = run_ops(ops, policy, num_blocks, 0, one_by_one=True)
    every = run_ops(ops, policy, num_blocks, 0, one_by_one=False)
    assert one.victims == every.victims
    assert one.steering is not None and one.steering.stale == every.steering.stale == 0


@pytest.mark.parametrize("policy", REORDERING)
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, num_blocks=st.integers(6, 24))
def test_the_compiled_and_the_python_index_evict_alike(policy: str, ops: list[tuple], num_blocks: int) -> None:
    """Through vLLM's real pool, the compiled victim index (the default where it is built) and the Python one
    (``KVFABRIC_NATIVE=0``) evict the same blocks in the same order (tests/policies/test_native_index.py compares
    them call by call)."""
    native = run_ops(ops, policy, num_blocks, 0, native=True)
    python = run_ops(ops, policy, num_blocks, 0, native=False)
    assert native.steering is not None and python.steering is not None
    assert type(native.steering.index) is NativeIndex and type(python.steering.index) is not NativeIndex
    assert native.steering.candidates is freed_candidates and python.steering.candidates is freed_candidates_py
    assert (native.victims, native.evictions) == (python.victims, python.evictions)
    assert native.steering.victims == python.steering.victims


@pytest.mark.parametrize("policy", REORDERING)
def test_pressure_sequence_evicts_through_the_policy(policy: str) -> None:
    """A fixed sequence that must evict: victims come from the index, and the checks ran on every eviction."""
    ops = [("admit", f % 3, 4, 30, 0) for f in range(12)] + [("free", 0)] * 12
    ops = [op for pair in zip(ops[:12], ops[12:], strict=True) for op in pair]
    checker = run_ops([*ops, ("admit", 0, 4, 30, 0), ("free", 0)], policy, 16, 0)
    assert checker.evictions > 0
    assert checker.steering is not None and checker.steering.victims > 0


def test_lru_attaches_nothing_and_changes_nothing() -> None:
    """With policy lru (and no gate) the queue keeps vLLM's class and allocations are identical to no hook."""
    manager, inst, steering = make_manager(12, "lru", anchor=None)
    assert steering is None
    assert type(manager.block_pool.free_block_queue) is FreeKVCacheBlockQueue
    assert inst.recorder.gate is None and inst.recorder.keeper is None
    plain, _, _ = make_manager(12, "lru", anchor=None)
    plain = bare_manager(12)
    for m in (manager, plain):
        got = []
        for i in range(8):
            req = make_request(f"x{i}", [7] * 32 + [i] * (10 + i * 3))
            got.append(admit(m, req))
            m.free(req)
        m.got = got  # type: ignore[attr-defined]
    assert manager.got == plain.got  # type: ignore[attr-defined]


def test_family_protect_passes_over_protected_blocks() -> None:
    """A block hit once is protected: the unprotected tail of another request goes first, in O(1)."""
    manager, inst, _steering = make_manager(9, "family_protect", anchor=0)  # 8 usable blocks
    a = make_request("a", [1] * 32 + [2])
    admit(manager, a)
    manager.free(a)
    b = make_request("b", [1] * 32 + [3])  # hits a's two blocks: they become protected
    admit(manager, b)
    manager.free(b)
    c = make_request("c", [9] * 64 + [4])  # five blocks, cached, unprotected
    admit(manager, c)
    manager.free(c)
    d = make_request("d", [8] * 64 + [5])  # needs five: evicts c's cached blocks, not a's protected ones
    admit(manager, d)
    pool = manager.block_pool
    ev = [dict(zip(S.EMIT_COLUMNS, r, strict=True)) for r in inst.drain()]
    hits = inst.outlet.expander.table.hits  # type: ignore[attr-defined]
    a_blocks = [blk for blk in pool.blocks if blk.block_hash is not None and hits[blk.block_id] > 0]
    assert len(a_blocks) == 2, "the protected trunk survived"
    evicted = [e for e in ev if e["event"] == S.BLOCK_EVICTED]
    assert evicted and all(not e["protected"] for e in evicted)


def test_ranked_policy_reports_scores_bounded() -> None:
    manager, inst, _steering = make_manager(10, "shared_aware", anchor=0)
    for i in range(6):
        r = make_request(f"q{i}", [i + 1] * 48 + [0])
        admit(manager, r)
        manager.free(r)
    ev = [dict(zip(S.EMIT_COLUMNS, r, strict=True)) for r in inst.drain()]
    ranked = [e for e in ev if e["event"] == S.EVICTION_CANDIDATES_RANKED]
    evicted = [e for e in ev if e["event"] == S.BLOCK_EVICTED]
    assert evicted and ranked
    assert len(ranked) <= len(evicted)  # one event per allocation call, not one per candidate
    assert sum(e["count"] for e in ranked) == len(evicted)
    assert all(e["retain_score"] is not None for e in evicted)
    # Each ranking summarises its victims (the evictions of the allocation right after it): the best retain score
    # among them, and whether any was protected.
    scores = {e["retain_score"] for e in evicted}
    assert len(scores) > 1  # (so that the highest one means something)
    summaries = []
    for e in ev:
        if e["event"] == S.EVICTION_CANDIDATES_RANKED:
            summaries.append((e, []))
        elif e["event"] == S.BLOCK_EVICTED:
            summaries[-1][1].append(e)
    for summary, victims in summaries:
        assert len(victims) == summary["count"]
        assert summary["retain_score"] == max(v["retain_score"] for v in victims)
        assert summary["protected"] == any(v["protected"] for v in victims)


def test_admission_gate_limits_unknown_families() -> None:
    manager, inst, steering = make_manager(40, "lru", anchor=2)
    assert steering is not None and steering.gate is not None and steering.index is None
    first = make_request("first", [3] * 80 + [1])  # five full blocks, family unknown: only 2 cached
    admit(manager, first)
    assert sum(1 for b in manager.block_pool.blocks if b.block_hash is not None) == 2
    manager.free(first)
    second = make_request("second", [3] * 80 + [2])  # same family: hits the anchor, caches the rest
    _computed, hit_tokens = manager.get_computed_blocks(second, second.num_tokens - 1)[:2]
    assert hit_tokens == 2 * BLOCK
    admit(manager, second)
    assert sum(1 for b in manager.block_pool.blocks if b.block_hash is not None) == 5
    hinted = make_request("hinted", [4] * 80 + [1], {"kvfabric_session": "s"})  # a hint makes it known
    admit(manager, hinted)
    assert sum(1 for b in manager.block_pool.blocks if b.block_hash is not None) == 10
    ev = [dict(zip(S.EMIT_COLUMNS, r, strict=True)) for r in inst.drain()]
    limited = [e for e in ev if e["event"] == S.CACHE_ADMISSION_LIMITED]
    assert [(e["request_id"], e["count"]) for e in limited] == [("first", 3)]


def test_steering_survives_a_broken_side_table() -> None:
    manager, inst, steering = make_manager(11, "adaptive_aging", anchor=0)
    assert steering is not None and steering.keeper is not None
    steering.keeper.table = None  # type: ignore[assignment]
    for i in range(5):
        req = make_request(f"x{i}", [i + 1] * 40)
        assert admit(manager, req) is not None
        manager.free(req)
    assert manager.block_pool.free_block_queue.num_free_blocks == 10
    assert steering.errors >= 1 and inst.recorder.errors == 1 and not inst.recorder.on
    # The recorder stopped, so frees and touches go unseen: the index was dropped, vLLM's order took over.
    assert steering.index is None


def test_a_block_unlinked_behind_the_hooks_back_is_rekeyed_or_skipped() -> None:
    """The index follows frees and touches through the recorder. A block some other path takes out of vLLM's list
    (here: the list's own ``remove``, as touch does, but unrecorded) keeps a stale entry: freed again, it gets a
    fresh one (a new key, last in order); reached while still in use, it is skipped and counted, never handed out."""
    manager, inst, steering = make_manager(9, "adaptive_aging", anchor=0)
    assert steering is not None and steering.index is not None
    index = steering.index
    pool = manager.block_pool
    req = make_request("a", [3] * 16 * 4)
    assert admit(manager, req) is not None
    manager.free(req)
    cached = [b for b in free_list(pool) if b.block_hash is not None]  # the eviction order: tail first
    assert len(cached) == 4 and all(index.held[b.block_id] for b in cached)
    first, *middle, root = cached

    def unlink_unrecorded(blk: Any) -> None:
        pool.free_block_queue.remove(blk)
        blk.ref_cnt += 1

    freed_at = index.now
    unlink_unrecorded(root)
    assert index.held[root.block_id] and index.keys[root.block_id] == freed_at  # stale
    uncached = pool.get_num_free_blocks() - len(cached) + 1  # (the stray left the list)
    taken = pool.get_new_blocks(uncached + 1)  # uncached blocks first, then the first victim
    assert taken[-1] is first and index.now == freed_at + uncached + 1
    pool.free_blocks([root])  # recorded: free again, so its stale entry is replaced
    assert index.held[root.block_id] and index.keys[root.block_id] == index.now > freed_at
    unlink_unrecorded(middle[0])
    rest = pool.get_new_blocks(pool.get_num_free_blocks())
    assert middle[0] not in rest and steering.stale == 1
    assert [b for b in rest if b in cached] == [middle[1], root]  # the replaced entry went last
    assert steering.errors == 0 and inst.recorder.on


class RootFirst(EvictionPolicy):
    """Adversarial keys: shallow blocks first (anti-monotone). Only the index's rule keeps children first."""

    name = "root_first"
    structure = "heap"

    def key(self, t: Any, b: int, now: int, ctx: Any) -> float:
        return float(t.depth[b] or 0)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, num_blocks=st.integers(6, 24))
def test_descendants_before_ancestors_even_with_adversarial_keys(ops: list[tuple], num_blocks: int) -> None:
    manager, inst, _ = make_manager(num_blocks, "lru", anchor=None)
    hook_settings = load_hook_settings({"KVFABRIC_LIFECYCLE": "1", "KVFABRIC_SINK": "none"})
    steering = attach_steering(None, manager, inst, hook_settings, RootFirst())
    checker = Checker(manager, inst, steering, reorders=True)
    pool = manager.block_pool
    running: list[Request] = []
    raw: list[Any] = []
    for serial, op in enumerate(ops):
        if op[0] == "admit":
            _, fam, depth, tail, _ = op
            tokens = [1000 + fam * 10 + d for d in range(depth) for _ in range(BLOCK)] + [7] * tail
            req = make_request(f"r{serial}", tokens)
            if admit(manager, req) is not None:
                running.append(req)
        elif op[0] == "free" and running:
            manager.free(running.pop(op[1] % len(running)))
        elif op[0] == "raw":
            pool.free_blocks(reversed(raw))
            raw = pool.get_new_blocks(min(op[1], pool.get_num_free_blocks()))
        checker.check()
    pool.free_blocks(reversed(raw))
    while running:
        manager.free(running.pop())
    # Evict everything cached, one block at a time: the checker validates each eviction.
    taken = [pool.get_new_blocks(1)[0] for _ in range(pool.get_num_free_blocks())]
    checker.check()
    pool.free_blocks(taken)
    assert steering.index is not None and len(steering.index) == 0


@pytest.mark.parametrize("cache_aware", [False, True])
def test_cache_aware_scheduling_holds_a_request_until_its_prefix_is_sealed(cache_aware: bool,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    """Two requests of one family arrive together; prefills are interleaved (per-request chunk cap).

    Without the hold the second computes the shared prefix alongside the first; with it, it waits and hits it, and
    the drained scheduler logs, once, how many requests were held (shutdown and exit do not repeat the same counts).
    """
    from kvfabric.engine.config import HookSettings
    from kvfabric.engine.install import install
    from kvfabric.sim.harness import SimulatedEngine, build_scheduler

    scheduler = build_scheduler(2000, max_num_seqs=8, max_num_batched_tokens=1024, max_model_len=8192)
    scheduler.scheduler_config.long_prefill_token_threshold = 256
    if cache_aware:
        install(scheduler, HookSettings(policy="lru", cache_aware_scheduling=True))
    engine = SimulatedEngine(scheduler, "zero", track_evictions=False)
    shared = [1000 + i for i in range(2048)]
    engine.add_workload([(0.0, "a", shared + [7] * 40, 2, None), (0.0, "b", shared + [9] * 40, 2, None),
                         (0.0, "c", [5000 + i for i in range(300)], 2, None)])
    with caplog.at_level("INFO", logger="vllm.kvfabric"):
        engine.run_until_done()
    said_running = [r.getMessage() for r in caplog.records if r.name == "vllm.kvfabric"]
    hit_b = engine.metrics["b"].num_cached_tokens
    assert engine.metrics["c"].num_cached_tokens == 0
    if cache_aware:
        steering = scheduler.kv_cache_manager.block_pool._kvfabric_steering
        hold = steering.hold
        assert hold is not None and hold.held_requests == 1 and hold.held_steps >= 1 and not hold._holding
        assert hit_b == 2048  # the whole shared prefix, sealed by "a" first
        assert engine.metrics["c"].first_token_s is not None  # an unrelated request is never held
        line = f"KVFabric cache-aware scheduling held 1 request(s) for {hold.held_steps:,} scheduler step(s)"
        assert said_running == [line]  # written when the scheduler drained, before anyone stops it
        with caplog.at_level("INFO", logger="vllm.kvfabric"):
            scheduler.shutdown()
            hold.report()  # (at exit)
        assert [r.getMessage() for r in caplog.records if r.name == "vllm.kvfabric"] == [line]  # same counts: said
    else:
        assert hit_b < 2048
        assert said_running == []


def test_a_hold_that_never_held_says_so_when_the_scheduler_drains(caplog: pytest.LogCaptureFixture) -> None:
    """Nothing to hold (one request): the line still comes while the scheduler runs, not only at its shutdown,
    which vLLM may never reach (a second SIGTERM kills the EngineCore during teardown); later drains with the same
    counts add nothing."""
    from kvfabric.engine.config import HookSettings
    from kvfabric.engine.install import install
    from kvfabric.sim.harness import SimulatedEngine, build_scheduler

    scheduler = build_scheduler(2000, max_num_seqs=8, max_num_batched_tokens=1024, max_model_len=8192)
    install(scheduler, HookSettings(policy="lru", cache_aware_scheduling=True))
    engine = SimulatedEngine(scheduler, "zero", track_evictions=False)
    engine.add_workload([(0.0, "a", [1000 + i for i in range(300)], 2, None),
                         (5.0, "b", [3000 + i for i in range(300)], 2, None)])  # two drains, apart
    with caplog.at_level("INFO", logger="vllm.kvfabric"):
        engine.run_until_done()
    said = [r.getMessage() for r in caplog.records if r.name == "vllm.kvfabric"]
    assert said == ["KVFabric cache-aware scheduling held 0 request(s) for 0 scheduler step(s)"]


def test_session_hints_steer_adaptive_aging() -> None:
    """An ended conversation's private blocks go before older blocks; a preempted one is not treated as ended."""
    from vllm.v1.request import RequestStatus

    manager, _inst, steering = make_manager(12, "adaptive_aging", anchor=0)  # 11 usable blocks
    old = make_request("old", [1] * 48 + [0])  # three cached blocks, freed first (oldest under LRU)
    admit(manager, old)
    manager.free(old)
    ended = make_request("ended", [2] * 48 + [0], {"kvfabric_session": "s", "kvfabric_session_end": True})
    admit(manager, ended)
    ended.status = RequestStatus.FINISHED_STOPPED
    manager.free(ended)
    pool = manager.block_pool
    ended_ids = {b.block_id for b in pool.blocks if b.block_hash is not None and b.block_id not in (1, 2, 3)}
    victims = pool.get_new_blocks(5 + 3)  # 5 uncached blocks first, then three victims
    assert {b.block_id for b in victims[5:]} == ended_ids  # the ended session went before the older request
    pool.free_blocks(victims)
    preempted = make_request("pre", [3] * 48 + [0], {"kvfabric_session": "t", "kvfabric_session_end": True})
    admit(manager, preempted)
    manager.free(preempted)  # still WAITING: a preemption, not the end of the session
    assert all(steering.index.keys[b.block_id] > 0 for b in pool.blocks
               if b.block_hash is not None and steering.index.held[b.block_id])




def pressured_run(policy: str, prepare: Any = None) -> tuple[Installation, Steering]:
    """A small pool under pressure: three families of prompts, sessions that end, hits and evictions.
    ``prepare(steering)`` runs first."""
    manager, inst, steering = make_manager(14, policy, anchor=0)
    assert steering is not None and steering.keeper is not None
    if prepare is not None:
        prepare(steering)
    for i in range(30):
        extra = {"kvfabric_family": f"f{i % 3}", "kvfabric_session": f"s{i % 4}", "kvfabric_session_end": i % 5 == 4}
        req = make_request(f"q{i}", [1 + i % 3] * 32 + [50 + i] * 40, extra)
        assert admit(manager, req) is not None
        manager.free(req)
    inst.drain()
    assert steering.victims > 0 and steering.errors == 0
    return inst, steering


@pytest.mark.parametrize("policy", LIVE_POLICIES)
def test_one_side_table_in_process_and_in_the_expander(policy: str) -> None:
    """Steering's in-process statistics and the expander's are kept by the same side-table code: after a pressured
    run every column the policy and the victim index read agrees on every cached block (``last_use`` aside: a
    different clock by design). A policy reading only lean columns gets a lean keeper, which keeps no more."""
    inst, steering = pressured_run(policy)
    keeper = steering.keeper
    assert keeper is not None and steering.policy is not None
    mine, theirs = keeper.table, inst.outlet.expander.table  # type: ignore[attr-defined]
    assert mine.hash == theirs.hash
    cached = [b for b, h in enumerate(theirs.hash) if h is not None]
    assert len(cached) >= 10
    reads = steering.policy.reads | INDEX_COLUMNS
    assert keeper.lean == (reads <= LEAN_COLUMNS)
    assert keeper.sealless == (steering.policy.reads <= CANDIDATE_COLUMNS)
    if keeper.sealless:
        # No sealing followed: hash and hits are exact on the candidates (every cached block here: the run freed
        # every request), and the index's parent links, taken from the frees' order, are the expander's own
        # (from the sealings), wherever that parent still holds the content.
        index = steering.index
        assert index is not None and all(index.held[b] for b in cached)
        for field in sorted(CANDIDATE_COLUMNS):
            assert [getattr(mine, field)[b] for b in cached] == [getattr(theirs, field)[b] for b in cached], field
        alive = [p if p >= 0 and theirs.hash[p] == theirs.parent[b] else -1
                 for b, p in ((b, theirs.parent_block[b]) for b in cached)]
        assert sum(p >= 0 for p in alive) >= len(cached) // 2  # (chains: most blocks have a parent)
        assert [index.link[b] for b in cached] == alive
    elif keeper.lean:  # lean columns are exact on cached blocks; elsewhere they may be stale (side_table.py)
        for field in sorted(reads & LEAN_COLUMNS):
            assert [getattr(mine, field)[b] for b in cached] == [getattr(theirs, field)[b] for b in cached], field
    else:  # the full table: every block, every column
        for field in sorted(ALL_COLUMNS - {"last_use", "protected", "score"}):
            assert getattr(mine, field) == getattr(theirs, field), field
        assert mine.family[1:].count(None) < len(mine.family) - 1  # families are kept in-process too


@pytest.mark.parametrize("policy", LIVE_POLICIES)
def test_the_expander_keeps_the_scores_and_flags_the_policy_reported(policy: str) -> None:
    """Whichever form ``report`` answers in (lists, or one score and flag for a whole free), the event rows' scores
    and flags are each candidate's own: the expander's table holds, for every block still a candidate, what the
    policy reported for it."""
    reported: dict[int, tuple[float, bool]] = {}
    forms: set[bool] = set()

    def prepare(steering: Steering) -> None:
        policy_obj = steering.policy
        assert policy_obj is not None
        report = policy_obj.report

        def spy(t: Any, ids: list[int], keys: list[float], now: int) -> Any:
            out = report(t, ids, keys, now)
            forms.add(isinstance(out[0], list))
            reported.update(zip(ids, zip(*expand_report(ids, *out), strict=True), strict=True))
            return out

        policy_obj.report = spy  # type: ignore[method-assign]

    inst, steering = pressured_run(policy, prepare)
    index = steering.index
    assert index is not None
    table = inst.outlet.expander.table  # type: ignore[attr-defined]
    held = [b for b in range(index.num_blocks) if index.held[b]]
    assert held and forms
    assert [(table.score[b], table.protected[b]) for b in held] == [reported[b] for b in held]
    if policy == "adaptive_aging":
        assert False in forms  # (the uniform form went through the records)


def test_loss_counted_for_a_record_never_exceeds_the_rows_it_makes() -> None:
    """``events_in`` (what a lost record is counted as) is a lower bound of the rows the expander makes of it, for
    every record of a pressured run; an allocation whose victims the policy chose counts their ranking row too."""
    manager, inst, steering = make_manager(14, "adaptive_aging", anchor=0)
    life = inst.outlet.expander  # type: ignore[attr-defined]
    seen: list[tuple[tuple, int, int]] = []

    def apply(records: list[tuple]) -> None:
        for rec in records:
            before = life.events
            life.apply_one(rec)
            seen.append((rec, R.events_in(rec), life.events - before))

    life.apply = apply
    for i in range(30):
        req = make_request(f"q{i}", [1 + i % 3] * 32 + [50 + i] * 40, {"kvfabric_session": f"s{i % 4}"})
        assert admit(manager, req) is not None
        manager.free(req)
    inst.drain()
    assert seen and all(lower <= made for _, lower, made in seen)
    chosen = [(rec, lower) for rec, lower, _ in seen if rec[0] == R.ALLOCATED and rec[5]]
    assert chosen and steering.victims == sum(len(rec[5]) for rec, _ in chosen)
    assert all(lower == len(rec[4]) + 1 for rec, lower in chosen)


def test_the_lean_keeper_serves_the_policies_that_read_only_lean_columns() -> None:
    """Which built-in policies get the lean keeper (a change here changes the hook's cost: hook_overhead.md)."""
    lean = {p for p in LIVE_POLICIES if make_manager(8, p)[2].keeper.lean}  # type: ignore[union-attr]
    # The peers read hits (lfu, slru), the hash (fifo) or hash and depth (tlru): lean columns only.
    assert lean == {"adaptive_aging", "learned", "lfu", "slru", "fifo", "tlru"}
    sealless = {p for p in LIVE_POLICIES if make_manager(8, p)[2].keeper.sealless}  # type: ignore[union-attr]
    # (hash and hits only: no sealing followed; tlru's depth and learned's features need the seal)
    assert sealless == {"adaptive_aging", "lfu", "slru", "fifo"}


def test_policy_statistics_without_recording_keep_family_and_last_use() -> None:
    """With lifecycle recording off a policy still reads every field (the old lean copy dropped two)."""
    init_none_hash(sha256)
    manager = KVCacheManager(
        KVCacheConfig(num_blocks=12, kv_cache_tensors=[], kv_cache_groups=[
            KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1,
                                                          dtype=torch.float32))]),
        max_model_len=4096, scheduler_block_size=BLOCK, enable_caching=True, hash_block_size=BLOCK)
    inst = build_hook(manager, load_hook_settings({"KVFABRIC_EVICTION_POLICY": "shared_aware"}), block_size=BLOCK)
    assert inst is not None and inst.recorder.log is None and inst.steering is not None
    req = make_request("a", [4] * 40, {"kvfabric_family": "fam"})
    admit(manager, req)
    manager.free(req)
    other = make_request("b", [5] * 100)  # forces allocations: the logical clock moves
    admit(manager, other)
    t = inst.steering.keeper.table  # type: ignore[union-attr]
    sealed = [b for b in range(12) if t.hash[b] is not None and t.family[b] == "fam"]
    assert len(sealed) == 2
    assert all(0 <= t.last_use[b] < inst.steering.index.now for b in sealed)  # type: ignore[union-attr]


def test_frees_read_vllms_hash_field_only_where_the_property_is_that_field() -> None:
    """Steering reads ``KVCacheBlock._block_hash`` per freed block instead of the ``block_hash`` property (a Python
    call each) only when the property returns exactly that field, as in vLLM 0.33; otherwise the property."""
    manager, _inst, steering = make_manager(8, "adaptive_aging")
    assert steering is not None and steering.hash_field
    blk = manager.block_pool.blocks[1]
    assert blk.block_hash is None and blk._block_hash is None  # the check restored what it changed

    class Derived:
        _block_hash = None

        @property
        def block_hash(self) -> object:
            return ("group", self._block_hash)  # not the field itself

    class Plain:
        block_hash = None

    assert not hash_is_a_field_property([Derived()]) and not hash_is_a_field_property([Plain()])
    assert not hash_is_a_field_property([])


def test_a_policy_attached_to_a_warm_pool_takes_its_cached_free_blocks_as_one_free() -> None:
    """Steering attached where cached blocks are already free: they become candidates as one free's would, named
    in the keeper's table from vLLM's own hashes, in the list's order (which is then the eviction order: they are
    all of one class); uncached free blocks stay out."""
    manager, inst, steering = make_manager(12, "lru")
    assert steering is None
    req = make_request("a", [7] * BLOCK * 4)
    assert admit(manager, req) is not None
    manager.free(req)
    pool = manager.block_pool
    free = free_list(pool)
    cached = [b.block_id for b in free if b.block_hash is not None]
    assert len(cached) == 4 and len(free) > len(cached)
    settings_ = load_hook_settings({"KVFABRIC_LIFECYCLE": "1", "KVFABRIC_SINK": "none",
                                    "KVFABRIC_EVICTION_POLICY": "adaptive_aging"})
    steering = attach_steering(None, manager, inst, settings_)
    index, keeper = steering.index, steering.keeper
    assert index is not None and keeper is not None and keeper.sealless
    assert [b for b in range(12) if index.held[b]] == sorted(cached) and len(index) == len(cached)
    assert all(keeper.table.hash[b] == S.hash64(pool.blocks[b].block_hash) for b in cached)
    assert index.pop_n(len(cached)) == cached


def test_the_hold_forgets_dropped_requests_and_scans_once_per_doubling(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hold's set of held ids: past the prune size, ids the scheduler no longer knows (aborted while held) go;
    while many requests really wait held, the next scan waits until twice as many are held (not one per hold)."""
    from kvfabric.engine.steering import hold as hold_module
    from kvfabric.sim.harness import build_scheduler

    class CountingRequests(dict):  # the scheduler's own table, with its scans counted
        scans = 0

        def __iter__(self):  # type: ignore[no-untyped-def]
            CountingRequests.scans += 1
            return super().__iter__()

    monkeypatch.setattr(hold_module, "HOLDING_PRUNE_AT", 4)
    init_none_hash(sha256)
    scheduler = build_scheduler(200, max_num_seqs=8, max_num_batched_tokens=1024, max_model_len=8192)
    scheduler.requests = CountingRequests(scheduler.requests)
    hold = hold_module.CacheAwareHold(scheduler, scheduler.kv_cache_manager.block_pool, BLOCK)
    hold.should_hold = lambda request: True  # type: ignore[method-assign]  # every look holds: the bookkeeping alone
    hold.attach()
    look = scheduler._handle_blocked_waiting_request
    bystander = make_request("bystander", [99] * (2 * BLOCK))  # known to the scheduler, never held
    scheduler.requests[bystander.request_id] = bystander
    gone = [make_request(f"gone{i}", [i] * (2 * BLOCK)) for i in range(5)]
    assert not any(look(r) for r in gone)  # held: vLLM skips them this step
    assert hold.held_requests == 5 and not hold._holding and CountingRequests.scans == 1  # unknown ids went
    waiting = [make_request(f"w{i}", [i] * (2 * BLOCK)) for i in range(11)]
    for r in waiting:
        scheduler.requests[r.request_id] = r
    scans = []
    for r in waiting:
        look(r)
        scans.append(CountingRequests.scans)
    assert hold.held_requests == 16 and len(hold._holding) == 11
    # One scan at the 5th hold (5 kept: the next waits for 10 held), the next at the 11th.
    assert scans == [1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 3]
    look(waiting[0])  # held again at the next step: the same hold, not a new one
    assert hold.held_requests == 16
