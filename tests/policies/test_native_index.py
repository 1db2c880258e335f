"""The compiled victim index (kvfabric/policies/_order.c through native_index.py) against the Python one.

The two must make the same decisions for the same calls: side by side under random operations (adversarial keys
along chains, so deferral and restores happen), every answer and every block's state is compared. Bad input must
raise and change nothing. ``KVFABRIC_NATIVE=0`` must give the Python index. The reference-model tests of
tests/policies/test_policies.py run on both implementations too.
"""

from __future__ import annotations

import math
from array import array
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.index_testkit import KeyFromTable as TableKey
from support.index_testkit import Owner, forest

from kvfabric.engine.config import load_hook_settings
from kvfabric.policies.base import EvictionPolicy
from kvfabric.policies.index import HeapIndex, SegmentedIndex, VictimIndex
from kvfabric.policies.indexes import make_index
from kvfabric.policies.native_index import BUILT, NativeIndex


class KeyFromTable(TableKey):
    """A block's key is half what the test wrote into ``hits`` (keys in any order along a chain; halves, so that
    segment mode truncates, as Python's int() does)."""

    def key(self, t: Any, b: int, now: int, ctx: Any) -> float:
        return float(t.hits[b]) / 2


class SegmentFromTable(KeyFromTable):
    name = "test_segments"
    structure = "segments"
    num_segments = 4


def state(index: VictimIndex, n: int) -> tuple:
    """Everything observable of an index: membership, keys, links, child counts, deferral, counters."""
    held = [bool(index.held[b]) for b in range(n)]
    return (held, [float(index.keys[b]) if held[b] else None for b in range(n)],
            [index.link[b] if held[b] else -1 for b in range(n)], [index.nkids[b] for b in range(n)],
            [bool(index.deferred[b]) for b in range(n)], len(index), index.descents, index.restores)


N = 14


@pytest.mark.parametrize("policy_cls", [KeyFromTable, SegmentFromTable])
@settings(max_examples=300, deadline=None)
@given(parents=st.lists(st.integers(-1, N - 1), min_size=N, max_size=N),
       ops=st.lists(st.tuples(st.sampled_from(["add", "chain", "chain", "discard", "touch", "pop", "pop_n"]),
                              st.integers(0, N - 1), st.integers(-6, 12)), max_size=200))
def test_native_and_python_indexes_decide_alike(policy_cls: type[EvictionPolicy], parents: list[int],
                                                 ops: list[tuple[str, int, int]]) -> None:
    """Same calls, same answers, same state after each: the compiled index is a faster copy, not a new policy."""
    owner = Owner(N)
    t = owner.table
    chain_of = forest(owner, parents)
    py = (HeapIndex if policy_cls.structure == "heap" else SegmentedIndex)(policy_cls(), owner, N)
    nat = NativeIndex(policy_cls(), owner, N, segments=policy_cls.structure == "segments")
    for op, b, key in ops:
        if op in ("add", "chain"):
            ids = [b] if op == "add" else chain_of(b)
            for depth, x in enumerate(ids):
                t.hits[x] = key + 5 * depth if depth % 2 else key - depth  # non-monotone along the chain
            hook_parents = [*ids[1:], -1] if op == "chain" and b % 2 else None  # the hook's links, or the table's
            assert py.add_many(list(ids), None, hook_parents) == nat.add_many(list(ids), None, hook_parents)
        elif op == "discard":
            assert py.discard(b) == nat.discard(b)
        elif op == "touch":
            ids = chain_of(b)
            py.discard_all(ids)
            nat.discard_all(ids)
        elif op == "pop":
            assert py.pop() == nat.pop()
        else:
            count = 1 + (key % 5)
            assert py.pop_n(count) == nat.pop_n(count)
        assert state(py, N) == state(nat, N)
    # Drain: the whole remaining order agrees too.
    assert py.pop_n(N) == nat.pop_n(N) and len(nat) == 0


def test_bad_input_raises_and_changes_nothing() -> None:
    owner = Owner(6)
    index = NativeIndex(KeyFromTable(), owner, 6, segments=False)
    index.add_many([1, 2], None, [2, -1])
    before = state(index, 6)
    core = index.core
    bad_inserts = [
        ([6], [0.0], [-1], IndexError),  # past the pool
        ([-1], [0.0], [-1], IndexError),
        ([3], [0.0], [9], IndexError),  # a parent past the pool
        ([3, 3], [0.0, 0.0], [-1, -1], ValueError),  # repeated
        ([1], [0.0], [-1], ValueError),  # already held
        ([3], [math.nan], [-1], ValueError),
        ([3], [0.0], [3], ValueError),  # its own parent
        ([3, 4], [0.0], [-1, -1], ValueError),  # lengths differ
        ([3], ["x"], [-1], TypeError),
        ((3,), [0.0], [-1], TypeError),  # not lists
    ]
    for ids, keys, parents, exc in bad_inserts:
        with pytest.raises(exc):
            core.insert(ids, keys, parents)
        assert state(index, 6) == before, (ids, keys, parents)
    for ids in ([0, 7], [None], 5):
        with pytest.raises((IndexError, TypeError)):
            index.discard_all(ids)  # type: ignore[arg-type]
        assert state(index, 6) == before
    with pytest.raises(TypeError):
        index.pop_n("2")  # type: ignore[arg-type]
    assert index.pop_n(5) == [1, 2] and index.pop() is None and index.pop_n(-3) == []


def test_the_core_refuses_arrays_it_cannot_use() -> None:
    from kvfabric.policies._order import Core

    n = 4
    good = [array("B", bytes(n)), array("d", bytes(8 * n)), array("i", [-1]) * n, array("i", [0]) * n,
            array("B", bytes(n))]
    core = Core(*good)
    for i, wrong in enumerate([array("b", bytes(n)), array("f", bytes(4 * n)), array("q", [-1]) * n,
                               array("i", [0]) * (n + 1), bytes(n)]):
        args = list(good)
        args[i] = wrong
        with pytest.raises((TypeError, ValueError, BufferError)):
            Core(*args)
    dirty = list(good)
    dirty[0] = array("B", [0, 1, 0, 0])
    with pytest.raises(ValueError):
        Core(*dirty)
    with pytest.raises(BufferError):  # the core holds the arrays: they cannot be resized under it
        good[0].append(0)
    del core
    good[0].append(0)  # (released with it)


def test_the_compiled_index_is_built_and_chosen_unless_switched_off() -> None:
    """The install builds it (a compiler is on every machine this suite runs on); make_index picks it by default,
    and ``KVFABRIC_NATIVE=0`` picks the Python index."""
    assert BUILT
    owner = Owner(4)
    assert type(make_index(KeyFromTable(), owner, 4)) is NativeIndex
    assert type(make_index(SegmentFromTable(), owner, 4, native=False)) is SegmentedIndex
    assert load_hook_settings({}).native is True
    assert load_hook_settings({"KVFABRIC_NATIVE": "0"}).native is False
    assert load_hook_settings({"KVFABRIC_NATIVE": "off"}).native is False
