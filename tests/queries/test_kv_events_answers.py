"""What the named queries answer for streams of vLLM's KV events (source ``kv_events``), through a real collector
process and its DuckDB file, next to plugin streams whose answers must not change (docs/kv-events.md). The
workload and its arithmetic: support/kv_answers_testkit.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from support.collector_testkit import collector_files, send_golden, send_scripts, wait_until
from support.kv_answers_testkit import A_, FAM_R, FAM_S, S_, kv_streams

from kvfabric.cli import main as kvfabric_main
from kvfabric.contract import schema as S
from kvfabric.queries import QueryRunner
from kvfabric.queries import availability as A


class Stored:
    def __init__(self, db_path: str, rest: dict[str, Any]) -> None:
        self.db_path = db_path
        self.rest = rest


@pytest.fixture(scope="module")
def stored() -> Iterator[Stored]:
    with collector_files() as files:
        with files.process():
            total = send_golden(files.socket_path) + send_scripts(files.socket_path, kv_streams())

            def committed() -> bool:
                runs = httpx.get(files.http_url + "/api/v1/runs", timeout=5).json()
                return sum(r["events"] for r in runs) == total

            wait_until(committed, what="every stream committed")
            rest: dict[str, Any] = {}
            with httpx.Client(base_url=files.http_url, timeout=30) as c:
                for name, path, params in (
                    ("summary", "/api/v1/runs/runK/summary", {}),
                    ("summary_counters", "/api/v1/runs/runKC/summary", {}),
                    ("families", "/api/v1/families", {"run": "runK"}),
                    ("lifetimes", "/api/v1/runs/runK/lifetimes", {}),
                    ("family", f"/api/v1/families/{FAM_R}", {"run": "runK"}),
                    ("misses", "/api/v1/runs/runK/misses", {}),
                    ("request", "/api/v1/requests/anything", {"run": "runK"}),
                    ("whatif", "/api/v1/runs/runK/whatif", {}),
                    ("fleet", "/api/v1/fleet", {}),
                    ("compare", "/api/v1/compare", {"a": "runA", "b": "runK"}),
                    ("plugin_summary", "/api/v1/runs/runA/summary", {}),
                ):
                    response = c.get(path, params=params)
                    assert response.status_code == 200, (name, response.text)
                    rest[name] = response.json()
        yield Stored(files.db_path, rest)


@pytest.fixture(scope="module")
def q(stored: Stored) -> QueryRunner:
    return QueryRunner.for_path(stored.db_path)


def test_evictions_rebuilds_and_shared_anchors_come_from_the_stored_blocks(q: QueryRunner) -> None:
    s = q.run_summary("runK")
    assert s["sources"] == ["kv_events"]
    assert (s["evicted_blocks"], s["shared_anchor_evictions"], s["rebuilt_from_eviction_blocks"],
            s["wasted_prefill_tokens"]) == (7, 4, 3, 48)
    assert s["shared_anchor_eviction_ratio"] == pytest.approx(4 / 7)
    assert s["mean_time_to_rebuild_s"] == pytest.approx((1 + 3 + 1) / 3)
    assert s["evictions_by_reason"] == {"pressure": 0, "connector": 0, "reset": 2, "unknown": 5}
    # Nothing of the plugin's policies ran: no block was protected, no admission limited (0 is the truth here).
    assert (s["protected_evictions"], s["admission_limited_blocks"]) == (0, 0)


def test_what_needs_lookups_is_null_and_named_never_zero(q: QueryRunner) -> None:
    s = q.run_summary("runK")
    assert s["unavailable"] == dict.fromkeys(A.SUMMARY_LOOKUP_FIELDS, A.NO_LOOKUPS)
    assert all(s[f] is None for f in A.SUMMARY_LOOKUP_FIELDS)
    assert s["prefix_hit_rate_from"] is None


def test_engine_counters_fill_the_hit_rate_and_say_so(q: QueryRunner) -> None:
    s = q.run_summary("runKC")
    assert (s["prompt_tokens"], s["prefix_hit_tokens"]) == (400, 150)
    assert s["prefix_hit_rate"] == pytest.approx(150 / 400)
    assert s["prefix_hit_rate_from"] == A.FROM_COUNTERS
    assert set(s["unavailable"]) == set(A.SUMMARY_LOOKUP_FIELDS) - set(A.HIT_FIELDS)
    assert s["requests"] is None and s["regretful_evictions"] is None
    # Counters are per engine: a family has none, so its hit rate stays unavailable.
    [f] = q.families("runKC")
    assert f["prefix_hit_rate"] is None and "prefix_hit_rate" in f["unavailable"]


def test_a_run_with_lookups_answers_from_them_alone(q: QueryRunner) -> None:
    s = q.run_summary("runMix")
    assert s["sources"] == ["kv_events", "plugin"]
    assert (s["requests"], s["prompt_tokens"], s["prefix_hit_tokens"]) == (1, 64, 32)
    assert s["prefix_hit_rate_from"] == A.FROM_LOOKUPS and s["unavailable"] == {}


def test_a_plugin_engine_with_scraped_counters_answers_from_its_own_events(q: QueryRunner) -> None:
    s = q.run_summary("runPM")
    assert s["sources"] == ["kv_events", "plugin"] and s["prefix_hit_rate_from"] == A.FROM_LOOKUPS
    assert (s["prompt_tokens"], s["prefix_hit_tokens"], s["requests"]) == (80, 16, 1)
    assert (s["evicted_blocks"], s["shared_anchor_evictions"]) == (1, 0)  # the plugin's share_degree, not children
    [e9] = [e for e in q.fleet(run="runPM")["engines"]]
    assert (e9["prompt_tokens"], e9["shared_anchor_evictions"], e9["prefix_hit_rate_from"]) == (80, 0, A.FROM_LOOKUPS)


def test_plugin_runs_answer_as_before(q: QueryRunner) -> None:
    a = q.run_summary("runA")  # the golden numbers (tests/collector/test_queries_golden.py)
    assert (a["prompt_tokens"], a["prefix_hit_tokens"], a["evicted_blocks"], a["regretful_evictions"]) == (
        1100, 510, 10, 4)
    assert a["shared_anchor_eviction_ratio"] == pytest.approx(0.4)
    assert (a["sources"], a["prefix_hit_rate_from"], a["unavailable"]) == (["plugin"], A.FROM_LOOKUPS, {})
    fams = {f["family"]: f for f in q.families("runA")}
    assert (fams["famX"]["shared_anchor_evictions"], fams["famX"]["requests"]) == (3, 4)


def test_families_of_the_chain_roots(q: QueryRunner) -> None:
    fams = q.families("runK")
    assert [(f["family"], f["evicted_blocks"], f["shared_anchor_evictions"], f["rebuilt_blocks"],
             f["wasted_prefill_tokens"]) for f in fams] == [(FAM_R, 5, 3, 2, 32), (FAM_S, 2, 1, 1, 16)]
    assert all(f["requests"] is None and f["prefix_hit_rate"] is None for f in fams)
    assert set(fams[0]["unavailable"]) == set(A.FAMILY_LOOKUP_FIELDS)
    detail = q.family_detail("runK", FAM_R)
    assert [(d["depth"], d["evicted_blocks"], d["shared_anchor_evictions"], d["rebuilt_blocks"])
            for d in detail["by_depth"]] == [(0, 2, 2, 1), (1, 3, 1, 1)]
    assert q.top_waste_families("runK", n=1)[0]["family"] == FAM_R


def test_block_history_and_evictions_pages_work_unchanged(q: QueryRunner) -> None:
    history = q.block_history(S.family_of_hash(A_), run="runK")
    assert [e["event"] for e in history["events"]] == [
        "block_sealed", "block_evicted", "block_sealed", "block_rebuilt", "block_evicted"]
    page = q.evictions(run="runK", family=FAM_S, limit=10)
    assert [(e["block_hash"], e["reason"]) for e in page["items"]] == [(S_, None), (S_, "reset")]


def test_block_lifetimes_from_seal_to_eviction(q: QueryRunner) -> None:
    life = q.lifetimes("runK")
    # Seal -> eviction, s: A 2->3, R 1->5, A 6->8, B 4->9, R 6->13 (reset); S 10->11, S 12->13 (reset).
    assert (life["totals"]["evicted_blocks"], life["totals"]["without_seal"]) == (7, 0)
    assert life["totals"]["mean_s"] == pytest.approx((1 + 4 + 2 + 5 + 7 + 1 + 1) / 7)
    assert life["totals"]["max_s"] == pytest.approx(7)
    [fam_r, fam_s] = life["items"]
    assert (fam_r["family"], fam_r["evicted_blocks"], fam_r["p50_s"]) == (FAM_R, 5, pytest.approx(4))
    assert fam_r["mean_s"] == pytest.approx((1 + 4 + 2 + 5 + 7) / 5)
    assert (fam_s["family"], fam_s["evicted_blocks"], fam_s["mean_s"]) == (FAM_S, 2, pytest.approx(1))
    # The plugin's golden run: only HASH_STORY was sealed in the run before its eviction.
    golden = q.lifetimes("runA")["totals"]
    assert (golden["evicted_blocks"], golden["without_seal"]) == (1, 9)


def test_misses_request_and_whatif_say_unavailable(q: QueryRunner) -> None:
    m = q.misses("runK")
    assert (m["totals"], m["items"], m["windows"], m["unavailable"]) == (None, [], [], A.NO_LOOKUPS)
    assert m["evictions_by_reason"]["reset"] == 2
    story = q.request("anything", run="runK")
    assert (story["admissions"], story["unavailable"]) == ([], A.NO_LOOKUPS)
    from kvfabric.analysis.whatif import whatif

    w = whatif(q, "runK")
    assert w["unavailable"] == A.NO_LOOKUPS
    assert w["whatif_prefix_hit_rate"] is None and w["actual_prefix_hit_rate"] is None
    assert (w["actual_evicted_blocks"], w["actual_wasted_prefill_tokens"]) == (7, 48)


def test_compare_has_no_delta_for_what_one_run_cannot_give(q: QueryRunner) -> None:
    delta = q.compare("runA", "runK")["delta"]
    assert delta["prompt_tokens"] is None and delta["regretful_evictions"] is None
    assert delta["evicted_blocks"] == 7 - 10 and delta["wasted_prefill_tokens"] == 48 - 64


def test_fleet_marks_engines_without_lookups(q: QueryRunner) -> None:
    fleet = q.fleet()
    engines = {e["engine"]: e for e in fleet["engines"]}
    k0, k1 = engines["k0"], engines["k1"]
    assert (k0["requests"], k0["prefix_hit_rate"], k0["evicted_blocks"], k0["shared_anchor_evictions"]) == (
        None, None, 7, 4)
    assert set(k0["unavailable"]) == set(A.FLEET_LOOKUP_FIELDS)
    assert (k1["prompt_tokens"], k1["hit_tokens"], k1["prefix_hit_rate_from"]) == (400, 150, A.FROM_COUNTERS)
    t = fleet["totals"]
    with_numbers = [e for e in engines.values() if e["prompt_tokens"] is not None]
    assert t["prompt_tokens"] == sum(e["prompt_tokens"] for e in with_numbers)
    assert t["requests"] == sum(e["requests"] or 0 for e in engines.values())
    assert t["evicted_blocks"] == sum(e["evicted_blocks"] for e in engines.values())
    assert t["prefix_hit_rate_from"] == [A.FROM_COUNTERS, A.FROM_LOOKUPS] and t["unavailable"] == {}
    only_k = q.fleet(run="runK")["totals"]
    assert only_k["prompt_tokens"] is None and set(only_k["unavailable"]) == set(A.FLEET_LOOKUP_FIELDS)


def test_rest_answers_null_with_the_reason(q: QueryRunner, stored: Stored) -> None:
    rest = stored.rest
    assert rest["summary"] == json.loads(json.dumps(q.run_summary("runK")))
    assert rest["summary"]["prefix_hit_rate"] is None
    assert rest["summary"]["unavailable"]["prefix_hit_rate"] == A.NO_LOOKUPS
    assert rest["summary_counters"]["prefix_hit_rate_from"] == A.FROM_COUNTERS
    assert rest["families"] == json.loads(json.dumps(q.families("runK")))
    assert rest["family"]["by_depth"][0]["shared_anchor_evictions"] == 2
    assert rest["lifetimes"] == json.loads(json.dumps(q.lifetimes("runK")))
    assert rest["misses"]["totals"] is None and rest["misses"]["unavailable"] == A.NO_LOOKUPS
    assert rest["request"]["unavailable"] == A.NO_LOOKUPS
    assert rest["whatif"]["unavailable"] == A.NO_LOOKUPS and rest["whatif"]["optimal_prefix_hit_rate"] is None
    assert rest["fleet"]["totals"]["evicted_blocks"] == q.fleet()["totals"]["evicted_blocks"]
    assert rest["compare"]["delta"]["prompt_tokens"] is None
    assert rest["plugin_summary"]["unavailable"] == {} and rest["plugin_summary"]["prompt_tokens"] == 1100


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert kvfabric_main(list(argv)) == 0
    return capsys.readouterr().out


def test_cli_prints_the_marked_line(stored: Stored, capsys: pytest.CaptureFixture[str]) -> None:
    db = stored.db_path
    summary = _cli(capsys, "query", "run_summary", "--db", db, "--run", "runK")
    assert f"prefix_hit_rate               {A.NO_LOOKUPS}" in summary
    assert "evicted_blocks                7" in summary
    counters = _cli(capsys, "query", "run_summary", "--db", db, "--run", "runKC")
    assert f"prefix_hit_rate               0.375  ({A.FROM_COUNTERS_TEXT})" in counters
    families = _cli(capsys, "query", "families", "--db", db, "--run", "runK")
    assert families.rstrip().endswith(f"n/a: {A.NO_LOOKUPS}") and " n/a " in families
    assert f"run runK: {A.NO_LOOKUPS}" in _cli(capsys, "query", "misses", "--db", db, "--run", "runK")
    assert f"run runK: {A.NO_LOOKUPS}" in _cli(capsys, "query", "admission_misses", "--db", db, "--run", "runK")
    assert A.NO_LOOKUPS in _cli(capsys, "whatif", "--db", db, "--run", "runK", "--no-progress")
    fleet = _cli(capsys, "fleet", "--db", db)
    assert f"n/a: {A.NO_LOOKUPS}" in fleet and f"*: hit rate {A.FROM_COUNTERS_TEXT}" in fleet
    as_json = json.loads(_cli(capsys, "query", "run_summary", "--db", db, "--run", "runK", "--format", "json"))
    assert as_json["prompt_tokens"] is None and as_json["unavailable"]["requests"] == A.NO_LOOKUPS


def test_a_trace_export_says_why_it_has_nothing(stored: Stored, capsys: pytest.CaptureFixture[str],
                                                tmp_path: Any) -> None:
    rc = kvfabric_main(["export", "--db", stored.db_path, "--run", "runK", "--format", "mooncake",
                        "--out", str(tmp_path / "trace.jsonl")])
    err = capsys.readouterr().err
    assert rc == 2 and "has no admission to export" in err and A.NO_LOOKUPS in err
    assert not (tmp_path / "trace.jsonl").exists()
