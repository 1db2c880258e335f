"""``kvfabric replay``: real scheduler vs fast mode, the optimum inside vLLM, streaming to a collector socket."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import duckdb
import httpx
import pytest
from support.collector_testkit import collector_files, wait_until

from kvfabric.cli import main
from kvfabric.policies import POLICY_NAMES

pytestmark = pytest.mark.vllm

KEYS = {
    "policy", "num_blocks", "requests", "prompt_tokens", "prefix_hit_tokens", "prefix_hit_rate", "evicted_blocks",
    "rebuilt_from_eviction_blocks", "wasted_prefill_tokens", "events_emitted", "events_dropped",
}


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """40 rows: 4 families with shared two-block trunks, conversations that extend their previous turn."""
    rows = []
    last: dict[int, list[int]] = {}
    next_id = 1000
    for i in range(40):
        fam = (i * 7) % 4
        ids = last.get(fam, [fam, 100 + fam])
        if i % 3 == 0:
            ids = [fam, 100 + fam]  # a fresh conversation of the family
        ids = [*ids, next_id]
        next_id += 1
        last[fam] = ids
        rows.append({"timestamp": i * 500, "input_length": len(ids) * 512 - 37, "output_length": 20,
                     "hash_ids": ids})
    path = tmp_path_factory.mktemp("trace") / "tiny.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def replay(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert main(["replay", *args, "--format", "json", "--no-progress"]) == 0
    out = capsys.readouterr().out.strip().splitlines()[-1]
    return json.loads(out)


@pytest.mark.parametrize("policy", [*POLICY_NAMES, "optimal"])
def test_real_and_fast_modes_agree(capsys: pytest.CaptureFixture[str], trace: Path, policy: str) -> None:
    args = ["--trace", str(trace), "--policy", policy, "--num-blocks", "400"]
    real = replay(capsys, *args)
    fast = replay(capsys, *args, "--fast")
    assert KEYS <= set(real) and KEYS <= set(fast)
    assert real["mode"] == "real" and fast["mode"] == "offline"
    assert real["requests"] == fast["requests"] == 40
    assert real["prompt_tokens"] == fast["prompt_tokens"]
    assert real["evicted_blocks"] > 0  # the pool is small enough to evict
    # The two modes model the same cache: identical hits, and rebuilt blocks within a block or two.
    assert real["prefix_hit_tokens"] == fast["prefix_hit_tokens"], (real, fast)
    assert abs(real["rebuilt_from_eviction_blocks"] - fast["rebuilt_from_eviction_blocks"]) <= 2
    assert real["events_emitted"] > 0 and real["events_dropped"] == 0
    assert real["wasted_prefill_tokens"] == 16 * real["rebuilt_from_eviction_blocks"]
    if policy == "lru":
        assert "steering" not in real  # lru attaches nothing


def test_optimum_beats_lru_inside_vllm(capsys: pytest.CaptureFixture[str], trace: Path) -> None:
    base = ["--trace", str(trace), "--num-blocks", "300"]
    lru = replay(capsys, *base, "--policy", "lru")
    opt = replay(capsys, *base, "--policy", "optimal")
    assert opt["prefix_hit_tokens"] > lru["prefix_hit_tokens"]


@pytest.mark.parametrize("policy", ["optimal", "adaptive_aging"])
def test_events_stream_to_a_collector_labelled_with_the_policy_that_ran(
        capsys: pytest.CaptureFixture[str], trace: Path, policy: str) -> None:
    """Through a real collector process: every event arrives, labelled with the policy that actually ran (the
    optimum's events were once stored as ``lru``)."""
    with collector_files() as files:
        proc = files.process()
        proc.start()
        try:
            out = replay(capsys, "--trace", str(trace), "--policy", policy, "--num-blocks", "400",
                         "--collector", files.socket_path, "--limit", "12", "--run-id", f"r-{policy}")
            assert out["events_dropped"] == 0

            def stored() -> Any:
                runs = {r["run_id"]: r for r in httpx.get(f"{files.http_url}/api/v1/runs").json()}
                run = runs.get(f"r-{policy}")
                return run if run and run["events"] >= out["events_emitted"] else None

            run = wait_until(stored, timeout=30, what="the replay's events stored")
        finally:
            proc.stop()
        assert run["events"] == out["events_emitted"]
        con = duckdb.connect(files.db_path, read_only=True)
        policies = con.execute("SELECT DISTINCT policy FROM events WHERE run_id = ?", [f"r-{policy}"]).fetchall()
        con.close()
        assert policies == [(policy,)]


def test_real_and_fast_modes_agree_on_families(capsys: pytest.CaptureFixture[str], trace: Path) -> None:
    """Both modes name a trace request's family by the same rule (docs/design.md §5; no request-id convention), so
    the admission gate, which keys on families, limits the same blocks in both."""
    args = ["--trace", str(trace), "--policy", "lru", "--num-blocks", "400", "--admission-anchor-blocks", "2"]
    real = replay(capsys, *args)
    fast = replay(capsys, *args, "--fast")
    # 4 families: each family's first request is gated (its blocks past the anchor are not cached), once.
    assert real["admission_limited_blocks"] == fast["admission_limited_blocks"] > 0
    assert real["prefix_hit_tokens"] == fast["prefix_hit_tokens"]


def test_fast_mode_refuses_real_only_flags(trace: Path) -> None:
    assert main(["replay", "--trace", str(trace), "--num-blocks", "100", "--fast", "--collector", "/x"]) == 2


def test_bad_inputs_get_a_clear_error(capsys: pytest.CaptureFixture[str], trace: Path, tmp_path: Path) -> None:
    assert main(["replay", "--trace", str(tmp_path / "missing.jsonl"), "--num-blocks", "100"]) == 2
    assert "no trace file" in capsys.readouterr().err
    # A pool smaller than one request: said plainly, with the fix, instead of a traceback.
    assert main(["replay", "--trace", str(trace), "--num-blocks", "3", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "the pool has 2" in err and "raise --num-blocks" in err
