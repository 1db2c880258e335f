"""Policies, victim indexes, the admission gate and the offline replay (no vLLM needed).

The index is checked against a reference model under random operations; the offline cache's invariants are checked
after every request of random traces for every policy; and on the real traces' first rows the offline optimum
must dominate every policy while adaptive_aging must not fall below LRU.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.index_testkit import KeyFromTable, Owner, SegmentFromTable, forest

from kvfabric.contract.records import expand_report
from kvfabric.lifecycle.side_table import SideTable
from kvfabric.policies import POLICY_NAMES, make_policy
from kvfabric.policies.admission import AnchorAdmissionGate
from kvfabric.policies.base import EvictionPolicy, RequestInfo
from kvfabric.policies.builtin import AdaptiveAgingPolicy, _GhostSet
from kvfabric.policies.index import HeapIndex, VictimIndex
from kvfabric.policies.indexes import make_index
from kvfabric.policies.native_index import NativeIndex
from kvfabric.sim.offline import OfflineCache, TraceRequest, block_keys, load_trace, simulate

# The full traces are too big to carry in the repository: they sit beside the checkout (docs/design.md §8).
TRACES = Path(__file__).resolve().parents[2] / ".." / "shared" / "traces"
CONVERSATION = TRACES / "mooncake_conversation_first_half.jsonl"
SYNTHETIC = TRACES / "mooncake_synthetic_trace.jsonl"


#: Both implementations of the victim index: this module's, and the compiled one (built by the install; where it is
#: missing the native cases fail, so a run that tests only the fallback cannot pass for one that tests both).
IMPLEMENTATIONS = [pytest.param(False, id="python"), pytest.param(True, id="native")]


def new_index(policy: EvictionPolicy, owner: Any, n: int, native: bool) -> VictimIndex:
    index = make_index(policy, owner, n, native=native)
    assert isinstance(index, NativeIndex) == native, "the compiled index is not built here"
    return index


@pytest.mark.parametrize("native", IMPLEMENTATIONS)
@pytest.mark.parametrize("policy_cls", [KeyFromTable, SegmentFromTable])
@settings(max_examples=150, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["add", "discard", "pop"]), st.integers(0, 15), st.integers(0, 2)),
                    max_size=120))
def test_index_matches_reference_model(policy_cls: type[EvictionPolicy], native: bool,
                                       ops: list[tuple[str, int, int]]) -> None:
    """Without parent links, pop order is (key, arrival order); each block held at most once."""
    owner = Owner(16)
    index = new_index(policy_cls(), owner, 16, native)
    model: dict[int, tuple[int, int]] = {}
    arrival = 0
    for op, b, key in ops:
        if op == "add":
            owner.table.hits[b] = key
            index.add(b)
            if b not in model:
                arrival += 1
                model[b] = (key, arrival)
        elif op == "discard":
            assert index.discard(b) == (b in model)
            model.pop(b, None)
        else:
            got = index.pop()
            if not model:
                assert got is None
            else:
                want = min(model, key=lambda x: model[x])
                assert got == want
                del model[want]
        assert len(index) == len(model)
        assert all((b in index) == (b in model) for b in range(16))


@pytest.mark.parametrize("native", IMPLEMENTATIONS)
def test_index_evicts_descendants_first_whatever_the_keys(native: bool) -> None:
    """A chain 1 <- 2 <- 3 whose keys put the root first still leaves leaf first."""
    owner = Owner(8)
    t = owner.table
    for b, parent in ((1, -1), (2, 1), (3, 2), (4, 1)):
        t.hash[b] = 100 + b
        t.parent_block[b] = parent
        t.parent[b] = None if parent < 0 else 100 + parent
        t.hits[b] = b  # root lowest
    index = new_index(KeyFromTable(), owner, 8, native)
    for b in (3, 2, 4, 1):
        index.add(b)
    order = [index.pop() for _ in range(4)]
    assert order.index(3) < order.index(2) < order.index(1) and order.index(4) < order.index(1)
    assert index.pop() is None
    # A dead link (the parent's content changed) is no link at all.
    t.hash[1] = 999
    index.add(2)
    index.add(1)
    t.hits[2] = 5
    assert index.pop() == 1


def test_heap_index_compacts_stale_entries() -> None:
    """Discards are lazy (a stale entry stays until it reaches a head), and stale entries, in lanes or in the heap
    (blocks that fit no lane), are rebuilt away: memory stays O(pool)."""
    n = HeapIndex.LANES + 2
    owner = Owner(n)
    index = HeapIndex(KeyFromTable(), owner, n)
    owner.table.hits[0], owner.table.hits[1] = 1, 2
    index.add(0)
    for _ in range(1000):
        index.add(1)
        index.discard(1)
        assert sum(map(len, index.lanes)) <= 4 * n + 64 and index.heap == []
    assert len(index) == 1 and index.entries <= 4 * n + 64
    index.discard(0)
    for b in range(HeapIndex.LANES):  # falling keys: one lane each, every lane's last key above what follows
        owner.table.hits[b] = 100 - b
        index.add(b)
    assert len(index.lanes) == HeapIndex.LANES and index.heap == []
    last = HeapIndex.LANES
    owner.table.hits[last] = 1
    for _ in range(5000):
        index.add(last)
        assert len(index.heap) + sum(map(len, index.lanes)) <= 4 * n + 64
        index.discard(last)
    assert index.heap
    index.add(last)
    assert [index.pop() for _ in range(HeapIndex.LANES + 1)] == [last, *reversed(range(HeapIndex.LANES))]
    assert index.pop() is None and len(index) == 0


def test_a_run_stops_where_a_victim_puts_its_deferred_parent_back() -> None:
    """A parent that reached the top with a held child was set aside; the child's leaving puts it back, ranked
    before the rest of the run the child came in (same lane, taken in one call), so that rest waits for it."""
    owner = Owner(3)
    t = owner.table
    child, other, parent = 0, 1, 2
    for b in (child, other, parent):
        t.hash[b] = 100 + b
    t.parent_block[child], t.parent[child] = parent, 100 + parent
    index = HeapIndex(KeyFromTable(), owner, 3)
    for b, key in ((child, 10), (other, 11), (parent, 5)):  # adversarial: the parent's key is the lowest
        t.hits[b] = key
        index.add(b)
    assert len(index.lanes) == 2  # child and other share a lane (rising keys): one run
    assert index.pop_n(3) == [child, parent, other]
    assert index.descents == 1 and index.restores == 1 and len(index) == 0


@pytest.mark.parametrize("native", IMPLEMENTATIONS)
@pytest.mark.parametrize("policy_cls", [KeyFromTable, SegmentFromTable])
def test_a_deferred_parent_comes_back_when_its_last_child_is_touched(policy_cls: type[EvictionPolicy],
                                                                    native: bool) -> None:
    """A parent set aside (it reached the top with held children) returns to its place when its last held child
    leaves by a touch (``discard_all``: one call for a touch's blocks) rather than as a victim."""
    owner = Owner(4)
    t = owner.table
    parent, kid1, kid2, other = 0, 1, 2, 3
    for b in (parent, kid1, kid2, other):
        t.hash[b] = 100 + b
    for kid in (kid1, kid2):
        t.parent_block[kid], t.parent[kid] = parent, 100 + parent
    index = new_index(policy_cls(), owner, 4, native)
    for b, key in ((kid1, 2), (kid2, 2), (parent, 0), (other, 1)):  # adversarial: the parent's key is the lowest
        t.hits[b] = key
        index.add(b)
    assert index.pop() == other  # the parent reached the top first and was set aside: its children are held
    assert index.descents == 1 and index.deferred[parent]
    index.discard_all([kid1, kid2])  # a prefix hit takes both children back into use
    assert not index.deferred[parent] and index.restores == 1
    assert index.pop() == parent and index.pop() is None and len(index) == 0


@pytest.mark.parametrize("native", IMPLEMENTATIONS)
@pytest.mark.parametrize("policy_cls", [KeyFromTable, SegmentFromTable])
@settings(max_examples=200, deadline=None)
@given(parents=st.lists(st.integers(-1, 11), min_size=12, max_size=12),
       ops=st.lists(st.tuples(st.sampled_from(["add", "add", "chain", "discard", "unchain", "pop"]),
                              st.integers(0, 11), st.integers(0, 40)), max_size=150))
def test_index_matches_reference_model_with_chains(policy_cls: type[EvictionPolicy], native: bool, parents: list[int],
                                                   ops: list[tuple[str, int, int]]) -> None:
    """With parent links (random forests, keys in any order along a chain): ``pop`` returns the lowest (key,
    arrival) among held blocks none of whose held children link to them, keys clamped at add under a held parent's.
    Exercises the heap's lanes (keys 0-40 in any order), its heap, deferral, and runs of several victims per call.
    ``chain`` adds a block and its ancestors in one call, tail first (how vLLM frees a request's blocks: the bulk
    path of ``add_many``), ``unchain`` discards them in one call: both mean the same as one block at a time."""
    n = 12
    owner = Owner(n)
    t = owner.table
    chain_of = forest(owner, parents)
    index = new_index(policy_cls(), owner, n, native)
    clamp = (lambda k: k) if policy_cls.structure == "heap" else (lambda k: min(max(k, 0), 2))
    model: dict[int, tuple[float, int]] = {}
    link: dict[int, int] = {}
    arrival = 0
    for op, b, key in ops:
        if op in ("add", "chain"):
            ids = [b] if op == "add" else chain_of(b)
            for depth, x in enumerate(ids):
                t.hits[x] = (key + 17 * depth) % 41  # keys in any order along the chain
            added, keys = index.add_many(ids)
            want_added = [x for x in ids if x not in model]
            for x in want_added:
                k = float(t.hits[x])
                p = t.parent_block[x]
                if p >= 0:
                    link[x] = p
                    if p in model and model[p][0] < k:
                        k = model[p][0]
                arrival += 1
                model[x] = (k, arrival)
            assert added == want_added
            assert keys == [model[x][0] for x in want_added]
        elif op in ("discard", "unchain"):
            ids = [b] if op == "discard" else chain_of(b)
            if op == "discard":
                assert index.discard(b) == (b in model)
            else:
                index.discard_all(ids)
            for x in ids:
                model.pop(x, None)
                link.pop(x, None)
        else:
            # pop_n(1..4): runs taken in one call, the rest of a run put back when a victim frees a deferred parent
            count = 1 + key % 4
            got_n = index.pop_n(count)
            want_n = []
            while model and len(want_n) < count:
                eligible = [x for x in model if not any(link.get(c) == x for c in model)]
                assert eligible, "a forest always has a held leaf"
                want = min(eligible, key=lambda x: (clamp(model[x][0]), model[x][1]))
                want_n.append(want)
                del model[want]
                link.pop(want, None)
            assert got_n == want_n
        assert len(index) == len(model)
        assert all((x in index) == (x in model) for x in range(n))


def test_policy_names_are_constructible_and_keys_monotone_along_a_chain() -> None:
    t = SideTable(4)
    # parent 1 (shallower, more hits/users/children) and child 2
    t.hash[1], t.hash[2] = 11, 12
    t.depth[1], t.depth[2] = 0, 1
    t.hits[1], t.hits[2] = 3, 1
    t.share[1], t.share[2] = 3, 2
    t.branch[1], t.branch[2] = 2, 0
    for name in POLICY_NAMES:
        policy = make_policy(name)
        policy.bind(4)
        assert policy.name == name
        assert policy.key(t, 1, 10, None) >= policy.key(t, 2, 10, None), name


def test_ghost_set_is_bounded_and_remembers_recent() -> None:
    g = _GhostSet(100)
    for h in range(1000):
        g.add(h)
    assert len(g) <= 100
    assert g.pop(999) and not g.pop(999) and not g.pop(0)


def test_adaptive_aging_learns_credit_from_ghosts_and_honours_hints() -> None:
    p = AdaptiveAgingPolicy()
    p.bind(8)
    t = SideTable(8)
    t.hash[1], t.share[1], t.hits[1] = 21, 1, 0  # unproven
    t.hash[2], t.share[2], t.hits[2] = 22, 2, 1  # proven
    assert p.key(t, 1, 5, None) == p.key(t, 2, 5, None) == 5.0  # credit 0: exactly LRU
    p.on_evicted(t, 2, 5)  # a proven block evicted ...
    p.on_request_started(RequestInfo("r"), 0, 1, [22])  # ... and wanted again: more credit
    assert p.credit > 0 and p.key(t, 2, 6, None) > p.key(t, 1, 6, None)
    credit = p.credit
    p.on_evicted(t, 1, 7)  # an unproven block evicted and wanted again: less credit
    p.on_request_started(RequestInfo("r2"), 0, 1, [21])
    assert p.credit < credit
    t.hash[3], t.share[3] = 23, 1
    # The request context is an argument: the same block keyed for different freeing requests.
    assert p.key(t, 3, 9, RequestInfo("s", session="x", session_end=True)) < 0  # an ended session goes first
    assert p.key(t, 3, 9, RequestInfo("s", session="x")) == 9 + p.credit  # live: its tail is its next prefix
    assert p.key(t, 3, 9, RequestInfo("s")) == 9.0  # no hint: plain recency


@settings(max_examples=150, deadline=None)
@given(
    hits=st.lists(st.integers(0, 2), min_size=1, max_size=12),
    credit=st.sampled_from([0.0, 4.0, 9.5]),
    ctx=st.sampled_from([None, RequestInfo("r"), RequestInfo("s", session="x"),
                         RequestInfo("e", session="x", session_end=True)]),
    clamp=st.lists(st.booleans(), min_size=12, max_size=12),
)
def test_every_policys_report_is_its_per_block_score_and_flag(hits: list[int], credit: float,
                                                              ctx: RequestInfo | None, clamp: list[bool]) -> None:
    """``report`` may answer in the uniform form (one score and one flag for all); either way it is exactly each
    block's ``retain_score`` and ``is_protected``, including keys clamped under a parent's (another class's key)."""
    n = len(hits)
    t = SideTable(n)
    for b, h in enumerate(hits):
        t.hash[b], t.hits[b], t.share[b], t.depth[b] = 100 + b, h, 1 + h, b
    ids = list(range(n))
    for name in POLICY_NAMES:
        policy = make_policy(name)
        policy.bind(n)
        if isinstance(policy, AdaptiveAgingPolicy):
            policy.credit = credit
        keys = policy.keys(t, ids, 7, ctx)
        keys = [keys[0] if c else k for k, c in zip(keys, clamp, strict=False)]  # (as add_many clamps them)
        scores, flags = expand_report(ids, *policy.report(t, ids, keys, 7))
        assert scores == [policy.retain_score(k, 7) for k in keys], name
        assert flags == [policy.is_protected(t, b, k, 7) for b, k in zip(ids, keys, strict=True)], name


def test_admission_gate_decision_is_sticky_and_bounded() -> None:
    gate = AnchorAdmissionGate(3, max_families=2, max_requests=2)
    assert gate.decide("a", "f", hinted=False) == 3
    assert gate.decide("a", "f", hinted=False) == 3  # sticky: the request does not become known to itself
    assert gate.decide("b", "f", hinted=False) is None
    assert gate.decide("c", "g", hinted=True) is None
    gate.decide("d", "h", hinted=False)
    assert len(gate.known) <= 2 and len(gate.decided) <= 2
    assert gate.limit(False, 1, 10) == 3 and gate.limit(False, 5, 10) == 5 and gate.limit(True, 1, 10) == 10


# --------------------------------------------------------------------------------------------- offline replay


def check_offline_invariants(cache: OfflineCache) -> None:
    index = cache.index
    for s in range(1, cache.num_blocks):
        k = cache.key_of[s]
        if k != -1:
            assert cache.slot_of[k] == s
        assert (s in index) == (cache.ref[s] == 0 and k != -1), s
    assert cache.num_free + sum(1 for s in range(1, cache.num_blocks) if cache.ref[s] > 0) == cache.num_blocks - 1
    assert all(cache.key_of[s] == -1 for s in cache.uncached_free)


TRACE_ROWS = st.lists(
    st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(1, 3), st.integers(1, 40)),
    min_size=1,
    max_size=40,
)


def rows_to_trace(rows: list[tuple[int, int, int, int]]) -> list[TraceRequest]:
    """(family, branch, private blocks, output) -> requests sharing family/branch prefixes, 64-token blocks."""
    out = []
    for i, (fam, branch, private, output) in enumerate(rows):
        ids = (fam, 10 + fam * 4 + branch, *(1000 + i * 8 + j for j in range(private)))
        out.append(TraceRequest(float(i), len(ids) * 512 - 100, output, ids))
    return out


@pytest.mark.parametrize("policy", [*POLICY_NAMES, "optimal"])
@settings(max_examples=25, deadline=None)
@given(rows=TRACE_ROWS, extra=st.integers(0, 40), concurrency=st.integers(1, 3), anchor=st.sampled_from([0, 2]))
def test_offline_cache_invariants(policy: str, rows: list[tuple[int, int, int, int]], extra: int,
                                  concurrency: int, anchor: int) -> None:
    trace = rows_to_trace(rows)
    bs = 128
    need = max(-(-(r.input_length + 8) // bs) for r in trace) * concurrency + 1
    seen: list[OfflineCache] = []
    original = OfflineCache.admit

    def admit(self: OfflineCache, *args: Any, **kwargs: Any) -> Any:
        check_offline_invariants(self)
        seen.append(self)
        return original(self, *args, **kwargs)

    OfflineCache.admit = admit  # type: ignore[method-assign]
    try:
        out = simulate(trace, policy, need + extra, block_size=bs, max_output_tokens=8, concurrency=concurrency,
                       anchor_blocks=anchor)
    finally:
        OfflineCache.admit = original  # type: ignore[method-assign]
    check_offline_invariants(seen[-1])
    assert out["requests"] == len(trace)
    assert 0 <= out["prefix_hit_tokens"] <= out["prompt_tokens"]


def test_block_keys_follow_vllm_granularity() -> None:
    r = TraceRequest(0, 1000, 1, (7, 9))
    assert block_keys(r, 512) == [7]
    keys = block_keys(r, 16)
    assert len(keys) == 1000 // 16 and keys[0] == 7 * 32 and keys[32] == 9 * 32 and keys[-1] == 9 * 32 + 29


def _prefix(path: Path, n: int) -> list[TraceRequest]:
    if not path.exists():
        pytest.skip(f"{path} not available")
    return load_trace(path, n)


@pytest.mark.parametrize("path", [CONVERSATION, SYNTHETIC])
def test_optimum_dominates_every_policy_on_trace_prefixes(path: Path) -> None:
    trace = _prefix(path, 1500)
    unique = len({k for r in trace for k in block_keys(r, 512)})
    for frac in (0.03, 0.1, 0.3):
        n = max(int(unique * frac), 400)
        rates = {p: simulate(trace, p, n, block_size=512)["prefix_hit_rate"] for p in (*POLICY_NAMES, "optimal")}
        assert all(rates["optimal"] >= r - 1e-9 for r in rates.values()), (frac, rates)


@pytest.mark.parametrize("path", [CONVERSATION, SYNTHETIC])
def test_adaptive_aging_and_learned_not_below_lru_on_full_traces(path: Path) -> None:
    """The headline claim, at three of the table's capacities (512-token blocks here, for speed), for
    adaptive_aging and for the learned policy with its built-in model (learned on the conversation trace at
    16-token blocks: out of sample on the synthetic trace).

    Tolerance 0.02 points: the conversation trace at 30% is a tie (-0.01 point, 3 blocks in 10^4 hits).
    """
    trace = _prefix(path, 100_000)
    unique = len({k for r in trace for k in block_keys(r, 512)})
    for frac in (0.02, 0.1, 0.3):
        n = int(unique * frac)
        lru = simulate(trace, "lru", n, block_size=512)["prefix_hit_rate"]
        for policy in ("adaptive_aging", "learned"):
            ours = simulate(trace, policy, n, block_size=512)["prefix_hit_rate"]
            assert ours >= lru - 2e-4, (frac, policy, lru, ours)


def test_load_trace_reads_rows(tmp_path: Path) -> None:
    f = tmp_path / "t.jsonl"
    f.write_text("\n".join(json.dumps({"timestamp": i, "input_length": 600, "output_length": 3,
                                       "hash_ids": [0, i + 1]}) for i in range(5)) + "\n")
    rows = load_trace(f, 3)
    assert len(rows) == 3 and rows[2].hash_ids == (0, 3) and rows[0].input_length == 600
