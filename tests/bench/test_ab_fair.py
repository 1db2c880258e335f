"""The fair A/B method of ``kvfabric ab`` (issue 30, item 3): interleaved arms, warm-up excluded from every number,
goodput against a TTFT SLO, per-component verdicts, and the ``--capacities`` sweep's KV saved at equal hit rate."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from kvfabric.bench.ab import _arm_order, warmup_prompts, warmup_tokens
from kvfabric.bench.kv_saved import kv_saved, lru_capacity_for, monotone_curve
from kvfabric.bench.report import client_metrics
from kvfabric.bench.scenario import load_scenario
from kvfabric.cli import main as cli_main

# --------------------------------------------------------------------------------------------------- arm order


def test_arms_are_interleaved_abab_in_every_repetition() -> None:
    assert _arm_order(["lru", "adaptive_aging"], 3) == [
        (0, None, "lru"), (0, None, "adaptive_aging"),
        (1, None, "lru"), (1, None, "adaptive_aging"),
        (2, None, "lru"), (2, None, "adaptive_aging"),
    ]
    # A sweep: every capacity x policy once per repetition, capacity by capacity, the same order each time.
    order = _arm_order(["lru", "x"], 2, [100, 200])
    assert order[:4] == [(0, 100, "lru"), (0, 100, "x"), (0, 200, "lru"), (0, 200, "x")]
    assert [(c, p) for _, c, p in order[4:]] == [(c, p) for _, c, p in order[:4]]


def test_warmup_prompts_are_fixed_and_of_their_own() -> None:
    a, b = warmup_prompts(3, 64), warmup_prompts(3, 64)
    assert a == b and len({tuple(p) for p in a}) == 3 and all(len(p) == 64 for p in a)
    smoke = load_scenario("smoke")  # block size 16, max_model_len 4096
    assert warmup_tokens(None, smoke) == 11  # + 4 output tokens = 15 < 16: never a full (cacheable) block
    assert warmup_tokens(100, smoke) == 100 and warmup_tokens(10**6, smoke) == 4096 - 8


# ---------------------------------------------------------------------------------------------------- goodput


def _req(component: str, ttft: float | None, ok: bool = True) -> dict[str, Any]:
    return {"component": component, "ok": ok, "ttft_s": ttft, "e2e_s": None if ttft is None else ttft + 0.5,
            "tpot_s": 0.01, "prompt_tokens": 100, "cached_tokens": 50}


def test_goodput_counts_successful_requests_within_the_slo() -> None:
    reqs = [_req("a", 0.1), _req("a", 0.2), _req("a", 0.3), _req("a", None, ok=False), _req("b", 0.05)]
    m = client_metrics(reqs, 2.0, 0.2)
    assert m["requests_ok"] == 4 and m["requests_per_s"] == 2.0
    assert m["goodput_per_s"] == pytest.approx(3 / 2.0)  # 0.1, 0.2 (at the SLO counts), 0.05; not 0.3, not the failure
    assert client_metrics(reqs, 2.0, None)["goodput_per_s"] is None  # no SLO: no goodput
    assert client_metrics(reqs, 2.0, 0.01)["goodput_per_s"] == 0.0
    assert m["ttft_p50_s"] == pytest.approx(0.15) and m["e2e_p90_s"] == pytest.approx(0.5 + 0.27)
    assert m["client_hit_rate"] == 0.5
    # Per component: the component's requests over the run's wall time.
    only_a = client_metrics([r for r in reqs if r["component"] == "a"], 2.0, 0.2)
    assert only_a["goodput_per_s"] == 1.0 and only_a["requests_per_s"] == 1.5


# --------------------------------------------------------------------------------------------------- KV saved


def test_kv_saved_exact_by_linear_interpolation() -> None:
    lru = {100: 0.10, 200: 0.20, 400: 0.30}
    # Policy at 100 blocks hits 0.25: LRU reaches 0.25 halfway between 200 and 400, at 300 blocks.
    k = kv_saved(lru, "x", 100, 0.25)
    assert k.bound == "exact" and k.lru_capacity == pytest.approx(300) and k.saved == pytest.approx(1 - 100 / 300)
    # On a swept point exactly; and LRU against itself saves nothing.
    assert kv_saved(lru, "x", 100, 0.20).lru_capacity == pytest.approx(200)
    assert kv_saved(lru, "lru", 200, 0.20).saved == pytest.approx(0.0)
    assert kv_saved(lru, "lru", 100, 0.10).saved == pytest.approx(0.0)


def test_kv_saved_outside_the_sweep_is_a_bound() -> None:
    lru = {100: 0.10, 200: 0.20, 400: 0.30}
    above = kv_saved(lru, "x", 200, 0.35)  # above LRU's best: LRU needs more than 400
    assert above.bound == "at_least" and above.lru_capacity == 400 and above.saved == pytest.approx(0.5)
    below = kv_saved(lru, "x", 200, 0.05)  # below LRU's worst: LRU needs less than 100
    assert below.bound == "at_most" and below.lru_capacity == 100 and below.saved == pytest.approx(-1.0)
    assert kv_saved(lru, "x", 200, None).saved is None
    assert kv_saved({100: None}, "x", 100, 0.2).saved is None


def test_kv_saved_makes_a_non_monotone_lru_curve_monotone() -> None:
    # A noisy dip at 200 (0.15 < 0.20 at 100) is raised to the running maximum: the curve is 0.2, 0.2, 0.4.
    lru = {100: 0.20, 200: 0.15, 400: 0.40}
    assert monotone_curve(lru) == [(100, 0.20), (200, 0.20), (400, 0.40)]
    # 0.2 is first reached at 100 (not somewhere after the dip); 0.3 halfway along the flat-then-rising segment.
    assert lru_capacity_for(monotone_curve(lru), 0.20) == (100.0, "exact")
    assert kv_saved(lru, "x", 100, 0.30).lru_capacity == pytest.approx(300)
    assert kv_saved(lru, "x", 100, 0.175).bound == "at_most"


# --------------------------------------------------------------------------------------------------- options


@pytest.mark.parametrize(("argv", "says"), [
    (["--capacities", "300,600", "--policies", "adaptive_aging"], "add lru to --policies"),
    (["--capacities", "600"], "at least two distinct capacities"),
    (["--capacities", "300,x"], "'x' is not a whole number"),
    (["--capacities", "300,600", "--kv-blocks", "400"], "drop --kv-blocks"),
    (["--capacities", "100,600"], "--capacities 100: (100 - 1) x block size 16 < smoke's max_model_len 4096"),
    (["--ttft-slo-ms", "0"], "--ttft-slo-ms"),
])
def test_bad_sweep_and_slo_options_are_one_line_usage_errors(argv: list[str], says: str,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["ab", "--scenario", "smoke", *argv]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1


def test_bad_resume_options_are_one_line_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cases = [
        (["--resume"], "--resume needs --out DIR"),
        (["--resume", "--out", str(tmp_path / "empty")], "--resume: no plan.json in"),
        (["--resume", "--out", str(tmp_path), "--scenario", "smoke"], "drop --scenario"),
        (["--resume", "--report-only", "--out", str(tmp_path)], "exclude each other"),
        (["--scenario", "smoke", "--time-limit", "0"], "--time-limit"),
    ]
    (tmp_path / "empty").mkdir()
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "plan.json").write_text(json.dumps({"scenario": {"name": "smoke"}, "arms": []}))
    cases.append((["--resume", "--out", str(tmp_path / "old")], "records no options (an A/B from before --resume)"))
    for argv, says in cases:
        assert cli_main(["ab", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert says in err and len(err.strip().splitlines()) == 1, (argv, err)


def test_help_states_the_fair_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["ab", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for says in ("(default: 5)", "--warmup N", "(default: 8)", "--prestart N", "(default: 0, isolated arms)",
                 "(default: block size - 5,",
                 "--capacities A,B,C", "--ttft-slo-ms MS"):
        assert says in text, says


# ------------------------------------------------------------------------------------------------- end to end

SCENARIO = """
name = "tiny_sweep"
description = "Two templates, visited, flushed by cold prompts, revisited."
seed = 7
ttft_slo_ms = 5000.0

[server]
model = "qwen2-0.5b"
kv_blocks = 400
max_model_len = 2048
latency_scale = 0.0

[[traffic]]
name = "templates"
mode = "persona_rotation"
sessions = 8
concurrency = 2
rate = 5.0
[traffic.params]
personas = 2
persona_tokens = [1024, 1024]
burst = 2
turns = [1, 1]
question_tokens = [16, 32]
max_tokens = [2, 4]

[[traffic]]
name = "cold"
mode = "pressure"
sessions = 10
concurrency = 2
rate = 7.0
[traffic.params]
hot_share = 0.0
cold_tokens = [1536, 1900]
max_tokens = [2, 4]
"""


@pytest.mark.vllm
def test_capacity_sweep_against_sim_serve_with_warmup_excluded(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """2 capacities x 2 policies x 1 repetition of real sim-serve servers and one collector: the sweep table, KV
    saved, the plots; and the warm-up in neither the client's results nor the run's collector analytics."""
    import duckdb

    for k in [k for k in os.environ if k.startswith("KVFABRIC_")]:
        monkeypatch.delenv(k)
    scenario = tmp_path / "tiny.toml"
    scenario.write_text(SCENARIO)
    out = tmp_path / "ab"
    rc = cli_main(["ab", "--scenario", str(scenario), "--policies", "lru,adaptive_aging", "--capacities", "200,400",
                   "--repeat", "1", "--warmup", "3", "--out", str(out), "--format", "json",
                   "--no-progress"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    line = json.loads(captured.out.strip().splitlines()[-1])
    assert line["ttft_slo_ms"] == 5000.0 and line["capacity"] == 400
    assert line["sweep"]["capacities"] == [200, 400]
    saved = {(k["capacity"], k["policy"]): k for k in line["sweep"]["kv_saved"]}
    assert set(saved) == {(200, "lru"), (400, "lru"), (200, "adaptive_aging"), (400, "adaptive_aging")}
    assert saved[(200, "lru")]["saved"] == pytest.approx(0.0) and saved[(200, "lru")]["bound"] == "exact"
    for (c, p), k in saved.items():
        h = line["sweep"]["policies"][str(c)][p]["prefix_hit_rate"]["median"]
        assert k["hit_rate"] == h and k["saved"] is not None
    assert set(line["components"]) == {"templates", "cold"}
    for policy in ("lru", "adaptive_aging"):
        gp = line["policies"][policy]["goodput_per_s"]["median"]
        assert gp is not None and gp <= line["policies"][policy]["requests_per_s"]["median"]

    plan = json.loads((out / "plan.json").read_text())
    assert [(a["kv_blocks"], a["policy"]) for a in plan["arms"]] == [
        (200, "lru"), (200, "adaptive_aging"), (400, "lru"), (400, "adaptive_aging")]
    assert plan["isolated"] and all(a["servers_starting_during_run"] == 0 for a in plan["arms"])
    con = duckdb.connect(str(out / "collector.duckdb"), read_only=True)
    try:
        for arm in plan["arms"]:
            warm = arm["warmup"]
            assert warm["requests_ok"] == 3 and warm["excluded_from_collector"] and warm["collector_rows_moved"] > 0
            bench = json.loads((out / "runs" / f"{arm['run_id']}.bench.json").read_text())
            assert not any("warmup" in r["request_id"] for r in bench["requests"])
            n_client = bench["summary"]["requests"]
            coll = json.loads((out / "runs" / f"{arm['run_id']}.collector.json").read_text())
            # The run's analytics count the measured requests only; the warm-up's lookups sit under <run>~warmup.
            assert coll["summary"]["requests"] == n_client and "warmup_included" not in coll
            lookups = dict(con.execute(
                "SELECT run_id, count(*) FROM events WHERE run_id IN (?, ?) AND event = 'prefix_lookup' "
                "GROUP BY run_id", [arm["run_id"], arm["run_id"] + "~warmup"]).fetchall())
            assert lookups == {arm["run_id"]: n_client, arm["run_id"] + "~warmup": 3}
            # The default warm-up (block size - 5 tokens + 4 output tokens) fills no block: nothing of it is cached.
            assert not con.execute("SELECT count(*) FROM events WHERE run_id = ? AND event = 'block_sealed'",
                                   [arm["run_id"] + "~warmup"]).fetchone()[0]
            assert not con.execute(
                "SELECT count(*) FROM events WHERE run_id = ? AND request_id LIKE '%warmup%'",
                [arm["run_id"]]).fetchone()[0]
    finally:
        con.close()

    report = (out / "report.md").read_text()
    assert "## KV pool sweep: KV saved at equal hit rate" in report and "| 200 | `adaptive_aging` |" in report
    assert "Arms isolated" in report and "Warm-up: 3 request(s) of 11 tokens" in report
    assert "nothing of it is in the pool" in report and "at most 5000 ms" in report
    assert "**`templates`**" in report and "**`cold`**" in report
    for png in ("hit_rate_vs_capacity", "ttft_vs_capacity", "ttft_cdf_by_component", "ttft_cdf", "hit_rate"):
        path = out / "plots" / f"{png}.png"
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"plots/{png}.png" in report

    # --report-only with another SLO recomputes goodput; finalising twice moves nothing more.
    assert cli_main(["ab", "--report-only", "--out", str(out), "--ttft-slo-ms", "0.001", "--format", "json"]) == 0
    again = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert again["ttft_slo_ms"] == 0.001 and again["policies"]["lru"]["goodput_per_s"]["median"] == 0.0
    assert again["sweep"]["kv_saved"] == line["sweep"]["kv_saved"]


@pytest.mark.vllm
def test_time_limit_stops_cleanly_and_resume_runs_the_rest_in_order(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """An A/B of 2 policies x 2 repetitions in three sittings: --time-limit 1 stops after the first arm (every sitting
    runs at least one), --resume runs one more under the same limit, then the rest; the arms keep the planned ABAB
    order and run ids, each sitting has its own collector file with its warm-ups split off, and the report says so.
    A resume of a finished A/B runs nothing; a scenario changed in between is refused."""
    for k in [k for k in os.environ if k.startswith("KVFABRIC_")]:
        monkeypatch.delenv(k)
    scenario = tmp_path / "tiny.toml"
    scenario.write_text(SCENARIO)
    out = tmp_path / "ab"
    assert cli_main(["ab", "--scenario", str(scenario), "--policies", "lru,adaptive_aging", "--repeat", "2",
                     "--warmup", "2", "--time-limit", "1", "--out", str(out), "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "stopped by --time-limit with 3 arm(s) not run" in text and f"--resume --out {out}" in text
    report = (out / "report.md").read_text()
    assert "**Incomplete:** 1 of 4 arms ran (runs per policy: `lru` 1, `adaptive_aging` 0)" in report

    assert cli_main(["ab", "--resume", "--out", str(out), "--time-limit", "1", "--no-progress"]) == 0
    assert "(resumed: 1 arm(s) ran before)" in capsys.readouterr().out
    assert cli_main(["ab", "--resume", "--out", str(out), "--no-progress", "--format", "json"]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(line["policies"]) == {"lru", "adaptive_aging"}

    plan = json.loads((out / "plan.json").read_text())
    stamp = plan["stamp"]
    assert [a["run_id"] for a in plan["arms"]] == [f"tiny_sweep-{p}-r{r}-{stamp}" for r in (1, 2)
                                                   for p in ("lru", "adaptive_aging")]
    assert [len(s["arms"]) for s in plan["sittings"]] == [1, 1, 2]
    assert [s["stopped_early"] for s in plan["sittings"]] == [True, True, False]
    assert [a["collector_db"] for a in plan["arms"]] == ["collector.duckdb", "collector-2.duckdb",
                                                         "collector-3.duckdb", "collector-3.duckdb"]
    assert plan["wall_s"] == pytest.approx(sum(s["wall_s"] for s in plan["sittings"]))
    for arm in plan["arms"]:
        assert (out / arm["collector_db"]).is_file()
        assert arm["warmup"]["excluded_from_collector"] and arm["warmup"]["collector_rows_moved"] > 0
        bench = json.loads((out / "runs" / f"{arm['run_id']}.bench.json").read_text())
        coll = json.loads((out / "runs" / f"{arm['run_id']}.collector.json").read_text())
        assert coll["summary"]["requests"] == bench["summary"]["requests"] > 0
    report = (out / "report.md").read_text()
    assert "Ran in 3 sittings (`kvfabric ab --resume`)" in report and "**Incomplete:**" not in report

    # Finished: nothing runs again, the arms stay as they are.
    assert cli_main(["ab", "--resume", "--out", str(out), "--no-progress"]) == 0
    assert "every planned arm has run already (4)" in capsys.readouterr().out
    assert json.loads((out / "plan.json").read_text())["arms"] == plan["arms"]

    # The scenario file changed since the A/B started: its arms would not compare; refused in one line.
    scenario.write_text(SCENARIO.replace("seed = 7", "seed = 8"))
    assert cli_main(["ab", "--resume", "--out", str(out)]) == 2
    assert "scenario tiny_sweep has changed since the A/B started" in capsys.readouterr().err
