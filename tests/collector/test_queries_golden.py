"""Named queries over a database written by a real collector from the golden workload (collector_testkit).

Expected numbers are the arithmetic of the workload's docstring, so a wrong definition in SQL shows up here.
"""

from __future__ import annotations

from collections import Counter

import pytest
from support.collector_testkit import HASH_STORY, NS, T0

from kvfabric.collector import run_named_query
from kvfabric.queries import BadParameter, NotFound, QueryRunner, UnknownRun


@pytest.fixture(scope="module")
def q(golden_db: str) -> QueryRunner:  # (golden_db: tests/conftest.py)
    return QueryRunner.for_path(golden_db)


def test_runs(q: QueryRunner) -> None:
    runs = q.runs()
    assert [(r["run_id"], r["engines"], r["policies"], r["events"], r["streams"]) for r in runs] == [
        ("runA", ["e0", "e1"], ["lru"], 30, 2),
        ("runB", ["e0"], ["family_protect"], 6, 1),
    ]
    assert runs[0]["first_ts_ns"] == T0 + 1000


def test_run_summary_follows_the_definitions(q: QueryRunner) -> None:
    a = q.run_summary("runA")
    assert list(a)[:10] == [
        "run_id", "prompt_tokens", "prefix_hit_tokens", "prefix_hit_rate", "evicted_blocks",
        "shared_anchor_eviction_ratio", "protected_eviction_ratio", "rebuilt_from_eviction_blocks",
        "regretful_evictions", "wasted_prefill_tokens",
    ]
    assert a["prompt_tokens"] == 1100 and a["prefix_hit_tokens"] == 510
    assert a["prefix_hit_rate"] == pytest.approx(510 / 1100)
    assert a["evicted_blocks"] == 10
    assert a["shared_anchor_eviction_ratio"] == pytest.approx(0.4)
    assert a["protected_eviction_ratio"] == pytest.approx(0.3)
    assert a["rebuilt_from_eviction_blocks"] == 4
    assert a["regretful_evictions"] == 4
    assert a["wasted_prefill_tokens"] == 64
    assert a["requests"] == 6 and a["events"] == 30 and a["block_size"] == 16
    assert a["sink_dropped_events"] == 5 and a["admission_limited_blocks"] == 7
    assert a["mean_time_to_rebuild_s"] == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert a["events_by_type"]["block_evicted"] == 10 and sum(a["events_by_type"].values()) == 30

    b = q.run_summary("runB")
    assert (b["prompt_tokens"], b["prefix_hit_tokens"], b["evicted_blocks"], b["rebuilt_from_eviction_blocks"]) == (
        200, 170, 2, 1,
    )
    assert b["prefix_hit_rate"] == pytest.approx(0.85)
    assert b["shared_anchor_eviction_ratio"] == 0.0 and b["protected_eviction_ratio"] == 1.0
    assert b["wasted_prefill_tokens"] == 32  # runB's block size is 32


def test_families_rank_by_wasted_prefill(q: QueryRunner) -> None:
    fams = q.families("runA")
    assert [(f["family"], f["wasted_prefill_tokens"]) for f in fams] == [("famX", 48), ("famY", 16)]
    x = fams[0]
    assert (x["requests"], x["prompt_tokens"], x["prefix_hit_tokens"], x["evicted_blocks"]) == (4, 1000, 500, 6)
    assert (x["shared_anchor_evictions"], x["protected_evictions"], x["rebuilt_blocks"]) == (3, 2, 3)
    assert x["shared_anchor_eviction_ratio"] == pytest.approx(0.5)
    assert x["mean_time_to_rebuild_s"] == pytest.approx(2.0)
    assert x["regretful_evictions"] == 3
    everywhere = q.families()
    assert [(f["run_id"], f["family"]) for f in everywhere] == [("runA", "famX"), ("runB", "famX"), ("runA", "famY")]
    assert q.top_waste_families("runA", n=1) == fams[:1]


def test_family_detail_breaks_down_by_depth(q: QueryRunner) -> None:
    d = q.family_detail("runA", "famY")
    assert d["evicted_blocks"] == 4 and d["rebuilt_blocks"] == 1
    assert [(r["depth"], r["evicted_blocks"], r["shared_anchor_evictions"], r["rebuilt_blocks"])
            for r in d["by_depth"]] == [(0, 1, 0, 1), (1, 1, 0, 0), (2, 1, 1, 0), (3, 1, 0, 0)]
    with pytest.raises(NotFound):
        q.family_detail("runA", "famZ")


def test_eviction_pages_walk_every_eviction_once_in_time_order(q: QueryRunner) -> None:
    seen = []
    cursor = None
    pages = 0
    while True:
        page = q.evictions(limit=2, cursor=cursor)
        seen += page["items"]
        pages += 1
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert pages == 6 and len(seen) == 12
    keys = [(e["engine"], e["run_id"], e["block_hash"]) for e in seen]
    assert len(set(keys)) == 12
    assert [e["ts_ns"] for e in seen] == sorted(e["ts_ns"] for e in seen)
    # Three evictions share one timestamp and straddle a page boundary (limit 2): the tie-break keeps them apart.
    assert max(Counter(e["ts_ns"] for e in seen).values()) == 3
    # Filters: engine + time range (since inclusive, until exclusive).
    e1 = q.evictions(run="runA", engine="e1", limit=100)["items"]
    assert len(e1) == 4 and {e["family"] for e in e1} == {"famY"}
    first = e1[0]["ts_ns"]
    assert len(q.evictions(run="runA", engine="e1", since_ns=first, until_ns=first + 1, limit=100)["items"]) == 1
    assert len(q.evictions(family="famX", limit=100)["items"]) == 8
    with pytest.raises(BadParameter):
        q.evictions(since_ns=2, until_ns=1)


def test_block_history_tells_one_block_story(q: QueryRunner) -> None:
    h = q.block_history(f"{HASH_STORY:016x}")
    assert h["block_hash"] == HASH_STORY
    assert [e["event"] for e in h["events"]] == [
        "block_sealed", "block_touched", "block_freed", "block_evicted", "block_rebuilt", "block_sealed",
    ]
    assert q.block_history(str(HASH_STORY), run="runA")["events"] == h["events"]
    with pytest.raises(NotFound):
        q.block_history("7")


def test_compare_reports_b_minus_a(q: QueryRunner) -> None:
    c = q.compare("runA", "runB")
    assert c["a"]["run_id"] == "runA" and c["b"]["run_id"] == "runB"
    assert c["delta"]["wasted_prefill_tokens"] == 32 - 64
    assert c["delta"]["prefix_hit_rate"] == pytest.approx(0.85 - 510 / 1100)
    assert c["delta"]["evicted_blocks"] == -8


def test_rebuilt_exact_recomputes_from_raw_events(q: QueryRunner) -> None:
    # Seal-after-evict pairs on one engine: HASH_STORY in runA/e0, hash 3000 in runB. The other block_rebuilt
    # rows of the workload have no later seal, so the exact count is lower than the hook's.
    rows = q.rebuilt_exact("runA")
    assert [(r["family"], r["rebuilt_blocks"]) for r in rows] == [("famX", 1)]
    story = q.block_history(str(HASH_STORY))["events"]
    evicted = next(e["ts_ns"] for e in story if e["event"] == "block_evicted")
    assert rows[0]["mean_time_to_rebuild_s"] == pytest.approx((story[-1]["ts_ns"] - evicted) / NS)
    assert [(r["family"], r["rebuilt_blocks"]) for r in q.rebuilt_exact("runB")] == [("famX", 1)]


def test_unknown_runs_and_the_cli_entry_point(golden_db: str, q: QueryRunner) -> None:
    db = golden_db
    for call in (lambda: q.run_summary("nope"), lambda: q.families("nope"), lambda: q.compare("runA", "nope")):
        with pytest.raises(UnknownRun, match="unknown run 'nope'"):
            call()
    assert run_named_query(db, "run_summary", run="runB")["wasted_prefill_tokens"] == 32
    assert [s["run_id"] for s in run_named_query(db, "run_summary")] == ["runA", "runB"]
    assert len(run_named_query(db, "families", run="runA", limit=None)) == 2  # None = not given
    with pytest.raises(KeyError):
        run_named_query(db, "drop_table")
    with pytest.raises(BadParameter):
        run_named_query(db, "families", colour="red")


# ------------------------------------------------------------------------------ dimension filters (schema 3)


def test_run_summary_filters_by_host_tenant_and_lora(q: QueryRunner) -> None:
    h1 = q.run_summary("runA", host="h1")  # e1 alone: famY
    assert (h1["prompt_tokens"], h1["prefix_hit_tokens"], h1["requests"]) == (100, 10, 2)
    assert (h1["evicted_blocks"], h1["rebuilt_from_eviction_blocks"], h1["wasted_prefill_tokens"]) == (4, 1, 16)
    assert h1["engines"] == ["e1"] and h1["block_size"] == 16 and h1["sink_dropped_events"] == 0
    h0 = q.run_summary("runA", host="h0")
    assert (h0["prompt_tokens"], h0["evicted_blocks"], h0["wasted_prefill_tokens"]) == (1000, 6, 48)
    assert h0["evictions_by_reason"]["unknown"] == 6
    t1 = q.run_summary("runA", tenant="t1")  # lookups a0, a1 (e0) and b0 (e1)
    assert (t1["requests"], t1["prompt_tokens"], t1["prefix_hit_tokens"]) == (3, 364, 100)
    assert t1["evicted_blocks"] == 0  # no eviction row of the workload carries a tenant
    # the miss split covers exactly the filtered admissions
    assert (t1["prefix_hit_tokens"] - t1["hit_tokens_past_prompt"] + t1["evicted_tokens"] + t1["novel_tokens"]
            + t1["uncacheable_tokens"]) == 364
    lora = q.run_summary("runA", lora="loraY")
    assert (lora["prompt_tokens"], lora["evicted_blocks"], lora["rebuilt_from_eviction_blocks"]) == (100, 4, 1)
    none = q.run_summary("runA", host="nowhere")
    assert (none["events"], none["prompt_tokens"], none["engines"]) == (0, 0, [])
    assert q.run_summary("runA", host=None) == q.run_summary("runA")


def test_families_filter_by_host_tenant_and_lora(q: QueryRunner) -> None:
    assert [(f["family"], f["wasted_prefill_tokens"]) for f in q.families("runA", lora="loraY")] == [("famY", 16)]
    assert [(f["run_id"], f["family"]) for f in q.families(host="h0")] == [("runA", "famX"), ("runB", "famX")]
    t2 = q.families("runA", tenant="t2")
    assert [(f["family"], f["requests"], f["prompt_tokens"], f["prefix_hit_tokens"]) for f in t2] == [
        ("famX", 2, 700, 400)]
    assert q.families(host="nowhere") == []


def test_evictions_filter_by_host_tenant_and_lora(q: QueryRunner) -> None:
    h0 = q.evictions(host="h0", limit=100)["items"]
    assert len(h0) == 8 and {(e["engine"], e["host"], e["dp_rank"]) for e in h0} == {("e0", "h0", 0)}
    loras = q.evictions(lora="loraY", limit=100)["items"]
    assert len(loras) == 4 and {(e["engine"], e["lora"], e["family"]) for e in loras} == {("e1", "loraY", "famY")}
    assert q.evictions(run="runA", host="h1", engine="e0", limit=100)["items"] == []
    assert q.evictions(tenant="t1", limit=100)["items"] == []
    # pages under a filter walk the filtered rows only
    page = q.evictions(host="h0", limit=5)
    rest = q.evictions(host="h0", limit=5, cursor=page["next_cursor"])
    assert len(page["items"]) + len(rest["items"]) == 8 and rest["next_cursor"] is None


def test_the_cli_entry_point_passes_the_filters(golden_db: str) -> None:
    assert run_named_query(golden_db, "run_summary", run="runA", host="h1")["prompt_tokens"] == 100
    assert [s["prompt_tokens"] for s in run_named_query(golden_db, "run_summary", lora="loraY")] == [100, 0]
    assert len(run_named_query(golden_db, "evictions", host="h0", limit=100)["items"]) == 8
