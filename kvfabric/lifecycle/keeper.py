"""The statistics keeper: the expander's side-table logic without events, for a policy inside vLLM.

It runs on vLLM's scheduler thread (the engine's ``Recorder`` applies each record to it as the record is made);
the engine's steering owns the one instance per pool and is the only code that creates it. It emits nothing and
does no I/O: policies read its :class:`~kvfabric.lifecycle.side_table.SideTable`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from kvfabric.contract import records as R
from kvfabric.lifecycle.expander import Expander, hash64, hash64_all
from kvfabric.lifecycle.side_table import ALL_COLUMNS, CANDIDATE_COLUMNS, INDEX_COLUMNS, LEAN_COLUMNS


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


class StatisticsKeeper(Expander):
    """The side table alone, for a policy inside vLLM: the same handlers, no events, no evicted-digest memory.

    ``last_use`` is written on ``clock`` (the victim index's logical clock), the clock policies see as ``now``.
    Scores and protection flags are the expander's alone (``SCORED`` records): nothing in-process reads them.

    ``reads``: the columns the policy reads (``EvictionPolicy.reads``). When they and the victim index's are all
    lean (:data:`~kvfabric.lifecycle.side_table.LEAN_COLUMNS`), only those are kept, with the side table's lean
    operations: a free then costs nothing here, a touch one addition per block, an eviction one write. This runs on
    vLLM's scheduler thread, once per block of every call (``benchmarks/results/hook_overhead.md``), so the records it
    has nothing to do for have no handler at all (:attr:`handler` answers None for them: no call is made), and a
    lean sealing is one side-table call per record.
    """

    def __init__(self, num_blocks: int, clock: Callable[[], int], null_block: int = 0,
                 reads: Iterable[str] = ALL_COLUMNS) -> None:
        super().__init__(num_blocks=num_blocks, emit=_nothing, null_block=null_block)
        self.rows = False
        self.clock = clock
        handlers = self._handlers
        for op in (R.LOOKUP, R.ADMITTED, R.CANCELLED, R.DONE, R.LIMITED, R.SCORED, R.LOST):
            del handlers[op]
        self.lean = (INDEX_COLUMNS | set(reads)) <= LEAN_COLUMNS
        #: Whether the policy reads only :data:`~kvfabric.lifecycle.side_table.CANDIDATE_COLUMNS`: then no sealing is
        #: followed (a call per sealing call on vLLM's path, benchmarks/results/hook_calls.md), and steering names
        #: each candidate's content and gives the index its parent links from the free (``Steering.freed``).
        self.sealless = self.lean and set(reads) <= CANDIDATE_COLUMNS
        if self.lean:
            handlers[R.ALLOCATED] = self._lean_allocated
            handlers[R.TOUCHED] = self._lean_touched
            handlers[R.SEALED] = self._lean_sealed
            del handlers[R.FREED]  # only ``last_use`` and the expander's ref counts move on a free
        if self.sealless:
            del handlers[R.SEALED]
        #: The handler of a record's op, or None when this keeper has nothing to do for it (the recorder's hot
        #: path looks it up itself: one call per record instead of two, none for the records it skips).
        self.handler: Callable[[int], Callable[[tuple], None] | None] = handlers.get

    def apply(self, records: Iterable[tuple]) -> None:
        for rec in records:
            self.apply_one(rec)

    def apply_one(self, record: tuple) -> None:
        fn = self.handler(record[0])
        if fn is not None:
            fn(record)

    def follow(self, op: int, fn: Callable[[tuple], None]) -> None:
        """After this keeper applies each ``op`` record, ``fn(record)`` sees it too (steering follows touches this
        way: a touched block left vLLM's free list). ``fn`` handles its own errors."""
        apply = self._handlers.get(op)
        if apply is None:  # (a lean keeper ignores frees: no call for it)
            self._handlers[op] = fn
            return

        def both(rec: tuple) -> None:
            apply(rec)
            fn(rec)

        self._handlers[op] = both

    def _lean_allocated(self, rec: tuple) -> None:
        self.table.forget_all(rec[4])  # a block still holding content was just evicted by vLLM to be reused

    def _lean_touched(self, rec: tuple) -> None:
        self.table.hit_all(rec[4], self.null_block)

    def _lean_sealed(self, rec: tuple) -> None:
        _, _ts, _step, _rid, _family, start, prev, ids, raws, parent_raw = rec
        t = self.table
        null = self.null_block
        prev_id = -1 if prev is None or prev == null else prev
        parent = t.hash[prev_id] if prev_id >= 0 else None
        if parent is None and parent_raw is not None:
            parent = hash64(parent_raw)
        t.seal_run_lean(ids, hash64_all(raws), parent, prev_id, start, null)

    def _stamp(self, ts: int) -> int:
        return self.clock()

    _row = _nothing  # type: ignore[assignment]  # (handlers without a per-block loop still call it)
