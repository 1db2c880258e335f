"""Miss attribution, what-if and the Mooncake export on a real run: ``kvfabric demo`` (vLLM's real scheduler on CPU,
the plugin loaded through vLLM's entry points, a real collector process), then the collector serving its database.

The checks are the issue's "done when" on the demo's run: every admission's split adds up to its prompt, families
add up to the run, the split agrees with what the hook saw online (its rebuilt flags), the what-if of the run's own
policy and capacity is within the stated tolerance of what happened, the optimum is never below a policy, the
exported trace replays with ``kvfabric replay``, and REST answers equal the CLI's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from support.collector_testkit import CollectorFiles, collector_files

from kvfabric.analysis.whatif import TOLERANCE, whatif
from kvfabric.cli import main as kvfabric_main
from kvfabric.policies import POLICY_NAMES
from kvfabric.queries import QueryRunner
from kvfabric.sim.offline import load_trace, simulate

pytestmark = pytest.mark.vllm

RUN = "demo-misses"


@dataclass
class DemoRun:
    db_path: str
    report: dict
    rest: dict[str, object]


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DemoRun]:
    work = tmp_path_factory.mktemp("demo")
    db = str(work / "demo.duckdb")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFABRIC_")}
    proc = subprocess.run(
        [sys.executable, "-m", "kvfabric.cli", "demo", "--db", db, "--run-id", RUN, "--port", "0", "--json",
         "--parquet", str(work / "parquet")],
        cwd=work, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))
    rest: dict[str, object] = {}
    with collector_files() as files:
        served = CollectorFiles(root=files.root, db_path=db, socket_path=files.socket_path,
                                log_path=files.log_path)
        with served.process(), httpx.Client(base_url=served.http_url, timeout=60) as c:
            rest["misses"] = c.get(f"/api/v1/runs/{RUN}/misses", params={"bucket_s": 5}).json()
            rest["story"] = c.get("/api/v1/requests/conv-4/t3", params={"run": RUN}).json()
            rest["whatif"] = c.get(f"/api/v1/runs/{RUN}/whatif",
                                   params={"policy": "adaptive_aging", "num_blocks": 400}).json()
    yield DemoRun(db, report, rest)


@pytest.fixture(scope="module")
def q(demo: DemoRun) -> QueryRunner:
    return QueryRunner.for_path(demo.db_path)


def test_every_admission_adds_up_and_families_sum_to_the_run(demo: DemoRun, q: QueryRunner) -> None:
    admissions = q.admission_misses(RUN)
    summary = q.run_summary(RUN)
    assert len(admissions) == summary["requests"] == 394
    for a in admissions:
        assert a["hit_tokens"] + a["evicted_tokens"] + a["novel_tokens"] + a["uncacheable_tokens"] == (
            a["prompt_tokens"]), a
        assert min(a["hit_tokens"], a["evicted_tokens"], a["novel_tokens"], a["uncacheable_tokens"]) >= 0
    m = demo.rest["misses"]
    assert isinstance(m, dict)
    totals = m["totals"]
    for key in ("admissions", "prompt_tokens", "hit_tokens", "evicted_tokens", "novel_tokens", "uncacheable_tokens"):
        assert sum(i[key] for i in m["items"]) == totals[key] == sum(w[key] for w in m["windows"]), key
        if key != "admissions":
            assert sum(a[key] for a in admissions) == totals[key], key
    assert totals["prompt_tokens"] == summary["prompt_tokens"]
    assert totals["hit_tokens"] == summary["prefix_hit_tokens"] - summary["hit_tokens_past_prompt"]
    assert totals["evicted_tokens"] > 0 and totals["novel_tokens"] > 0 and totals["uncacheable_tokens"] > 0
    assert m["evictions_by_reason"] == {"pressure": summary["evicted_blocks"], "connector": 0, "reset": 0,
                                        "unknown": 0}
    # One-off requests share nothing: every miss of theirs is novel or uncacheable, never an eviction.
    uniq = next(i for i in m["items"] if i["family"] == "uniq")
    assert uniq["hit_tokens"] == uniq["evicted_tokens"] == 0


def test_the_split_agrees_with_what_the_hook_saw(demo: DemoRun, q: QueryRunner) -> None:
    """The hook detects rebuilt blocks online, from its own memory of evicted digests; the collector classifies
    from stored history. On a block this admission computed, 'evicted' must be exactly 'the hook saw it rebuilt'
    (vLLM's LRU frees a request's tail before its trunk, so a missed block is never still cached behind an evicted
    ancestor here), and the story must give the run-wide split of its admission."""
    by_request = {a["request_id"]: a for a in q.admission_misses(RUN)}
    sample = [r for r in by_request if r.startswith("conv-")][:20] + [r for r in by_request if r.startswith("tpl-")][
        ::40]
    evicted_blocks = 0
    for rid in sample:
        story = q.request(rid, run=RUN)
        (adm,) = story["admissions"]
        want = by_request[rid]
        assert adm["split"] == {k: want[k] for k in adm["split"]}, rid
        for b in adm["blocks"]:
            if b["kind"] in ("evicted", "novel"):
                assert b["rebuilt"] == (b["kind"] == "evicted"), (rid, b)
            if b["kind"] == "evicted":
                evicted_blocks += 1
                assert b["cause"] == "evicted" and b["evicted_reason"] == "pressure" and b["evicted_by_request"]
                assert b["first_cached_ns"] <= b["last_evicted_ns"] < adm["lookup_ns"]
    assert evicted_blocks > 0
    summary = q.run_summary(RUN)
    assert summary["evicted_tokens"] == summary["wasted_prefill_tokens"]  # no preemption in the demo
    assert demo.report["stats"]["engine"]["preemptions"] == 0


def test_whatif_of_the_run_as_it_ran_is_within_tolerance_and_the_optimum_bounds_every_policy(
        demo: DemoRun, q: QueryRunner, capsys: pytest.CaptureFixture[str]) -> None:
    own = whatif(q, RUN)
    assert (own["policy"], own["num_blocks"]) == ("lru", 640)
    assert abs(own["replay_own_prefix_hit_rate"] - own["actual_prefix_hit_rate"]) <= TOLERANCE
    assert own["within_tolerance"] and own["actual_prefix_hit_rate"] == demo.report["summary"]["prefix_hit_rate"]
    for blocks in (640, 400):
        for policy in POLICY_NAMES:
            w = whatif(q, RUN, policy, blocks)
            assert w["optimal_prefix_hit_rate"] >= w["whatif_prefix_hit_rate"], (policy, blocks)
    rc = kvfabric_main(["whatif", "--db", demo.db_path, "--run", RUN, "--policy", "adaptive_aging",
                        "--num-blocks", "400", "--format", "json"])
    assert rc == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == demo.rest["whatif"]


def test_rest_answers_equal_the_cli(demo: DemoRun, capsys: pytest.CaptureFixture[str]) -> None:
    for argv, key in ((["misses", "--run", RUN, "--bucket-s", "5"], "misses"),
                      (["request", "--request-id", "conv-4/t3", "--run", RUN], "story")):
        rc = kvfabric_main(["query", *argv, "--db", demo.db_path, "--format", "json"])
        assert rc == 0 and json.loads(capsys.readouterr().out) == demo.rest[key], key


def test_the_exported_trace_replays(demo: DemoRun, q: QueryRunner, tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    fine, coarse = tmp_path / "demo16.jsonl", tmp_path / "demo.jsonl"
    for out, extra in ((fine, ["--block-tokens", "16"]), (coarse, [])):
        rc = kvfabric_main(["export", "--db", demo.db_path, "--run", RUN, "--format", "mooncake", "--out", str(out),
                            *extra])
        assert rc == 0
    capsys.readouterr()
    # 16-token ids carry exactly the sharing of the recorded chains: with room for everything, the file replays to
    # the hits the what-if gets from the database.
    room = 1_000_000
    from_file = simulate(load_trace(fine), "lru", room, block_size=16, trace_block_tokens=16)
    from_db = whatif(q, RUN, "lru", room, concurrency=1)
    assert from_file["prefix_hit_rate"] == pytest.approx(from_db["whatif_prefix_hit_rate"])
    assert from_file["prompt_tokens"] == q.run_summary(RUN)["prompt_tokens"]
    # The Mooncake-format export (512 tokens per id) replays through vLLM's real scheduler with `kvfabric replay`.
    rc = kvfabric_main(["replay", "--trace", str(coarse), "--policy", "lru", "--num-blocks", "640", "--format",
                        "json", "--no-progress"])
    replayed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and replayed["mode"] == "real" and replayed["requests"] == 394
    assert replayed["prompt_tokens"] == from_file["prompt_tokens"]
    # Sharing survives only to 512-token boundaries, so the coarse trace can hit less, never more.
    assert 0 < replayed["prefix_hit_rate"] <= from_file["prefix_hit_rate"]
