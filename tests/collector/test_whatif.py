"""``kvfabric whatif`` and ``GET /api/v1/runs/{run}/whatif`` on hand-made recorded runs with known answers.

Run ``runW`` (engine e0, block size 4, 5 blocks = the null block + 4, policy lru): requests X, Y, Z, X, Y, Z, X, Y, Z,
one at a time, each a 9-token prompt (two full blocks, both hittable: C = (9 - 1) // 4 = 2, and a partial one) and
one output token, so a request holds 3 blocks while it runs. One request's blocks fit beside a running one, three
are cycled: LRU never hits (what the run recorded), the optimum does; with room for everything, every repeat hits
both its blocks: 6 x 8 of 81 prompt tokens for any policy.
Run ``runW2``: the same traffic on two engines at once; each engine has its own cache.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from support.collector_testkit import EventScript, collector_files, send_scripts, wait_rows

from kvfabric.analysis.whatif import TOLERANCE, whatif
from kvfabric.cli import main as kvfabric_main
from kvfabric.policies import POLICY_NAMES
from kvfabric.queries import BadParameter, QueryRunner, UnknownRun

CHAINS = {"X": [10, 11], "Y": [20, 21], "Z": [30, 31]}
ORDER = "XYZXYZXYZ"


def cycle(run: str, engine: str) -> EventScript:
    s = EventScript(run, engine)
    cached: list[int] = []
    for i, name in enumerate(ORDER):
        chain = CHAINS[name]
        s.step()
        if len(cached) == 4:  # LRU: the oldest request's blocks go, tail first (what vLLM does here)
            for h in (cached[1], cached[0]):
                s.evict(h, "pressure", by=f"{name}{i}")
            cached = cached[2:]
        s.admit(f"{name}{i}", name, 9, chain, allocate=3)
        s.step().free(f"{name}{i}", chain, [0, 1])
        cached += chain
    return s


@dataclass
class Recorded:
    db_path: str
    rest: dict[str, object]


@pytest.fixture(scope="module")
def recorded() -> Iterator[Recorded]:
    with collector_files() as files:
        with files.process():
            streams = [cycle("runW", "e0").stream("w", num_blocks=5),
                       cycle("runW2", "a").stream("w2a", num_blocks=5),
                       cycle("runW2", "b").stream("w2b", num_blocks=5)]
            send_scripts(files.socket_path, streams)
            wait_rows(files.http_url, "runW", len(streams[0].rows))
            wait_rows(files.http_url, "runW2", len(streams[1].rows) * 2)
            rest: dict[str, object] = {}
            with httpx.Client(base_url=files.http_url, timeout=60) as c:
                rest["aging7"] = c.get("/api/v1/runs/runW/whatif",
                                       params={"policy": "adaptive_aging", "num_blocks": 7}).json()
                rest["codes"] = tuple(
                    c.get(path, params=params).status_code
                    for path, params in (
                        ("/api/v1/runs/runW/whatif", {"num_blocks": 1}),
                        ("/api/v1/runs/runW/whatif", {"num_blocks": 3}),  # 2 usable blocks; a request needs 3
                        ("/api/v1/runs/runW/whatif", {"policy": "bogus"}),
                        ("/api/v1/runs/nope/whatif", {}),
                    )
                )
        yield Recorded(files.db_path, rest)


@pytest.fixture(scope="module")
def q(recorded: Recorded) -> QueryRunner:
    return QueryRunner.for_path(recorded.db_path)


def test_replaying_the_run_as_it_ran_gives_what_it_had(q: QueryRunner) -> None:
    w = whatif(q, "runW")
    assert (w["policy"], w["num_blocks"], w["actual_policy"], w["admissions"], w["prompt_tokens"]) == (
        "lru", 5, "lru", 9, 81)
    e = w["engines"][0]
    assert (e["mean_in_flight"], e["concurrency"], e["own_num_blocks"]) == (1.0, 1, 5)  # one request at a time
    assert w["actual_prefix_hit_rate"] == 0.0 == w["replay_own_prefix_hit_rate"] == w["whatif_prefix_hit_rate"]
    assert w["replay_own_error"] == 0.0 and w["within_tolerance"] and w["tolerance"] == TOLERANCE
    assert w["optimal_prefix_hit_rate"] > 0.0  # Belady keeps the block that comes back first


def test_with_room_for_everything_every_repeat_hits(q: QueryRunner) -> None:
    for policy in (*POLICY_NAMES, "optimal"):
        w = whatif(q, "runW", policy, 1000)
        assert w["whatif_prefix_hit_rate"] == pytest.approx(48 / 81), policy
        assert w["optimal_prefix_hit_rate"] == pytest.approx(48 / 81)
        assert w["whatif_wasted_prefill_tokens"] == 0
        assert w["predicted_change"] == pytest.approx(48 / 81)  # over the own replay, which hit nothing


def test_the_optimum_is_never_below_a_policy(q: QueryRunner) -> None:
    for blocks in (4, 5, 7):
        for policy in POLICY_NAMES:
            w = whatif(q, "runW", policy, blocks)
            assert w["optimal_prefix_hit_rate"] >= w["whatif_prefix_hit_rate"], (policy, blocks)


def test_engines_replay_in_their_own_caches(q: QueryRunner) -> None:
    w = whatif(q, "runW2", "lru", 1000)
    assert [e["engine"] for e in w["engines"]] == ["a", "b"]
    assert w["admissions"] == 18 and w["prompt_tokens"] == 162
    assert w["whatif_prefix_hit_rate"] == pytest.approx(96 / 162)  # one shared cache would give 120 / 162


def test_bad_requests_are_refused_clearly(recorded: Recorded, q: QueryRunner,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert recorded.rest["codes"] == (422, 422, 422, 404)
    with pytest.raises(BadParameter, match="cannot hold"):
        whatif(q, "runW", "lru", 3)
    with pytest.raises(UnknownRun):
        whatif(q, "nope")
    rc = kvfabric_main(["whatif", "--db", recorded.db_path, "--run", "runW", "--num-blocks", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("kvfabric whatif: argument --num-blocks: must be an integer >= 2") \
        and len(err.splitlines()) == 1


def test_cli_json_last_line_equals_rest(recorded: Recorded, capsys: pytest.CaptureFixture[str]) -> None:
    rc = kvfabric_main(["whatif", "--db", recorded.db_path, "--run", "runW", "--policy", "adaptive_aging",
                        "--num-blocks", "7", "--format", "json"])
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 0
    last = json.loads(out[-1])
    assert last == recorded.rest["aging7"]
    for key in ("actual_prefix_hit_rate", "whatif_prefix_hit_rate", "optimal_prefix_hit_rate",
                "actual_wasted_prefill_tokens", "whatif_wasted_prefill_tokens", "tolerance"):
        assert key in last
    rc = kvfabric_main(["whatif", "--db", recorded.db_path, "--run", "runW", "--no-progress"])
    text = capsys.readouterr().out
    assert rc == 0 and "replay, own config" in text and "optimum" in text and "within the stated tolerance" in text
