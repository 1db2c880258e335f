"""The compiled hooks' block-fields pass (kvfabric/engine/_recorder.c, ``columns``) against what the Python hooks'
list comprehensions build (:func:`reference`).

The compiled hooks' records list what this pass returns, so the two must agree on every input: vLLM's real slotted
blocks (the offset fast path), other objects (the getattr path), a pool filter, mixed types, unset slots and bad
arguments (the same exception type from both).
"""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import pytest
from vllm.v1.core.kv_cache_utils import KVCacheBlock

from kvfabric.engine import compiled


def reference(blocks: Any, names: tuple[str, ...], pool: Any = None) -> tuple[list[Any], ...]:
    """The Python hooks' way: a pool filter, then one list comprehension per field."""
    if not isinstance(names, tuple) or not 1 <= len(names) <= 4 or not all(isinstance(n, str) for n in names):
        raise TypeError("names must be a tuple of 1 to 4 attribute names")
    if pool is not None:
        blocks = [b for b in blocks if b.pool is pool]
    return tuple([getattr(b, name) for b in blocks] for name in names)


class PropertyBlock:
    """Not vLLM's block: its id is a property and its ref count a class attribute (no slot to read)."""

    __slots__ = ("pool",)
    ref_cnt = 0

    @property
    def block_id(self) -> int:
        return -7


class SubBlock(KVCacheBlock):
    """Another type with vLLM's slots (inherited) and a dict: the pass switches offsets by type."""


def blocks(n: int, pools: list[Any], seed: int) -> list[KVCacheBlock]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        b = KVCacheBlock(i)
        b.ref_cnt = rng.randint(0, 3)
        b.pool = rng.choice(pools)
        if rng.random() < 0.5:
            b._block_hash = rng.randbytes(12)
        out.append(b)
    return out


@pytest.mark.parametrize("seed", range(20))
def test_compiled_and_python_columns_agree_on_vllms_blocks(seed: int) -> None:
    pools = [object(), object()]
    bs = blocks(random.Random(seed).randint(0, 60), pools, seed)
    for names in [("block_id",), ("block_id", "ref_cnt"), ("block_id", "_block_hash"), ("block_hash",),
                  ("ref_cnt", "block_id", "is_null", "block_hash")]:
        for pool in (None, pools[0], pools[1], object()):
            got = compiled.columns(bs, names, pool)
            assert got == reference(bs, names, pool)
            assert len(got) == len(names)
        assert compiled.columns(tuple(bs), names) == reference(bs, names)  # any sequence


def test_compiled_columns_read_what_getattr_reads_for_any_object() -> None:
    pool = object()
    mixed: list[Any] = [KVCacheBlock(1), SimpleNamespace(block_id=2, ref_cnt=5, pool=pool), PropertyBlock(),
                        SubBlock(4), KVCacheBlock(5)]
    for b in mixed:
        b.pool = pool
    mixed[3].ref_cnt = 2
    want = ([1, 2, -7, 4, 5], [0, 5, 0, 2, 0])
    assert compiled.columns(mixed, ("block_id", "ref_cnt")) == reference(mixed, ("block_id", "ref_cnt")) == want
    mixed[4].pool = object()
    assert compiled.columns(mixed, ("block_id",), pool) == reference(mixed, ("block_id",), pool) == ([1, 2, -7, 4],)
    assert compiled.columns([], ("block_id", "ref_cnt")) == ([], [])


@pytest.mark.parametrize("fn", [compiled.columns, reference], ids=["compiled", "python"])
def test_bad_calls_raise_the_same_errors(fn: Any) -> None:
    b = KVCacheBlock(1)
    with pytest.raises(TypeError):
        fn([b], "block_id")  # a str, not a tuple
    with pytest.raises(TypeError):
        fn([b], ())
    with pytest.raises(TypeError):
        fn([b], ("a", "b", "c", "d", "e"))
    with pytest.raises(TypeError):
        fn([b], (1,))
    with pytest.raises(AttributeError):
        fn([b], ("no_such_field",))
    unset = KVCacheBlock(2)
    del unset.ref_cnt  # an empty slot
    with pytest.raises(AttributeError):
        fn([b, unset], ("block_id", "ref_cnt"))
    assert fn([b], ("block_id",), object()) == ([],)  # (not that pool's block)
    with pytest.raises(TypeError):
        fn(5, ("block_id",))
