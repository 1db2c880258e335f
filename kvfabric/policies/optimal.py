"""The offline optimum as a policy: Belady's MIN on block accesses, ties broken towards deeper blocks.

It needs the future, so it takes an oracle: ``occurrences[digest]`` is the sorted list of request positions (in
admission order) whose prompt holds that block. Its clock is the admission cursor: requests ``[0, cursor)`` have
been admitted (it advances in :meth:`on_request_started`). A block becoming a candidate gets the key
``-(next position >= cursor that needs it) * 2**20 - depth``: the farthest next use goes first, deeper first on
ties; blocks nobody needs again go first of all. A parent's next use is never later than its child's (every use of
a child is a use of its parent), so the order is prefix-closed.

The same class serves the offline replay (digests are the replay's block keys) and the real scheduler (digests
are the hook's 64-bit digests of vLLM's hashes); request positions come from :attr:`RequestInfo.position`.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from typing import ClassVar

from kvfabric.policies.base import BlockStats, EvictionPolicy, PolicySettings, RequestInfo

NEVER = 1 << 40


def occurrences_of(chains: Iterable[Sequence[int]]) -> dict[int, list[int]]:
    """``{digest: [positions of the chains holding it, ascending]}`` for chains in admission order."""
    occ: dict[int, list[int]] = {}
    for i, chain in enumerate(chains):
        for h in chain:
            rows = occ.get(h)
            if rows is None:
                occ[h] = [i]
            elif rows[-1] != i:
                rows.append(i)
    return occ


class OptimalPolicy(EvictionPolicy):
    """Belady's MIN given the future (see the module docstring)."""

    name: ClassVar[str] = "optimal"
    structure: ClassVar[str] = "heap"
    ranked: ClassVar[bool] = True
    reads: ClassVar[frozenset[str]] = frozenset({"hash", "depth"})

    def __init__(self, occurrences: dict[int, list[int]], settings: PolicySettings | None = None) -> None:
        super().__init__(settings)
        self.occurrences = occurrences
        self.cursor = 0  # requests [0, cursor) have been admitted

    def next_use(self, h: int | None) -> int:
        rows = self.occurrences.get(h) if h is not None else None
        if rows:
            j = bisect.bisect_left(rows, self.cursor)
            if j < len(rows):
                return rows[j]
        return NEVER

    def key(self, t: BlockStats, b: int, now: int, ctx: RequestInfo | None) -> float:
        return -float(self.next_use(t.hash[b]) * (1 << 20) + (t.depth[b] or 0))

    def on_request_started(self, info: RequestInfo, hit_blocks: int, num_blocks: int,
                           missed: Iterable[int] = (), digests: Sequence[int] | None = None) -> None:
        if info.position is not None and info.position + 1 > self.cursor:
            self.cursor = info.position + 1
