"""The victim index with its bookkeeping and order compiled (``_order.c``): same decisions, less time in vLLM.

:class:`NativeIndex` keeps :class:`~kvfabric.policies.index.VictimIndex`'s contract exactly (the same victims in
the same order for the same calls: ``tests/policies/test_native_index.py`` checks it against :class:`HeapIndex` and
:class:`SegmentedIndex` under random operations). Only the storage differs: each block's state is a slot of an
``array.array`` (``held``, ``keys``, ``link``, ``nkids``, ``deferred``; Python reads them as it reads the lists of
the Python index), and the order is the C core's indexed heap by (order key, arrival), which has no stale entries.

Why: on vLLM's scheduler thread the index runs once per free, touch and eviction, and the Python index's time
there is mostly cache misses on per-block Python objects (``benchmarks/results/hook_calls.md`` at cf5f3b9: the
Python index's ``pop()`` cost 9.01 µs in place against 3.4 µs warm). The policy's keys stay in Python: the core
only orders what they say.

The extension is built by ``pip install`` where a C compiler is found (setup.py marks it optional); without it,
:func:`~kvfabric.policies.indexes.make_index` returns the Python index, as steering asks for with
``KVFABRIC_NATIVE=0``.
"""

from __future__ import annotations

from array import array

from kvfabric.policies.base import EvictionPolicy, TableOwner
from kvfabric.policies.index import VictimIndex

try:
    from kvfabric.policies._order import Core
except ImportError:  # (not built: no compiler at install time, or a source tree without a build)
    Core = None

BUILT = Core is not None
"""Whether the compiled core is importable here."""


class NativeIndex(VictimIndex):
    """:class:`VictimIndex` on the compiled core: ``segments`` orders by segment (``SegmentedIndex``'s order: the
    key's integer part, clamped to the policy's ``num_segments``), else by key (``HeapIndex``'s)."""

    def __init__(self, policy: EvictionPolicy, owner: TableOwner, num_blocks: int, *, segments: bool) -> None:
        if Core is None:
            raise RuntimeError("kvfabric's compiled index (kvfabric.policies._order) is not built here")
        # (VictimIndex.__init__ is not called: its per-block lists are these arrays here.)
        self.policy = policy
        self.owner = owner
        self.num_blocks = num_blocks
        self.now = 0
        self.held = array("B", bytes(num_blocks))
        self.keys = array("d", bytes(8 * num_blocks))
        self.link = array("i", [-1]) * num_blocks
        self.nkids = array("i", [0]) * num_blocks
        self.deferred = array("B", bytes(num_blocks))
        last = max(1, policy.num_segments) - 1 if segments else -1
        self.core = Core(self.held, self.keys, self.link, self.nkids, self.deferred, last)
        # The hot calls go straight to C (no Python frame of ours around them).
        self.discard_all = self.core.discard_all  # type: ignore[method-assign]
        self.pop = self.core.pop  # type: ignore[method-assign]
        self.pop_n = self.core.pop_n  # type: ignore[method-assign]
        policy.bind(num_blocks)
        policy.bind_index(self)

    @property
    def size(self) -> int:  # type: ignore[override]
        return self.core.size

    @property
    def descents(self) -> int:  # type: ignore[override]
        return self.core.descents

    @property
    def restores(self) -> int:  # type: ignore[override]
        return self.core.restores

    def _place(self, ids: list[int], keys: list[float], parents: list[int]) -> None:
        self.core.insert(ids, keys, parents)  # (checks everything first; clamps ``keys`` in place)

    # The core orders blocks itself: VictimIndex's generic pop_n and its structure hooks are never reached.
    def _insert_many(self, ids: list[int], keys: list[float]) -> None:
        raise AssertionError("unreachable: NativeIndex inserts through its core")

    def _remove_many(self, ids: list[int]) -> None:
        raise AssertionError("unreachable: NativeIndex removes through its core")

    def _take_run(self, limit: int) -> list[int]:
        raise AssertionError("unreachable: NativeIndex pops through its core")

    def _restore(self, b: int) -> None:
        raise AssertionError("unreachable: NativeIndex restores in its core")
