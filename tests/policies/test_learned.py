"""The learned policy: its model file, the learner, the LRU guard, and the policy on traffic with known answers.

Traffic here is generated so the answers are known without a second implementation:

* ``hot_cold``: a few *hot* conversations that come back every round (each turn extends the previous prompt by one
  block; a conversation ends after 8 turns and a new one takes its place), interleaved with one-shot *cold*
  prompts nobody asks for again. With a pool that holds the live conversations plus one request, the optimum
  keeps exactly the conversations: its hit rate is the infinite cache's, counted directly from the rows;
* ``one_shot``: conversations that continue exactly once, soon, and are then dead: a model learned on it favours
  first-turn blocks and disfavours reused ones, which is exactly wrong for ``hot_cold``.

Fast mode (:mod:`kvfabric.sim.offline`) with 512-token blocks keeps these tests to seconds; the policy's
invariants through vLLM's real pool are tests/engine/test_steering.py's (parametrised over every policy name).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, ClassVar

import pytest

from kvfabric.cli import main
from kvfabric.engine.config import load_hook_settings
from kvfabric.learn.fit import learn
from kvfabric.learn.source import Traffic, from_trace
from kvfabric.policies import make_policy
from kvfabric.policies.base import PolicySettings, RequestInfo
from kvfabric.policies.guard import LRUGuard
from kvfabric.policies.learned import LearnedPolicy
from kvfabric.policies.reuse_model import (
    DISTANCE_BINS,
    ModelError,
    ReuseModel,
    auc_from_counts,
    default_model_path,
    load_model,
)
from kvfabric.sim.offline import OfflineCache, TraceRequest, block_keys, load_trace, simulate

BS = 512
FEATURES = ("uses", "role", "seen")
TRACES = Path(__file__).resolve().parents[2] / ".." / "shared" / "traces"
CONVERSATION = TRACES / "mooncake_conversation_first_half.jsonl"


def hot_cold(seed: int, rounds: int = 60, hot: int = 6, cold_per_hot: int = 3, cold_len: int = 8,
             base: int = 0) -> list[TraceRequest]:
    rnd = random.Random(seed)
    nid = base + 1_000_000
    convs = {c: [base + c * 10_000] for c in range(hot)}
    rows: list[TraceRequest] = []
    for r in range(rounds):
        order = list(range(hot))
        rnd.shuffle(order)
        for c in order:
            if len(convs[c]) >= 8:
                convs[c] = [base + 1000 * r + c * 10_000]
            convs[c].append(convs[c][0] + len(convs[c]))
            ids = list(convs[c])
            rows.append(TraceRequest(len(rows), len(ids) * BS - 100, 1, tuple(ids)))
            for _ in range(cold_per_hot):
                ids = [nid + j for j in range(cold_len)]
                nid += cold_len
                rows.append(TraceRequest(len(rows), cold_len * BS - 100, 1, tuple(ids)))
    return rows


def one_shot(seed: int, n: int = 1500, first_len: int = 6) -> list[TraceRequest]:
    rnd = random.Random(seed)
    rows: list[TraceRequest] = []
    pending: list[list[int]] = []
    nid = 5_000_000
    for i in range(n):
        if pending and rnd.random() < 0.5:
            ids = [*pending.pop(0), nid]
            nid += 1
        else:
            ids = [nid + j for j in range(first_len)]
            nid += first_len
            pending.append(list(ids))
        rows.append(TraceRequest(i, len(ids) * BS - 100, 1, tuple(ids)))
    return rows


def traffic(rows: list[TraceRequest]) -> Traffic:
    return Traffic([block_keys(r, BS) for r in rows], [r.input_length for r in rows], [1] * len(rows), BS,
                   {"kind": "test"})


def infinite_cache_hit_rate(rows: list[TraceRequest]) -> float:
    """Hit tokens / prompt tokens if nothing were ever evicted (vLLM's cap: the last prompt token is recomputed)."""
    seen: set[int] = set()
    hit = total = 0
    for r in rows:
        keys = block_keys(r, BS)
        cap = min(len(keys), (r.input_length - 1) // BS)
        h = 0
        while h < cap and keys[h] in seen:
            h += 1
        hit += h * BS
        total += r.input_length
        seen.update(keys)
    return hit / total


def rate(rows: list[TraceRequest], policy: Any, n: int) -> float:
    return simulate(rows, policy, n, block_size=BS)["prefix_hit_rate"]


@pytest.fixture(scope="module")
def hot_model() -> ReuseModel:
    return learn(traffic(hot_cold(1)), FEATURES, [0.05, 0.2])


@pytest.fixture(scope="module")
def wrong_model() -> ReuseModel:
    return learn(traffic(one_shot(3)), FEATURES, [0.05, 0.2])


# ---- the model file ------------------------------------------------------------------------------------------


def test_model_round_trips_and_bad_files_are_refused(tmp_path: Path, hot_model: ReuseModel) -> None:
    path = tmp_path / "m.json"
    hot_model.save(path)
    back = ReuseModel.load(path)
    assert back.features == hot_model.features
    assert {i: (c.n, c.reused, c.hist) for i, c in back.classes.items()} == \
        {i: (c.n, c.reused, c.hist) for i, c in hot_model.classes.items()}
    assert back.favoured() == hot_model.favoured() and back.predictive == hot_model.predictive
    data = json.loads(path.read_text())
    assert data["training"]["kind"] == "test" and "validation" in data["metrics"]

    def refused(mutate: Any, text: str | None = None) -> str:
        bad = tmp_path / "bad.json"
        if text is None:
            d = json.loads(path.read_text())
            mutate(d)
            text = json.dumps(d)
        bad.write_text(text)
        with pytest.raises(ModelError) as exc:
            ReuseModel.load(bad)
        assert "\n" not in str(exc.value)
        return str(exc.value)

    assert "not JSON" in refused(None, "{oops")
    assert "not a kvfabric-reuse-model" in refused(lambda d: d.update(format="other"))
    assert "version" in refused(lambda d: d.update(version=99))
    assert "feature" in refused(lambda d: d.update(features=["uses", "colour"]))
    assert "inconsistent" in refused(lambda d: d["classes"][0].update(reused=d["classes"][0]["n"] + 1))
    assert "inconsistent" in refused(lambda d: d["classes"][0].update(hist=[0] * DISTANCE_BINS))
    assert "out of range" in refused(lambda d: d["classes"][0].update(index=10_000))
    assert "no training candidates" in refused(lambda d: d.update(classes=[]))
    with pytest.raises(ModelError, match="cannot read"):
        ReuseModel.load(tmp_path / "missing.json")


def test_the_built_in_model_loads_and_favours_reused_content() -> None:
    model = load_model(None)
    assert default_model_path().name == "default.json"
    assert model.predictive and model.training["kind"] == "trace"
    fav = model.favoured()
    k = model.features.index("uses")
    # Content used 8+ times is reused far more often than content used once (the headline fact of the traces).
    assert any(fav[i] for i in range(model.num_classes) if model.buckets(i)[k] == 5)
    first = [i for i in model.classes if model.buckets(i)[k] == 0]
    assert max(model.probability(i) for i in first) < max(model.probability(i) for i in model.classes)


def test_auc_from_counts_is_exact_on_small_cases() -> None:
    assert auc_from_counts([(0.9, 5, 0), (0.1, 0, 5)]) == 1.0
    assert auc_from_counts([(0.1, 5, 0), (0.9, 0, 5)]) == 0.0
    assert auc_from_counts([(0.5, 3, 3)]) == 0.5
    assert auc_from_counts([(0.5, 3, 0)]) is None
    # 2 positives at 0.8, 1 positive + 1 negative at 0.5, 2 negatives at 0.2: (2*3 + 1*(2 + 0.5)) / (3*3).
    assert auc_from_counts([(0.8, 2, 0), (0.5, 1, 1), (0.2, 0, 2)]) == pytest.approx(8.5 / 9)


# ---- the learner --------------------------------------------------------------------------------------------


def test_learner_finds_what_the_optimum_keeps_and_the_policy_approaches_it(hot_model: ReuseModel) -> None:
    """Trained on one seed of hot/cold traffic, evaluated on another: the model favours the conversations'
    reused content and not one-shot prompts; with a pool that holds the live conversations, the optimum is the
    infinite cache's hit rate (counted from the rows), and the learned policy gets most of it where LRU,
    flushed by the cold prompts, gets almost nothing."""
    k_uses, k_role = FEATURES.index("uses"), FEATURES.index("role")
    fav = hot_model.favoured()
    for i, c in hot_model.classes.items():
        b = hot_model.buckets(i)
        if b[k_uses] == 0 and b[k_role] == 0 and c.n > 1000:  # first-use content sealed by the request (cold)
            assert not fav[i] and hot_model.probability(i) < 0.05
        if b[k_uses] in (1, 2, 3) and c.n > 100:  # a conversation's history, 2-4 turns old (it lives 8)
            assert fav[i] and hot_model.probability(i) > 0.6
    assert hot_model.predictive
    val = hot_model.metrics["validation"]
    assert val["auc"] > 0.9 and val["log_loss"] < val["log_loss_base_rate"]

    test = hot_cold(2, base=50_000_000)
    best = infinite_cache_hit_rate(test)
    for n in (60, 90):
        opt = rate(test, "optimal", n)
        assert opt == pytest.approx(best, abs=1e-12)
        lru = rate(test, "lru", n)
        learned = rate(test, LearnedPolicy(model=hot_model), n)
        assert lru < 0.25 * opt
        assert learned > 0.85 * opt, (n, lru, learned, opt)


def test_learned_from_the_model_file_through_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    rows = hot_cold(5, rounds=30)
    trace.write_text("".join(json.dumps({"timestamp": r.timestamp_ms, "input_length": r.input_length,
                                         "output_length": 1, "hash_ids": list(r.hash_ids)}) + "\n" for r in rows))
    out = tmp_path / "m.json"
    assert main(["learn", "--trace", str(trace), "--out", str(out), "--block-size", "512", "--format", "json",
                 "--no-progress"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["requests"] == len(rows) and summary["favoured_classes"] >= 1
    model = ReuseModel.load(out)
    assert model.training["path"] == "t.jsonl" and model.training["rows"] == len(rows)
    assert model.training["block_size"] == 512 and len(model.training["sha256"]) == 64
    assert main(["replay", "--trace", str(trace), "--policy", "learned", "--policy-model", str(out),
                 "--num-blocks", "80", "--block-size", "512", "--fast", "--format", "json", "--no-progress"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["policy"] == "learned" and res["policy_state"]["model_training"] == "t.jsonl"
    # A split: the model of the first half, a different file from the second half's.
    assert main(["learn", "--trace", str(trace), "--out", str(tmp_path / "h.json"), "--block-size", "512",
                 "--limit", "60", "--skip", "30", "--no-progress"]) == 0
    assert ReuseModel.load(tmp_path / "h.json").training["rows"] == 60


def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}) + "\n")
    out = str(tmp_path / "m.json")
    cases = [
        (["learn", "--trace", str(tmp_path / "nope.jsonl"), "--out", out], "no trace file"),
        (["learn", "--trace", str(trace), "--out", out, "--features", "uses,colour"], "unknown feature"),
        (["learn", "--trace", str(trace), "--out", out, "--capacity", "2"], "--capacity"),
        (["learn", "--trace", str(trace), "--out", str(tmp_path / "no" / "m.json")], "no directory"),
        (["learn", "--db", str(tmp_path / "x.duckdb"), "--out", out], "--db needs --run"),
        (["learn", "--db", str(tmp_path / "x.duckdb"), "--run", "r", "--out", out], "no database at"),
        (["replay", "--trace", str(trace), "--policy", "learned", "--policy-model", str(trace), "--num-blocks",
          "50", "--fast"], "not a kvfabric-reuse-model"),
        (["replay", "--trace", str(trace), "--policy", "lru", "--policy-model", str(trace), "--num-blocks", "50",
          "--fast"], "--policy-model goes with --policy learned"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) <= 2, (argv, err)
    assert not Path(out).exists()


def test_policy_model_setting_is_validated_once_and_falls_back(tmp_path: Path, hot_model: ReuseModel) -> None:
    good = tmp_path / "m.json"
    hot_model.save(good)
    s = load_hook_settings({"KVFABRIC_EVICTION_POLICY": "learned", "KVFABRIC_POLICY_MODEL": str(good)})
    assert s.policy == "learned" and s.policy_model == str(good) and not s.warnings
    policy = make_policy("learned", s)
    assert isinstance(policy, LearnedPolicy) and policy.model.training["kind"] == "test"
    bad = tmp_path / "bad.json"
    bad.write_text("[]")
    s = load_hook_settings({"KVFABRIC_EVICTION_POLICY": "learned", "KVFABRIC_POLICY_MODEL": str(bad)})
    assert s.policy == "learned" and s.policy_model == "" and "using the default (the built-in model)" in s.warnings[0]
    assert make_policy("learned", s).model.training["kind"] == "trace"  # the built-in one
    s = load_hook_settings({"KVFABRIC_EVICTION_POLICY": "learned"})
    assert s.policy_model == "" and not s.warnings


# ---- the guard ----------------------------------------------------------------------------------------------


class FixedCredit(LearnedPolicy):
    """The learned policy with ARC's credit frozen at two pools: only the guard can pull it back to LRU."""

    STEP: ClassVar[float] = 0.0

    def bind(self, num_blocks: int) -> None:
        super().bind(num_blocks)
        self.credit = 2.0 * num_blocks


def test_a_model_trained_on_the_wrong_traffic_falls_back_to_lru(wrong_model: ReuseModel,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A model of one-shot conversations favours exactly the wrong blocks on hot/cold traffic. With its credit
    frozen, the policy without the guard loses almost every hit; the guard measures the mistakes and brings it
    back to LRU's hit rate (within the pool of mistakes it takes to notice); the whole policy (ARC and guard)
    stays at LRU's."""
    test = hot_cold(2, rounds=240, cold_per_hot=1, base=50_000_000)
    n = 90
    lru = rate(test, "lru", n)
    fav = wrong_model.favoured()
    k = FEATURES.index("uses")
    assert any(fav[i] for i in wrong_model.classes if wrong_model.buckets(i)[k] == 0)  # it favours first turns
    guarded = FixedCredit(model=wrong_model)
    with_guard = rate(test, guarded, n)
    assert guarded.guard.mistakes > 10 * max(1, guarded.guard.wins) and guarded.guard.trust < 0.05
    whole = rate(test, LearnedPolicy(model=wrong_model), n)
    monkeypatch.setattr(LRUGuard, "STEP_POOLS", 1e12)  # trust never moves: no guard
    without_guard = rate(test, FixedCredit(model=wrong_model), n)
    assert without_guard < 0.2 * lru, (without_guard, lru)
    assert with_guard > lru - 0.01, (with_guard, lru)
    assert whole > lru - 0.002, (whole, lru)


def lockstep(rows: list[TraceRequest], policy: LearnedPolicy, n: int) -> tuple[int, int]:
    """Exact wins and mistakes against LRU: both caches replayed side by side, hit blocks compared per request."""
    ours = OfflineCache(n, policy, BS)
    lru = OfflineCache(n, make_policy("lru"), BS)
    wins = mistakes = 0
    for i, r in enumerate(rows):
        keys = block_keys(r, BS)
        info = RequestInfo(f"r{i}", position=i)
        a, ha = ours.admit(f"r{i}", keys, r.input_length, 1, info)
        b, hb = lru.admit(f"r{i}", keys, r.input_length, 1, info)
        wins += max(0, ha - hb)
        mistakes += max(0, hb - ha)
        ours.finish(a, info)
        lru.finish(b, info)
    return wins, mistakes


@pytest.mark.parametrize("which", ["hot_cold", "conversation"])
def test_guard_counts_match_an_exact_lru_replayed_in_lockstep(which: str, hot_model: ReuseModel) -> None:
    if which == "hot_cold":
        rows, n = hot_cold(7, rounds=120, cold_per_hot=2), 60
    else:
        if not CONVERSATION.exists():
            pytest.skip(f"{CONVERSATION} not available")
        rows = load_trace(CONVERSATION, 2000)
        n = len({k for r in rows for k in block_keys(r, BS)}) // 20
    policy = LearnedPolicy(model=hot_model) if which == "hot_cold" else LearnedPolicy(settings=PolicySettings())
    wins, mistakes = lockstep(rows, policy, n)
    g = policy.guard
    assert wins > 50, (wins, mistakes)
    assert abs(g.wins - wins) <= 0.05 * wins + 5, (g.wins, wins)
    assert abs(g.mistakes - mistakes) <= 0.05 * max(wins, mistakes) + 5, (g.mistakes, mistakes)


def test_guard_memory_stays_bounded() -> None:
    g = LRUGuard(64)
    held = g.held
    for step in range(20_000):
        b = step % 64
        held[b] = True
        g.candidate(b, step, False)
        if step % 3 == 0:  # a third of the candidates are used again (left the candidates): stale entries
            held[b] = False
    assert len(g.fifo) <= 2 * 64 + 1024 + 1


# ---- from a trace file -----------------------------------------------------------------------------------------


def test_traffic_from_a_trace_keeps_rows_and_order(tmp_path: Path) -> None:
    f = tmp_path / "t.jsonl"
    f.write_text("".join(json.dumps({"timestamp": i, "input_length": 1100, "output_length": 3,
                                     "hash_ids": [0, i, 99]}) + "\n" for i in range(10)))
    t = from_trace(str(f), 512, skip=2, limit=5)
    assert len(t) == 5 and t.chains[0] == [0, 2] and t.chains[-1] == [0, 6] and t.input_lengths == [1100] * 5
    assert t.source["rows"] == 5 and t.source["skip"] == 2
