"""Hand-made streams of vLLM's KV events (source ``kv_events``, sent as Arrow streams with that metadata) whose
analytics are known by hand: tests/queries/test_kv_events_answers.py checks every named query on them, and
tests/lake/test_queries_on_a_lake.py that a lake answers as a DuckDB file does.

The rows are those the kv-events converter (kvfabric/kvevents/convert.py) writes: ``block_sealed`` with parent,
depth and the root's family, then ``block_rebuilt`` for a hash stored again after its removal, ``block_evicted``
without a reason, a reset's ``reset`` evictions and ``cache_reset``; written by hand, so that the expected numbers
are plain arithmetic. Run ``runK`` (engine k0, block size 16), one row per line, t in seconds:

  t1  R stored (root)           t5  R removed  [R has 2 children since t4: shared]
  t2  A stored under R          t6  R, A stored again: both rebuilt (R stored twice, A stored twice)
  t3  A removed  [not shared]   t8  A removed  [A stored twice since t6: shared]
  t4  B stored under R          t9  B removed  [not shared]
  t10 S stored (root)  t11 S removed [not shared]  t12 S stored again: rebuilt
  t13 cache cleared: R and S evicted with reason reset [both shared], then cache_reset
  => evicted 7, shared anchors 4 (ratio 4/7), rebuilt 3, wasted 3 x 16 = 48, reasons: unknown 5, reset 2;
     family R: evicted 5 (A, R, A, B, R), shared 3, rebuilt 2 (32 tokens); family S: evicted 2, shared 1, rebuilt 1;
     by depth in family R: depth 0 evicted 2 (both shared), depth 1 evicted 3 (1 shared).
Run ``runKC`` (engine k1): two prefix_cache_counters rows (queries 100 + 300, hits 40 + 110) and one eviction.
Run ``runMix``: engine p0 of the plugin (one lookup: prompt 64, hit 32) and engine k2 of kv_events (counters: 1000
queries, 900 hits): the lookups answer, the counters of another engine do not mix in.
Run ``runPM``: plugin engine e9 whose counters the collector also scraped (a kv_events stream of the same engine):
its lookups and share_degree answer, not the counters nor the kv-events anchor rule.
Plugin runs: the golden workload (support.collector_testkit), whose answers tests/collector/test_queries_golden.py
fixes.
"""

from __future__ import annotations

from typing import Any

from kvfabric.contract import schema as S
from support.collector_testkit import NS, T0, GoldenStream, meta

R, A_, B, S_ = 101, 102, 103, 201
FAM_R, FAM_S = S.family_of_hash(R), S.family_of_hash(S_)
TK = T0 + 100 * NS


def _kv_meta(stream_id: str, run_id: str, engine: str) -> dict[str, str]:
    return {**meta(stream_id, run_id, engine, host="hk", dp_rank=0), S.META_SOURCE: S.SOURCE_KV_EVENTS}


def _rows_runK() -> list[dict[str, Any]]:
    base = {"run_id": "runK", "engine": "k0", "host": "hk", "dp_rank": 0}
    rows: list[dict[str, Any]] = []

    def add(t: int, event: str, h: int | None = None, parent: int | None = None, depth: int | None = None,
            family: str | None = None, **kw: Any) -> None:
        rows.append({**base, "ts_ns": TK + t * NS, "event": event, "block_hash": h, "parent_hash": parent,
                     "depth": depth, "family": family, **kw})

    add(1, "block_sealed", R, None, 0, FAM_R)
    add(2, "block_sealed", A_, R, 1, FAM_R)
    add(3, "block_evicted", A_, R, 1, FAM_R)
    add(4, "block_sealed", B, R, 1, FAM_R)
    add(5, "block_evicted", R, None, 0, FAM_R)
    add(6, "block_sealed", R, None, 0, FAM_R)
    add(6, "block_rebuilt", R, None, 0, FAM_R, age_ns=NS)
    add(6, "block_sealed", A_, R, 1, FAM_R)
    add(6, "block_rebuilt", A_, R, 1, FAM_R, age_ns=3 * NS)
    add(8, "block_evicted", A_, R, 1, FAM_R)
    add(9, "block_evicted", B, R, 1, FAM_R)
    add(10, "block_sealed", S_, None, 0, FAM_S)
    add(11, "block_evicted", S_, None, 0, FAM_S)
    add(12, "block_sealed", S_, None, 0, FAM_S)
    add(12, "block_rebuilt", S_, None, 0, FAM_S, age_ns=NS)
    add(13, "block_evicted", S_, None, 0, FAM_S, reason="reset")
    add(13, "block_evicted", R, None, 0, FAM_R, reason="reset")
    add(13, "cache_reset")
    return rows


def _rows_runKC() -> list[dict[str, Any]]:
    base = {"run_id": "runKC", "engine": "k1", "host": "hk", "dp_rank": 0}
    return [
        {**base, "ts_ns": TK + 20 * NS, "event": S.PREFIX_CACHE_COUNTERS, "prompt_tokens": 100, "hit_tokens": 40},
        {**base, "ts_ns": TK + 21 * NS, "event": S.PREFIX_CACHE_COUNTERS, "prompt_tokens": 300, "hit_tokens": 110},
        {**base, "ts_ns": TK + 22 * NS, "event": "block_evicted", "block_hash": 7, "family": "f7"},
    ]


def _streams_runMix() -> list[GoldenStream]:
    plugin = [{"run_id": "runMix", "engine": "p0", "ts_ns": TK + 30 * NS, "event": "prefix_lookup",
               "request_id": "m1", "family": "fm", "prompt_tokens": 64, "hit_tokens": 32, "count": 0}]
    kv = [{"run_id": "runMix", "engine": "k2", "ts_ns": TK + 31 * NS, "event": S.PREFIX_CACHE_COUNTERS,
           "prompt_tokens": 1000, "hit_tokens": 900}]
    return [GoldenStream(meta("sMixP", "runMix", "p0"), plugin), GoldenStream(_kv_meta("sMixK", "runMix", "k2"), kv)]


def _streams_runPM() -> list[GoldenStream]:
    """A plugin engine whose /metrics the collector also reads (its counters come in a kv_events stream of the same
    engine): its lookups and its share_degree answer; X has two children, which the plugin says no two requests
    shared."""
    base = {"run_id": "runPM", "engine": "e9"}
    plugin = [
        {**base, "ts_ns": TK + 40 * NS, "event": "prefix_lookup", "request_id": "p1", "family": "fx",
         "prompt_tokens": 80, "hit_tokens": 16, "count": 0},
        {**base, "ts_ns": TK + 41 * NS, "event": "block_sealed", "block_hash": 901, "depth": 0, "family": "fx"},
        {**base, "ts_ns": TK + 41 * NS, "event": "block_sealed", "block_hash": 902, "parent_hash": 901, "depth": 1,
         "family": "fx"},
        {**base, "ts_ns": TK + 42 * NS, "event": "block_sealed", "block_hash": 903, "parent_hash": 901, "depth": 1,
         "family": "fx"},
        {**base, "ts_ns": TK + 43 * NS, "event": "block_evicted", "block_hash": 901, "depth": 0, "family": "fx",
         "share_degree": 1},
    ]
    counters = [{**base, "ts_ns": TK + 44 * NS, "event": S.PREFIX_CACHE_COUNTERS, "prompt_tokens": 500,
                 "hit_tokens": 400}]
    return [GoldenStream(meta("sPM", "runPM", "e9", host="hk"), plugin),
            GoldenStream(_kv_meta("sPMc", "runPM", "e9"), counters)]


def kv_streams() -> list[GoldenStream]:
    return [
        GoldenStream(_kv_meta("sK", "runK", "k0"), _rows_runK(), batch_rows=4),
        GoldenStream(_kv_meta("sKC", "runKC", "k1"), _rows_runKC()),
        *_streams_runMix(),
        *_streams_runPM(),
    ]
