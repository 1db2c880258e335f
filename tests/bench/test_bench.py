"""``kvfabric bench``: every traffic mode against a real server (``kvfabric sim-serve``), and the workload rules that
make A/B runs comparable (seeded sessions; a next turn holds the previous prompt plus the answer actually returned).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.sim_serve_testkit import sim_server

from kvfabric.bench.modes import ConversationSession, ModeError, make_sessions, mode_params
from kvfabric.bench.prompts import Prompt, PromptFormat, Reply
from kvfabric.bench.scenario import ScenarioError, bundled_scenarios, load_scenario, scenario_from_dict
from kvfabric.cli import main as cli_main
from kvfabric.sim.tokenizer import word

REPO = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------------------ workload rules


class FakeContext:
    """Answers every request with a fixed reply and records the prompts (the session logic under test is ours)."""

    def __init__(self) -> None:
        self.prompts: list[tuple[str, int, list[int], bool]] = []

    async def ask(self, session: Any, turn: int, prompt: Prompt, max_tokens: int, last: bool) -> Reply | None:
        rendered = PromptFormat("tokens").render(prompt)
        self.prompts.append((session.name, turn, list(rendered), last))
        return Reply(ok=True, token_ids=[7] * max_tokens, text=" answer")

    async def sleep(self, seconds: float) -> None:
        return None


def test_a_next_turn_holds_the_previous_prompt_and_the_answer_returned() -> None:
    session = next(make_sessions("continuous", {"turns": [3, 3], "max_tokens": [4, 4]}, "s"))
    assert isinstance(session, ConversationSession)
    ctx = FakeContext()
    asyncio.run(session.run(ctx))
    prompts = [p for _, _, p, _ in ctx.prompts]
    assert len(prompts) == 3 and [last for *_, last in ctx.prompts] == [False, False, True]
    for t in range(2):
        assert prompts[t + 1] == prompts[t] + [7] * 4 + list(session.users[t])


def test_sessions_are_a_pure_function_of_the_seed() -> None:
    def draw(seed: str) -> list[list[int]]:
        out = []
        for s in list(zip(range(5), make_sessions("random_topic", {}, seed), strict=False)):
            out.append(PromptFormat("tokens").render(s[1].prompt))
        return out

    assert draw("a") == draw("a")
    assert draw("a") != draw("b")


def test_persona_rotation_visits_families_in_bursts_and_pressure_can_share_nothing() -> None:
    sessions = [s for _, s in zip(range(12), make_sessions("persona_rotation", {"personas": 3, "burst": 2}, 0),
                                  strict=False)]
    assert [s.family for s in sessions] == [f"persona-{k}" for k in (0, 0, 1, 1, 2, 2, 0, 0, 1, 1, 2, 2)]
    cold = [s for _, s in zip(range(30), make_sessions("pressure", {"hot_share": 0}, 0), strict=False)]
    firsts = {tuple(PromptFormat("tokens").render(s.prompt)[:16]) for s in cold}
    assert {s.family for s in cold} == {"cold"} and len(firsts) == 30  # not even a first block in common


def test_a_fork_continues_every_branch_from_the_trunks_history() -> None:
    fork = next(make_sessions("multi_turn_fork", {"trunk_turns": [2, 2], "branches": [3, 3],
                                                  "branch_turns": [1, 1], "max_tokens": [2, 2]}, 0))
    ctx = FakeContext()
    asyncio.run(fork.run(ctx))
    trunk = [p for name, _, p, _ in ctx.prompts if name.endswith(".trunk")]
    branches = [p for name, _, p, _ in ctx.prompts if ".b" in name]
    assert len(trunk) == 2 and len(branches) == 3
    history = trunk[-1] + [7, 7]
    assert all(b[: len(history)] == history and len(b) > len(history) for b in branches)
    # The trunk's last turn does not end the conversation (its branches continue it); each branch's does.
    assert [last for name, _, _, last in ctx.prompts if name.endswith(".trunk")] == [False, False]


def test_text_prompts_render_the_same_parts_as_words() -> None:
    p = Prompt().plus([1000, 1001]).plus(Reply(ok=True, text=" said")).plus([1002])
    assert PromptFormat("text").render(p) == f"{word(1000)} {word(1001)} said {word(1002)}"
    assert len({word(i) for i in range(1000, 100_000)}) == 99_000  # one distinct word per token id


def test_bad_parameters_and_scenarios_are_refused_with_a_reason() -> None:
    with pytest.raises(ModeError, match="unknown parameter"):
        mode_params("continuous", {"turnz": 3})
    with pytest.raises(ModeError, match="low <= high"):
        mode_params("pressure", {"cold_tokens": [10, 5]})
    with pytest.raises(ModeError, match="hot_share"):
        mode_params("pressure", {"hot_share": 2})
    with pytest.raises(ScenarioError, match="mode must be one of"):
        scenario_from_dict({"traffic": [{"mode": "nope"}]})
    with pytest.raises(ScenarioError, match="unknown key"):
        scenario_from_dict({"traffic": [{"mode": "pressure"}], "sever": {}})


def test_bundled_scenarios_load_and_state_their_capacity(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)  # no file outside the package: trace scenarios use the slices it ships
    names = bundled_scenarios()
    for required in ("ordinary_unique_cold", "template_family_revisit", "template_family_revisit_cycles",
                     "cache_pressure_ambiguous_hot_revisit", "trace_conversation", "trace_synthetic"):
        assert required in names
    for name in names:
        sc = load_scenario(name)
        assert sc.description and sc.shows and sc.server.capacity, name
        assert sc.server.kv_blocks * sc.server.block_size >= sc.server.max_model_len, name
        for t in sc.traffic:
            if t.mode == "dataset":  # the bundled slice holds every row the scenario replays
                path = Path(t.params["path"])
                assert path.is_file() and path.parent.name == "traces", name
                assert len(path.read_text().splitlines()) >= t.params["limit"], name
    # A trace that is not there: the error names the bundled slices and where the full traces are.
    with pytest.raises(ScenarioError, match=r"bundled trace slices: mooncake_conversation_first400\.jsonl.*Mooncake"):
        scenario_from_dict({"traffic": [{"mode": "dataset", "params": {"path": "conversation_trace.jsonl"}}]})


# ------------------------------------------------------------------------------------------------ against a server


@pytest.fixture(scope="module")
def server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    # With the word tokenizer the server takes token-id prompts and text prompts alike.
    with sim_server(tmp_path_factory.mktemp("bench"), "--kv-blocks", "4096", "--max-model-len", "4096",
                    "--latency-scale", "0", "--tokenizer", "words") as server:
        yield server.url


def _bench(capsys: pytest.CaptureFixture[str], tmp_path: Path, *args: str) -> tuple[int, dict[str, Any], dict]:
    out = tmp_path / "r.json"
    rc = cli_main(["bench", *args, "--format", "json", "--out", str(out), "--no-progress"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    return rc, json.loads(last), json.loads(out.read_text()) if out.exists() else {}


def _check_turns(results: dict[str, Any]) -> int:
    """Every later turn of a session hit at least the blocks its previous prompt and answer filled (the pool is
    large: nothing was evicted). Returns how many later turns were checked."""
    by_session: dict[str, list[dict[str, Any]]] = {}
    for r in results["requests"]:
        by_session.setdefault(r["session"], []).append(r)
    checked = 0
    for turns in by_session.values():
        turns.sort(key=lambda r: r["turn"])
        for prev, cur in itertools.pairwise(turns):
            # The last answer token was sampled, never computed: it is not in the cache.
            assert cur["cached_tokens"] >= 16 * ((prev["prompt_tokens"] + prev["completion_tokens"] - 1) // 16)
            checked += 1
    return checked


@pytest.mark.vllm
@pytest.mark.parametrize("mode", ["continuous", "random_topic", "persona_rotation", "pressure", "multi_turn_fork"])
def test_each_mode_runs_against_a_real_server(mode: str, server_url: str, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    rc, summary, results = _bench(capsys, tmp_path, "--endpoint", server_url, "--mode", mode, "--requests", "24",
                                  "--concurrency", "4", "--seed", "3", "--run-id", f"t-{mode}",
                                  "--param", "max_tokens=[4,8]")
    assert rc == 0
    assert summary["requests"] == 24 and summary["requests_failed"] == 0 and summary["run_id"] == f"t-{mode}"
    assert summary["cached_tokens_reported"] and summary["ttft_p50_s"] is not None
    records = results["requests"]
    assert all(r["request_id"].startswith(f"t-{mode}-") for r in records)
    assert all(r["completion_tokens"] == r["max_tokens"] for r in records)  # ignore_eos: the planned length
    if mode in ("continuous", "multi_turn_fork", "random_topic"):
        assert _check_turns(results) > 0
    if mode in ("random_topic", "persona_rotation"):
        assert summary["cached_tokens"] > 0  # shared documents / personas


@pytest.mark.vllm
def test_text_prompts_carry_the_returned_text_into_the_next_turn(server_url: str, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    rc, summary, results = _bench(capsys, tmp_path, "--endpoint", server_url, "--mode", "continuous",
                                  "--prompt-format", "text", "--requests", "12", "--concurrency", "3",
                                  "--param", "max_tokens=[4,8]", "--param", "turns=[3,4]")
    assert rc == 0 and summary["requests_failed"] == 0 and summary["requests"] == 12
    assert _check_turns(results) >= 6


@pytest.mark.vllm
def test_dataset_mode_replays_a_hash_ids_trace(server_url: str, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    rows = [{"timestamp": 0, "input_length": 100, "output_length": 3, "hash_ids": [1, 2, 3, 4]},
            {"timestamp": 50, "input_length": 90, "output_length": 2, "hash_ids": [1, 2, 9]},
            {"timestamp": 100, "input_length": 70, "output_length": 1, "hash_ids": [5, 6, 7]}]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rc, summary, results = _bench(capsys, tmp_path, "--endpoint", server_url, "--mode", "dataset",
                                  "--param", f"path={trace}", "--param", "block_tokens=32",
                                  "--concurrency", "1", "--seed", "11")
    assert rc == 0 and summary["requests"] == 3 and summary["requests_failed"] == 0
    recs = results["requests"]
    assert [r["prompt_tokens"] for r in recs] == [100, 90, 70]
    assert [r["completion_tokens"] for r in recs] == [3, 2, 1]
    # Row 2 shares two 32-token hash ids (64 tokens = 4 blocks) with row 1; row 3 shares nothing.
    assert [r["cached_tokens"] for r in recs] == [0, 64, 0]
    assert recs[2]["start_s"] >= 0.1  # timestamps (ms) set the arrivals


@pytest.mark.vllm
def test_duration_and_rate_bound_a_run(server_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    t0 = time.monotonic()
    rc, summary, _ = _bench(capsys, tmp_path, "--endpoint", server_url, "--mode", "continuous", "--duration", "2",
                            "--param", "max_tokens=[2,4]")
    assert rc == 0 and summary["stopped_by"] == "duration" and summary["requests"] > 0
    assert time.monotonic() - t0 < 30
    # Open loop: 6 single-turn sessions arrive as a seeded Poisson process at 4/s; the last cannot start earlier.
    rc, summary, results = _bench(capsys, tmp_path, "--endpoint", server_url, "--mode", "pressure",
                                  "--sessions", "6", "--rate", "4", "--seed", "5",
                                  "--param", "max_tokens=[2,2]", "--param", "cold_tokens=[32,64]")
    rng = random.Random("5/0/pressure/arrivals")
    last_arrival = sum(rng.expovariate(4.0) for _ in range(6))
    starts = sorted(r["start_s"] for r in results["requests"])
    assert rc == 0 and summary["requests"] == 6 and starts[-1] >= last_arrival - 0.01


def test_bench_refuses_bad_options_with_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["bench", "--mode", "pressure", "--endpoint", "http://127.0.0.1:9"]) == 2
    assert "no OpenAI-compatible server" in capsys.readouterr().err
    assert cli_main(["bench", "--mode", "pressure", "--no-vllm-extensions", "--prompt-format", "tokens"]) == 2
    assert cli_main(["bench", "--mode", "pressure", "--param", "nope=1"]) == 2
    assert "unknown parameter" in capsys.readouterr().err
