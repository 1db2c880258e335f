"""``kvfabric ab``: fresh real servers per arm, one real collector, the report and its JSON line; and the rule that
calls a difference only beyond the arms' spread."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from kvfabric.bench import report
from kvfabric.bench.report import NO_CALL, family_kind, verdict
from kvfabric.bench.stats import percentile, spread
from kvfabric.cli import main as cli_main

HEADLINE = ("prefix_hit_rate", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "e2e_p50_s", "e2e_p90_s", "tpot_p50_s",
            "requests_per_s", "goodput_per_s", "rebuilt_from_eviction_blocks", "shared_anchor_eviction_ratio",
            "wasted_prefill_tokens", "client_cached_tokens", "collector_hit_tokens")

# Two template families revisited after cold traffic that flushes an LRU cache; tiny, and fast (no modelled time).
SCENARIO = """
name = "tiny_revisit"
description = "Two templates, visited, flushed by cold prompts, revisited."
shows = "That a share-aware policy keeps the templates where LRU loses them."
expect = "difference"
seed = 7

[server]
model = "qwen2-0.5b"
kv_blocks = 400
max_model_len = 2048
latency_scale = 0.0
capacity = "400 blocks hold both templates (2 x 64) but not the cold prompts too."

[[traffic]]
name = "templates"
mode = "persona_rotation"
sessions = 12
concurrency = 2
rate = 5.0
[traffic.params]
personas = 2
persona_tokens = [1024, 1024]
burst = 3
turns = [1, 1]
question_tokens = [16, 32]
max_tokens = [2, 4]

[[traffic]]
name = "cold"
mode = "pressure"
sessions = 24
concurrency = 2
rate = 7.0
[traffic.params]
hot_share = 0.0
cold_tokens = [1536, 1900]
max_tokens = [2, 4]
"""


def test_verdict_calls_a_difference_only_beyond_the_spread() -> None:
    base = {**spread([0.50, 0.52, 0.51]), "values": [0.50, 0.52, 0.51]}
    close = {**spread([0.53, 0.52, 0.54]), "values": [0.53, 0.52, 0.54]}  # overlaps the baseline's range
    near = {**spread([0.525, 0.526, 0.527]), "values": [0.525, 0.526, 0.527]}  # apart, by less than the spread
    far = {**spread([0.60, 0.61, 0.62]), "values": [0.60, 0.61, 0.62]}
    assert verdict(base, close, +1)["call"] == "no difference"
    assert verdict(base, near, +1)["call"] == "no difference"
    v = verdict(base, far, +1)
    assert v["call"] == "better" and v["delta"] == pytest.approx(0.10) and v["relative"] == pytest.approx(0.10 / 0.51)
    assert verdict(base, far, -1)["call"] == "worse"
    one = {**spread([0.9]), "values": [0.9]}
    assert verdict(one, one, +1)["call"] in NO_CALL


def test_percentiles_and_family_kinds() -> None:
    assert percentile([4, 1, 3, 2], 0.5) == 2.5 and percentile([], 0.5) is None
    assert percentile([1, 2, 3, 4, 5], 0.99) == pytest.approx(4.96)
    assert family_kind("persona-12") == "persona" and family_kind("cold") == "cold"
    assert family_kind("9f3a2b4c5d6e7f80") == "(unnamed)" and family_kind(None) == "(none)"


def _json_line(out: str) -> dict[str, Any]:
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.vllm
def test_ab_runs_fresh_servers_and_reports(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    for k in [k for k in os.environ if k.startswith("KVFABRIC_")]:
        monkeypatch.delenv(k)
    # An arm runs with exactly its own configuration: a hold exported here does not reach a plain policy's arm.
    monkeypatch.setenv("KVFABRIC_CACHE_AWARE_SCHEDULING", "1")
    scenario = tmp_path / "tiny.toml"
    scenario.write_text(SCENARIO)
    out = tmp_path / "ab"
    rc = cli_main(["ab", "--scenario", str(scenario), "--policies", "lru,adaptive_aging", "--repeat", "1",
                   "--out", str(out), "--format", "json", "--no-progress"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    line = _json_line(captured.out)
    assert line["scenario"] == "tiny_revisit" and line["baseline"] == "lru" and line["repeat"] == 1
    for policy in ("lru", "adaptive_aging"):
        metrics = line["policies"][policy]
        assert set(metrics) == set(HEADLINE)
        assert all(set(m) == {"median", "min", "max", "spread"} for m in metrics.values())
    lru, ada = line["policies"]["lru"], line["policies"]["adaptive_aging"]
    # LRU loses the templates to the cold prompts and rebuilds them; the share-aware policy keeps them.
    assert lru["rebuilt_from_eviction_blocks"]["median"] > 0
    assert ada["rebuilt_from_eviction_blocks"]["median"] < lru["rebuilt_from_eviction_blocks"]["median"]
    assert ada["prefix_hit_rate"]["median"] > lru["prefix_hit_rate"]["median"]
    # The server told the client exactly what the collector counted (no preemption with this pool).
    for policy in ("lru", "adaptive_aging"):
        m = line["policies"][policy]
        assert m["client_cached_tokens"]["median"] == m["collector_hit_tokens"]["median"] > 0
    assert line["agreement"]["relative_difference"] == 0
    logs = sorted((out / "logs").glob("*.server.log"))
    assert len(logs) == 2 and all("recording on, policy" in log.read_text() for log in logs)
    assert not any("cache-aware scheduling on" in log.read_text() for log in logs)

    report = (out / "report.md").read_text()
    assert "# A/B report: `tiny_revisit`" in report and "no spread (1 repetition)" in report
    for png in ("hit_rate", "ttft_cdf", "evictions", "rebuilt_over_time"):
        path = out / "plots" / f"{png}.png"
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"plots/{png}.png" in report
    ab = json.loads((out / "ab.json").read_text())
    join = ab["agreement"]["join"]
    assert join["requests_matched"] == join["requests_equal"] == 2 * 36  # every request, in both arms
    kinds = ab["kinds"]
    assert kinds["persona"]["lru"]["rebuilt_blocks"] > kinds["persona"]["adaptive_aging"]["rebuilt_blocks"]
    assert kinds["cold"]["lru"]["prefix_hit_rate"] == 0

    # --report-only re-renders from the saved runs without starting anything.
    (out / "report.md").unlink()
    assert cli_main(["ab", "--report-only", "--out", str(out), "--format", "json"]) == 0
    assert _json_line(capsys.readouterr().out) == line
    assert (out / "report.md").is_file()


@pytest.mark.vllm
def test_ab_drives_any_server_command(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """``--serve-cmd``, the way a real ``vllm serve`` is driven: the arm's settings reach the server through the
    placeholders and the KVFABRIC_* environment only (sim-serve stands in, given no KVFabric options); an arm named
    ``POLICY+hold`` runs the policy with cache-aware scheduling on."""
    for k in [k for k in os.environ if k.startswith("KVFABRIC_")]:
        monkeypatch.delenv(k)
    scenario = tmp_path / "tiny.toml"
    scenario.write_text(SCENARIO)
    serve = (f"{sys.executable} -m kvfabric.cli sim-serve --model qwen2-0.5b --kv-blocks {{kv_blocks}} "
             "--max-model-len {max_model_len} --latency-scale 0 --port {port}")
    out = tmp_path / "ab"
    serve += " --served-model-name {policy}"  # the placeholder is the eviction policy alone
    rc = cli_main(["ab", "--scenario", str(scenario), "--policies", "adaptive_aging+hold", "--repeat", "1",
                   "--serve-cmd", serve, "--out", str(out), "--format", "json", "--no-progress"])
    assert rc == 0
    line = _json_line(capsys.readouterr().out)
    plan = json.loads((out / "plan.json").read_text())
    [arm] = plan["arms"]
    argv = " ".join(arm["argv"])
    assert "--kv-blocks 400" in argv and "--max-model-len 2048" in argv and "--served-model-name adaptive_aging" in argv
    ab = json.loads((out / "ab.json").read_text())
    [run] = ab["runs"]
    assert run["policy"] == "adaptive_aging+hold"
    assert line["policies"]["adaptive_aging+hold"]["collector_hit_tokens"]["median"]
    summary = json.loads((out / "runs" / f"{arm['run_id']}.collector.json").read_text())["summary"]
    assert summary["policies"] == ["adaptive_aging"]  # KVFABRIC_EVICTION_POLICY reached the hook
    assert summary["requests"] == 36
    # KVFABRIC_CACHE_AWARE_SCHEDULING=1 reached the hook, and the hold attached to vLLM's scheduler.
    log = (out / "logs" / f"{arm['run_id']}.server.log").read_text()
    assert "policy adaptive_aging, cache-aware scheduling on, sink unix://" in log
    assert re.search(r"KVFabric cache-aware scheduling held [\d,]+ request\(s\) for [\d,]+ scheduler step", log)
    # ... which the plan keeps per arm and the report shows.
    assert set(arm["hold"]) == {"requests", "steps"} and arm["hold"]["requests"] <= arm["hold"]["steps"]
    assert (f"requests held per run, from each server's log: `adaptive_aging+hold` {arm['hold']['requests']:,} "
            in (out / "report.md").read_text())


def test_the_hold_line_is_read_from_a_server_log(tmp_path: Path) -> None:
    from kvfabric.bench.servers import hold_summary

    log = tmp_path / "s.log"
    assert hold_summary(None) is None and hold_summary(log) is None  # no log at all
    log.write_text("INFO KVFabric 0.1.0 on engine h/dp0 (run x): recording on, policy lru, cache-aware scheduling on\n")
    assert hold_summary(log) is None  # the hold attached, the engine died before the scheduler's shutdown
    log.write_text(log.read_text() + "(EngineCore pid=1) INFO [hold.py:127] KVFabric cache-aware scheduling held "
                   "1,234 request(s) for 56,789 scheduler step(s)\n")
    assert hold_summary(log) == {"requests": 1234, "steps": 56789}


def test_ab_refuses_bad_options(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert cli_main(["ab", "--scenario", "nope"]) == 2
    assert "no scenario 'nope'" in capsys.readouterr().err
    assert cli_main(["ab", "--scenario", "smoke", "--policies", "lru,bogus"]) == 2
    assert "unknown policy bogus" in capsys.readouterr().err
    assert cli_main(["ab", "--scenario", "smoke", "--policies", "lru,bogus+hold"]) == 2
    assert "unknown policy bogus+hold" in capsys.readouterr().err
    assert cli_main(["ab", "--scenario", "smoke", "--serve-cmd", "vllm serve --port {prot}"]) == 2
    assert "placeholder" in capsys.readouterr().err
    assert cli_main(["ab", "--report-only", "--out", str(tmp_path)]) == 2


GPU_AB = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "gpu" / "ab" / "run"


@pytest.mark.parametrize(("scenario", "says"), [
    ("ordinary_unique_cold", "No prefix-cache hits in these runs"),
    ("template_family_revisit", "Over all runs the server told the client 332,640 cached prompt tokens"),
])
def test_the_agreement_section_tells_no_hits_from_missing_usage(scenario: str, says: str) -> None:
    """The H200 A/B's saved runs (real vLLM 0.26 servers): with no hits on either side the report says so, and
    blames no missing server flag; with hits it compares the two counts."""
    result = report.build(GPU_AB / scenario)
    text = report.render_markdown(result, {})
    assert says in text
    assert "needs `--enable-prompt-tokens-details`" not in text and "reports them with" not in text
    # The hint stays for what it is for: hits the collector saw but the server did not report.
    result["agreement"].update(client_cached_tokens=0, relative_difference=None, collector_hit_tokens=4096)
    assert "collector counted 4,096 hit tokens (vLLM reports them with `--enable-prompt-tokens-details`)" in \
        report.render_markdown(result, {})
