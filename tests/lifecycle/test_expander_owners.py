"""Whose each row is, on the rows the scheduler test does not reach: the expander stamps the stream's ``host`` and
``dp_rank`` on every row, a request's ``tenant``/``lora`` on its request-level rows, and a block's (the request
that sealed it) on its rows until its content goes: through a move, a connector's eviction and a reset, and never
on a row of no request (``cache_reset``, ``sink_dropped``, a deferred free of an unsealed block)."""

from __future__ import annotations

from typing import Any

from kvfabric.contract import records as R
from kvfabric.contract import schema as S
from kvfabric.lifecycle.expander import Expander
from kvfabric.lifecycle.keeper import StatisticsKeeper

H1, H2 = b"\x01" * 8, b"\x02" * 8
T = 1_000

RECORDS: list[tuple] = [
    (R.LOOKUP, T, 1, "a", "fam", 40, 3, 0, [H1, H2], "t1", "ad"),
    (R.ALLOCATED, T, 1, "a", [1, 2, 3], None),
    (R.LIMITED, T, 1, "a", "fam", 1),  # (the gate kept one of a's blocks out)
    (R.SEALED, T, 1, "a", "fam", 0, None, [1, 2], [H1, H2], None),
    (R.ADMITTED, T, 1, "a"),
    (R.MOVED, T + 1, 2, "a", 2, 4),  # block 2's content now lives in block 4
    (R.FREED, T + 2, 3, "a", [3, 2, 1], [0, 0, 0]),  # 3 never sealed (a partial block), 2 emptied by the move
    (R.DONE, "a"),
    (R.FREED, T + 3, 4, None, [4, 5], [0, 0]),  # deferred frees: a sealed block and an unsealed one
    (R.LOOKUP, T + 4, 5, "b", None, 16, 1, 0, [], "t2", None),
    (R.EVICTING, T + 4, 5, "b", [4], [H2]),  # a connector drops a's content while b's call is in progress
    (R.LOST, T + 5, 7),
    (R.RESET, T + 6, 6),
]


def rows() -> list[dict[str, Any]]:
    out: list[tuple] = []
    Expander(num_blocks=8, emit=out.append, engine="e", run_id="r", host="h", dp_rank=3).apply(RECORDS)
    return [dict(zip(S.EMIT_COLUMNS, row, strict=True)) for row in out]


def test_every_row_carries_the_streams_host_and_rank() -> None:
    got = rows()
    assert {S.SINK_DROPPED, S.CACHE_RESET, S.CACHE_ADMISSION_LIMITED} <= {r["event"] for r in got}
    assert all(r["host"] == "h" and r["dp_rank"] == 3 for r in got)


def test_owners_follow_requests_and_block_contents() -> None:
    owned = [(r["event"], r["request_id"], r["block_id"], r["tenant"], r["lora"]) for r in rows()]
    assert owned == [
        (S.BLOCK_ALLOCATED, "a", 1, "t1", "ad"),
        (S.BLOCK_ALLOCATED, "a", 2, "t1", "ad"),
        (S.BLOCK_ALLOCATED, "a", 3, "t1", "ad"),
        (S.CACHE_ADMISSION_LIMITED, "a", None, "t1", "ad"),
        (S.BLOCK_SEALED, "a", 1, "t1", "ad"),
        (S.BLOCK_SEALED, "a", 2, "t1", "ad"),
        (S.PREFIX_LOOKUP, "a", None, "t1", "ad"),
        (S.BLOCK_FREED, "a", 3, "t1", "ad"),  # unsealed: the request's
        (S.BLOCK_FREED, "a", 2, "t1", "ad"),  # emptied by the move: still the request's (it held it)
        (S.BLOCK_FREED, "a", 1, "t1", "ad"),
        (S.BLOCK_FREED, None, 4, "t1", "ad"),  # the moved content keeps its owner
        (S.BLOCK_FREED, None, 5, None, None),  # no content, no request: nobody's
        (S.BLOCK_EVICTED, "b", 4, "t1", "ad"),  # a's content, though b's call evicted it
        (S.SINK_DROPPED, None, None, None, None),
        (S.BLOCK_EVICTED, None, 1, "t1", "ad"),  # the reset drops a's first block
        (S.CACHE_RESET, None, None, None, None),
    ]


def test_an_owner_leaves_with_its_content() -> None:
    out: list[tuple] = []
    e = Expander(num_blocks=8, emit=out.append, engine="e", run_id="r", host="h", dp_rank=0)
    e.apply(RECORDS)
    assert e.owners == {"b": ("t2", None)}  # a is done; b is still live
    assert e.block_owner == [None] * 8  # every content went (moved away, evicted, reset)
    # A block reused by a request of another tenant: its new content is that tenant's (here the digest a's reset
    # dropped: in vLLM another tenant's content has another hash, the expander does not rely on it).
    del out[:]
    e.apply([(R.ALLOCATED, T + 7, 8, "b", [1], None),
             (R.SEALED, T + 7, 8, "b", None, 0, None, [1], [H1], None)])
    event = S.EMIT_COLUMNS.index("event")
    assert [(r[event], r[-2], r[-1]) for r in out] == [
        (S.BLOCK_ALLOCATED, "t2", None), (S.BLOCK_SEALED, "t2", None), (S.BLOCK_REBUILT, "t2", None)]


def test_the_keeper_keeps_no_owners() -> None:
    """Steering's keeper (vLLM's scheduler thread) pays nothing for owners: no lookups kept, no block owner set."""
    keeper = StatisticsKeeper(8, clock=lambda: 0)
    for rec in RECORDS:
        keeper.apply_one(rec)
    assert keeper.owners == {} and keeper.block_owner == [None] * 8
