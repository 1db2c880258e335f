"""Test policies and an owner for driving victim indexes without vLLM (tests/policies/test_policies.py,
tests/policies/test_native_index.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvfabric.lifecycle.side_table import SideTable
from kvfabric.policies.base import EvictionPolicy


class Owner:
    def __init__(self, n: int) -> None:
        self.table = SideTable(n)


class KeyFromTable(EvictionPolicy):
    """Test policy: the key is whatever the test wrote into ``hits`` (a heap policy)."""

    name = "test_heap"
    structure = "heap"

    def key(self, t: Any, b: int, now: int, ctx: Any) -> float:
        return float(t.hits[b])


class SegmentFromTable(KeyFromTable):
    name = "test_segments"
    structure = "segments"
    num_segments = 3


def forest(owner: Owner, parents: list[int]) -> Callable[[int], list[int]]:
    """Write a forest into ``owner``'s table (block b's parent: ``parents[b]`` when lower than b, else none; each
    block's content 1000 + b) and return ``chain_of(b)``: b and its ancestors, leaf first (a free's order)."""
    t = owner.table
    for b, wanted in enumerate(parents):
        p = wanted if wanted < b else -1
        t.hash[b] = 1000 + b
        t.parent_block[b] = p
        t.parent[b] = None if p < 0 else 1000 + p

    def chain_of(b: int) -> list[int]:
        out = [b]
        while t.parent_block[out[-1]] >= 0:
            out.append(t.parent_block[out[-1]])
        return out

    return chain_of
