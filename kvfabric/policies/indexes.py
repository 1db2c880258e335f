"""The victim index a policy asks for: compiled where built, else the Python reference (one choice, one place).

Above both index modules (:mod:`.index`, :mod:`.native_index`, which subclasses the reference), so neither imports
the other back.
"""

from __future__ import annotations

from kvfabric.policies.base import EvictionPolicy, TableOwner
from kvfabric.policies.index import HeapIndex, SegmentedIndex, VictimIndex
from kvfabric.policies.native_index import BUILT, NativeIndex


def make_index(policy: EvictionPolicy, owner: TableOwner, num_blocks: int, native: bool = True) -> VictimIndex:
    """The structure a policy asks for (its ``structure`` class attribute): compiled
    (:class:`~kvfabric.policies.native_index.NativeIndex`, the same order) where it is built and ``native``, else
    the Python one of :mod:`kvfabric.policies.index`."""
    if policy.structure not in ("segments", "heap"):
        raise ValueError(f"policy {policy.name!r} asks for an unknown structure {policy.structure!r}")
    if native and BUILT:
        return NativeIndex(policy, owner, num_blocks, segments=policy.structure == "segments")
    if policy.structure == "segments":
        return SegmentedIndex(policy, owner, num_blocks)
    return HeapIndex(policy, owner, num_blocks)
