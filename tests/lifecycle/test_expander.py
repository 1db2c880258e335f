"""The expander on its own: a record sequence in, the exact event rows out (docs/design.md §4).

One request seals a two-block chain and leaves; a second one hits both blocks; a third allocation reuses a cached
block (vLLM evicted it to reuse it) for a request of another tenant. Every row is compared whole, in
:data:`kvfabric.contract.schema.EMIT_COLUMNS` order, with every column the event leaves unset checked to be null.
"""

from __future__ import annotations

from typing import Any

from kvfabric.contract import records as R
from kvfabric.contract import schema as S
from kvfabric.lifecycle.expander import Expander, expander_from_metadata

H1, H2 = b"\x01" * 8, b"\x02" * 8
D1, D2 = S.hash64(H1), S.hash64(H2)
T = 1_000

RECORDS: list[tuple] = [
    (R.LOOKUP, T, 1, "a", "fam", 32, 2, 0, [H1, H2], "t1", "ad"),
    (R.ALLOCATED, T + 1, 1, "a", [1, 2], None),
    (R.ADMITTED, T + 2, 1, "a"),
    (R.SEALED, T + 3, 1, "a", "fam", 0, None, [1, 2], [H1, H2], None),
    (R.FREED, T + 4, 2, "a", [2, 1], [0, 0]),
    (R.DONE, "a"),
    (R.LOOKUP, T + 5, 3, "b", "fam", 32, 2, 32, [], "t1", "ad"),
    (R.TOUCHED, T + 6, 3, "b", [1, 2], [1, 1]),
    (R.ADMITTED, T + 7, 3, "b"),
    (R.FREED, T + 8, 4, "b", [2, 1], [0, 0]),
    (R.LOOKUP, T + 9, 5, "c", None, 8, 0, 0, [], "t2", None),
    (R.ALLOCATED, T + 9, 5, "c", [2], None),
]

COMMON = {"engine": "e0", "run_id": "run", "policy": "lru", "host": "h0", "dp_rank": 1}
A = {"tenant": "t1", "lora": "ad"}  # requests a and b (b hits a's blocks: vLLM hashes salt and adapter alike)
B1 = {"block_id": 1, "block_hash": D1, "family": "fam", "depth": 0, "protected": False, **A}
B2 = {"block_id": 2, "block_hash": D2, "parent_hash": D1, "family": "fam", "depth": 1, "protected": False, **A}

EXPECTED: list[dict[str, Any]] = [
    {"ts_ns": 1001, "step": 1, "event": "block_allocated", "request_id": "a", "block_id": 1, "ref_count": 1, **A},
    {"ts_ns": 1001, "step": 1, "event": "block_allocated", "request_id": "a", "block_id": 2, "ref_count": 1, **A},
    {"ts_ns": 1002, "step": 1, "event": "prefix_lookup", "request_id": "a", "family": "fam", "depth": 2,
     "prompt_tokens": 32, "hit_tokens": 0, "count": 0, **A},
    {"ts_ns": 1003, "step": 1, "event": "block_sealed", "request_id": "a", **B1, "ref_count": 1, "hit_count": 0,
     "share_degree": 1, "branch_factor": 0},
    {"ts_ns": 1003, "step": 1, "event": "block_sealed", "request_id": "a", **B2, "ref_count": 1, "hit_count": 0,
     "share_degree": 1, "branch_factor": 0},
    {"ts_ns": 1004, "step": 2, "event": "block_freed", "request_id": "a", **B2, "ref_count": 0, "hit_count": 0,
     "share_degree": 1, "branch_factor": 0},
    {"ts_ns": 1004, "step": 2, "event": "block_freed", "request_id": "a", **B1, "ref_count": 0, "hit_count": 0,
     "share_degree": 1, "branch_factor": 1},
    {"ts_ns": 1006, "step": 3, "event": "block_touched", "request_id": "b", **B1, "ref_count": 1, "hit_count": 1,
     "share_degree": 2, "branch_factor": 1},
    {"ts_ns": 1006, "step": 3, "event": "block_touched", "request_id": "b", **B2, "ref_count": 1, "hit_count": 1,
     "share_degree": 2, "branch_factor": 0},
    {"ts_ns": 1007, "step": 3, "event": "prefix_lookup", "request_id": "b", "family": "fam", "depth": 2,
     "prompt_tokens": 32, "hit_tokens": 32, "count": 0, **A},
    {"ts_ns": 1008, "step": 4, "event": "block_freed", "request_id": "b", **B2, "ref_count": 0, "hit_count": 1,
     "share_degree": 2, "branch_factor": 0},
    {"ts_ns": 1008, "step": 4, "event": "block_freed", "request_id": "b", **B1, "ref_count": 0, "hit_count": 1,
     "share_degree": 2, "branch_factor": 1},
    # The evicted content was tenant t1's (a's), whoever's allocation evicted it; the fresh block is c's.
    {"ts_ns": 1009, "step": 5, "event": "block_evicted", "request_id": "c", **B2, "ref_count": 0, "hit_count": 1,
     "share_degree": 2, "branch_factor": 0, "age_ns": 1, "reason": "pressure"},
    {"ts_ns": 1009, "step": 5, "event": "block_allocated", "request_id": "c", "block_id": 2, "ref_count": 1,
     "tenant": "t2"},
]


def _row(fields: dict[str, Any]) -> tuple:
    values = {**COMMON, **fields}
    assert set(values) <= set(S.EMIT_COLUMNS)
    return tuple(values.get(name) for name in S.EMIT_COLUMNS)


def test_a_record_sequence_expands_into_exactly_these_rows() -> None:
    rows: list[tuple] = []
    expander = Expander(num_blocks=8, emit=rows.append, engine="e0", run_id="run", policy="lru", host="h0",
                        dp_rank=1)
    expander.apply(RECORDS)
    assert rows == [_row(e) for e in EXPECTED]
    assert expander.events == len(EXPECTED)


def test_records_applied_one_by_one_or_in_one_list_give_the_same_rows() -> None:
    whole: list[tuple] = []
    Expander(num_blocks=8, emit=whole.append, engine="e0", run_id="run").apply(RECORDS)
    split: list[tuple] = []
    expander = Expander(num_blocks=8, emit=split.append, engine="e0", run_id="run")
    for record in RECORDS:
        expander.apply([record])
    assert split == whole


def test_the_forwarder_builds_the_same_expander_from_the_stream_metadata() -> None:
    metadata = {S.META_NUM_BLOCKS: "8", S.META_ENGINE: "e0", S.META_RUN_ID: "run", S.META_POLICY: "lru",
                S.META_HOST: "h0", S.META_DP_RANK: "1",
                S.META_SETTINGS: '{"null_block": 0, "evicted_memory": 100, "regret_window_s": 60.0}'}
    rows: list[tuple] = []
    expander_from_metadata(metadata, rows.append).apply(RECORDS)
    assert rows == [_row(e) for e in EXPECTED]
