"""The long-context scenarios (issue 30): each bundled file loads, states its SLO, capacity and max model length, and
generates, from its seed alone, traffic with the statistics the file claims; one of them, scaled down, puts a real
server's cache under pressure (``kvfabric ab`` against ``kvfabric sim-serve``)."""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import os
import tomllib
from pathlib import Path
from typing import Any

import pytest

from kvfabric.bench.modes import ModeError, make_sessions, mode_params
from kvfabric.bench.prompts import Prompt, PromptFormat, Reply
from kvfabric.bench.runner import _seed_of, count_planned_requests
from kvfabric.bench.scenario import Scenario, ScenarioError, load_scenario, scenario_from_dict
from kvfabric.cli import main as cli_main

LONG = ("rag_document_revisit", "long_conversation_return", "agent_tool_loop", "trace_mooncake_arrivals")


class Recorder:
    """Answers every request with ``max_tokens`` copies of token 7; records (session, turn, prompt, last)."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, int, list[int], bool]] = []

    async def ask(self, session: Any, turn: int, prompt: Prompt, max_tokens: int, last: bool) -> Reply | None:
        self.asked.append((session.name, turn, list(PromptFormat("tokens").render(prompt)), last))
        return Reply(ok=True, token_ids=[7] * max_tokens)

    async def sleep(self, seconds: float) -> None:
        return None


def _run(mode: str, params: dict[str, Any], seed: str, sessions: int, *, together: bool = False) -> Recorder:
    """Run ``sessions`` sessions of ``mode`` against a :class:`Recorder`, one after another (or all at once)."""
    drawn = list(itertools.islice(make_sessions(mode, params, seed), sessions))
    rec = Recorder()

    async def go() -> None:
        if together:
            await asyncio.gather(*(s.run(rec) for s in drawn))
        else:
            for s in drawn:
                await s.run(rec)

    asyncio.run(go())
    return rec


def _traffic(sc: Scenario, name: str) -> tuple[int, Any]:
    return next((i, t) for i, t in enumerate(sc.traffic) if t.name == name)


# ------------------------------------------------------------------------------------------------ the files


@pytest.mark.parametrize("name", LONG)
def test_each_long_scenario_loads_with_slo_capacity_and_sources(name: str, monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)  # nothing outside the package: the trace scenario uses the slice it ships
    sc = load_scenario(name)
    assert sc.name == name and sc.description and sc.shows and sc.server.capacity
    assert sc.ttft_slo_ms is not None and sc.ttft_slo_ms > 0
    assert sc.server.max_model_len >= 16384 and sc.server.kv_blocks * sc.server.block_size >= sc.server.max_model_len
    text = (Path(__file__).resolve().parents[2] / "kvfabric" / "bench" / "scenarios" / f"{name}.toml").read_text()
    assert "# Sources" in text and "ttft_slo_ms" in text and "https://" in text  # cited in the file
    planned = count_planned_requests(sc)
    assert planned is not None and 30 <= planned <= 160  # one arm: tens of requests to ~150
    for t in sc.traffic:
        if t.mode == "dataset":  # a slice shipped in the package, never a path outside it
            path = Path(t.params["path"])
            assert path.is_file() and path.parent.name == "traces" and path.parent.parent.name == "bench"


def test_ttft_slo_is_optional_and_checked() -> None:
    base: dict[str, Any] = {"traffic": [{"mode": "pressure", "sessions": 1}]}
    assert scenario_from_dict(base).ttft_slo_ms is None
    assert scenario_from_dict({**base, "ttft_slo_ms": 250}).ttft_slo_ms == 250.0
    for bad in (0, -5, "fast", True, float("nan")):
        with pytest.raises(ScenarioError, match="ttft_slo_ms must be a number of milliseconds > 0"):
            scenario_from_dict({**base, "ttft_slo_ms": bad})


# ------------------------------------------------------------------------------------------------ the traffic


def test_rag_documents_are_long_zipf_popular_and_shared_token_for_token() -> None:
    sc = load_scenario("rag_document_revisit")
    i, t = _traffic(sc, "documents")
    p = mode_params(t.mode, t.params)
    seed = _seed_of(sc, i, t)
    rec = _run(t.mode, t.params, seed, 200)
    assert _run(t.mode, t.params, seed, 200).asked == rec.asked  # a pure function of the seed
    assert _run(t.mode, t.params, seed + "x", 20).asked != rec.asked[:20]  # another seed, other traffic
    instructions = p.instructions_tokens
    docs: dict[str, list[int]] = {}
    first = [(name, prompt) for name, turn, prompt, _ in rec.asked if turn == 0]
    for name, prompt in first:
        family = name.split(".")[0]
        q = len(prompt) - instructions
        # instructions + document + a 16-64-token question: the document is 4,096-16,384 tokens
        assert 4096 + 16 <= q <= 16384 + 64
        doc = prompt[instructions:]
        if family in docs:  # the same document, token for token, whoever asks
            shared = docs[family]
            assert doc[:len(shared) - 64] == shared[:len(shared) - 64]
        else:
            docs[family] = doc
    assert len({tuple(pr[:instructions]) for _, pr in first}) == 1  # the instructions are shared by all
    # Zipf skew: the most popular rank gets several times the share of the median rank; rank 0 leads.
    counts = collections.Counter(name.split(".")[0] for name, _ in first)
    top, n_top = counts.most_common(1)[0]
    assert top == "doc-0" and n_top / len(first) > 0.2
    assert counts["doc-0"] > 3 * (counts.get("doc-5", 0) + 1) / 2
    assert sum(counts[f"doc-{k}"] for k in range(6)) / len(first) > 0.5  # 6 of 24 docs: ~65 % of questions
    # the cold component shares nothing with the documents nor with itself
    j, cold = _traffic(sc, "cold")
    crec = _run(cold.mode, cold.params, _seed_of(sc, j, cold), 10)
    heads = {tuple(pr[:16]) for _, _, pr, _ in crec.asked}
    assert len(heads) == 10 and all(4096 <= len(pr) <= 12288 for _, _, pr, _ in crec.asked)


def test_returning_conversations_continue_their_history_after_every_other_visit() -> None:
    sc = load_scenario("long_conversation_return")
    i, t = _traffic(sc, "conversations")
    seed = _seed_of(sc, i, t)
    n = t.params["conversations"] * t.params["visits"]
    rec = _run(t.mode, t.params, seed, n)
    assert _run(t.mode, t.params, seed, n).asked == rec.asked
    assert len(rec.asked) == count_planned_requests(Scenario(name="x", traffic=(t,), seed=sc.seed)) == 64
    # Visit-major order: the 8 conversations' visit 0, then their visit 1, ...: 7 other visits between two.
    order = [name for name, turn, _, _ in rec.asked if turn % 2 == 0]
    assert order == [f"conv-{c}" for _ in range(4) for c in range(8)]
    by_conv: dict[str, list[tuple[int, list[int], bool]]] = collections.defaultdict(list)
    for name, turn, prompt, last in rec.asked:
        by_conv[name].append((turn, prompt, last))
    for turns in by_conv.values():
        assert [tn for tn, _, _ in turns] == list(range(8))  # turns counted across visits
        assert [last for *_, last in turns] == [False] * 7 + [True]  # one session end, after the last visit
        for (_, prev, _), (_, cur, _) in itertools.pairwise(turns):
            assert cur[:len(prev)] == prev and cur[len(prev):len(prev) + 32] == [7] * 32  # history + answer
        assert 8192 <= len(turns[0][1]) <= 12288
        assert 16384 <= len(turns[-1][1]) <= 32768  # grown to 16-32K
    assert max(len(turns[-1][1]) for turns in by_conv.values()) >= 20000


def test_returning_conversations_run_concurrently_wait_for_their_previous_visit() -> None:
    params = {"conversations": 2, "visits": 3, "opening_tokens": [64, 64], "user_tokens": [8, 8],
              "max_tokens": [2, 2], "turns_per_visit": [1, 2]}
    alone = _run("returning_conversation", params, "s", 6)
    together = _run("returning_conversation", params, "s", 6, together=True)  # every visit started at once
    assert sorted(map(repr, together.asked)) == sorted(map(repr, alone.asked))


def test_a_failed_visit_ends_its_conversation() -> None:
    params = {"conversations": 1, "visits": 3, "opening_tokens": [32, 32], "user_tokens": [8, 8],
              "max_tokens": [2, 2]}

    class Failing(Recorder):
        async def ask(self, session: Any, turn: int, prompt: Prompt, max_tokens: int, last: bool) -> Reply | None:
            await super().ask(session, turn, prompt, max_tokens, last)
            return Reply(ok=turn < 2)

    rec = Failing()
    sessions = list(make_sessions("returning_conversation", params, "f"))

    async def go() -> None:
        await asyncio.gather(*(s.run(rec) for s in sessions))

    asyncio.run(go())
    assert [turn for _, turn, _, _ in rec.asked] == [0, 1, 2]  # visit 2 never asks


def test_agents_share_the_system_prompt_token_for_token_and_append_tool_outputs() -> None:
    sc = load_scenario("agent_tool_loop")
    i, t = _traffic(sc, "agents")
    p = mode_params(t.mode, t.params)
    seed = _seed_of(sc, i, t)
    rec = _run(t.mode, t.params, seed, 6)
    assert _run(t.mode, t.params, seed, 6).asked == rec.asked
    by_agent: dict[str, list[list[int]]] = collections.defaultdict(list)
    for name, _, prompt, _ in rec.asked:
        by_agent[name].append(prompt)
    firsts = [turns[0] for turns in by_agent.values()]
    # The system prompt + tool schema: the longest common prefix of every agent's first prompt, 6,144-8,192 tokens.
    common = 0
    while all(len(f) > common and f[common] == firsts[0][common] for f in firsts):
        common += 1
    assert p.system_tokens[0] <= common <= p.system_tokens[1]
    system = firsts[0][:common]
    for turns in by_agent.values():
        assert 6 <= len(turns) <= 10
        assert all(pr[:common] == system for pr in turns)  # every step of every agent starts with it
        for prev, cur in itertools.pairwise(turns):
            assert cur[:len(prev)] == prev  # the history is kept
            added = len(cur) - len(prev)
            # the action (64-192 tokens, returned) then the tool output (256-2,048)
            assert 64 + 256 <= added <= 192 + 2048
            assert cur[len(prev):len(prev) + 64] == [7] * 64
    assert len({name.split(".")[0] for name in by_agent}) == 1  # one agent kind: one family
    with pytest.raises(ModeError, match="steps"):
        mode_params("agent_loop", {"steps": [0, 3]})


def test_trace_rows_arrive_at_their_own_timestamps() -> None:
    sc = load_scenario("trace_mooncake_arrivals")
    i, t = _traffic(sc, "trace")
    path = Path(t.params["path"])
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 119 and t.params["time_scale"] == 0.5 and t.concurrency >= 32
    sessions = list(make_sessions(t.mode, t.params, _seed_of(sc, i, t)))
    assert len(sessions) == len(rows) == count_planned_requests(sc)
    t0 = rows[0]["timestamp"]
    for s, r in zip(sessions, rows, strict=True):
        assert s.start_s == pytest.approx((r["timestamp"] - t0) / 1000 * 0.5)
        assert not s.knows_session
    starts = [s.start_s for s in sessions]
    assert starts == sorted(starts) and 140 <= (starts[-1] or 0) <= 150
    # The slice keeps whole conversations: a quarter of its rows return to an earlier row's prefix (>= 2 blocks).
    seen: set[int] = set()
    returns = 0
    for r in rows:
        k = 0
        for h in r["hash_ids"]:
            if h not in seen:
                break
            k += 1
        returns += k >= 2
        seen.update(r["hash_ids"])
    assert returns == 29


# ------------------------------------------------------------------------------------------------ end to end

# agent_tool_loop scaled down: the same mode and structure (a shared system prompt, histories growing by tool
# outputs, agents waiting on tools), small enough for a CPU server; the pool holds the system prompt and one or two
# histories, not six.
SMALL_AGENTS = """
name = "agent_tool_loop_small"
description = "agent_tool_loop scaled down for a CPU test."
shows = "That the scenario's structure puts the cache under pressure."
expect = "difference"
seed = 0
ttft_slo_ms = 1000.0

[server]
model = "qwen2-0.5b"
kv_blocks = 300
max_model_len = 4096
latency_scale = 0.0
capacity = "300 blocks: the 64-block system prompt and ~2 of the 6 histories (~40-110 blocks each)."

[[traffic]]
name = "agents"
mode = "agent_loop"
sessions = 6
concurrency = 6
[traffic.params]
agent_kinds = 1
system_tokens = [1024, 1024]
task_tokens = [64, 128]
steps = [4, 5]
tool_output_tokens = [128, 256]
max_tokens = [4, 8]
think_s = [0.05, 0.3]
"""


@pytest.mark.vllm
def test_agent_tool_loop_puts_a_real_cache_under_pressure(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    for k in [k for k in os.environ if k.startswith("KVFABRIC_")]:
        monkeypatch.delenv(k)
    # the scaled-down file is the bundled one with smaller numbers, nothing else
    bundled = tomllib.loads((Path(__file__).resolve().parents[2] / "kvfabric" / "bench" / "scenarios"
                             / "agent_tool_loop.toml").read_text())
    small = tomllib.loads(SMALL_AGENTS)
    assert small["traffic"][0]["mode"] == bundled["traffic"][0]["mode"]
    assert set(small["traffic"][0]["params"]) == set(bundled["traffic"][0]["params"])
    scenario = tmp_path / "agents.toml"
    scenario.write_text(SMALL_AGENTS)
    out = tmp_path / "ab"
    rc = cli_main(["ab", "--scenario", str(scenario), "--policies", "lru", "--repeat", "1", "--out", str(out),
                   "--format", "json", "--no-progress"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    plan = json.loads((out / "plan.json").read_text())
    [arm] = plan["arms"]
    bench = json.loads((out / "runs" / f"{arm['run_id']}.bench.json").read_text())
    assert bench["summary"]["requests_failed"] == 0 and bench["summary"]["requests"] >= 24
    summary = json.loads((out / "runs" / f"{arm['run_id']}.collector.json").read_text())["summary"]
    line = json.loads(captured.out.strip().splitlines()[-1])
    lru = line["policies"]["lru"]
    assert summary["evicted_blocks"] > 0  # the pool is under pressure
    assert lru["rebuilt_from_eviction_blocks"]["median"] > 0  # histories evicted while a tool ran, rebuilt
    assert lru["prefix_hit_rate"]["median"] > 0  # and the system prompt still hit


def test_records_name_a_bundled_trace_by_its_file_name_not_this_machines_path() -> None:
    """Plans and results (``Scenario.as_dict``) carry no path of the machine that wrote them: a bundled slice is
    recorded by its bare name, which loading resolves to the slice again; a trace given by its own path keeps it."""
    sc = load_scenario("trace_mooncake_arrivals")
    _, t = _traffic(sc, "trace")
    assert Path(t.params["path"]).is_absolute()  # resolved where the run opens it ...
    recorded = sc.as_dict()["traffic"][0]["params"]["path"]
    assert recorded == "mooncake_conversation_sessions_1in8_300s.jsonl"  # ... recorded by name
    again = scenario_from_dict({"traffic": [{"mode": "dataset", "params": {"path": recorded}}]})
    assert again.traffic[0].params["path"] == t.params["path"]
    own = scenario_from_dict({"traffic": [{"mode": "dataset", "params": {"path": t.params["path"]}}]})
    assert own.as_dict()["traffic"][0]["params"]["path"] == recorded  # the bundled file, however it was named
