"""The overhead benchmark's lockstep runner (benchmarks/bench_hook_overhead.py) on a small slice of its workload:
each mode gets the engine it names (KVFabric only where the mode asks for it), and every engine runs to the end."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[2]


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_hook_overhead", ROOT / "benchmarks" / "bench_hook_overhead.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_lockstep_round_builds_each_mode_and_runs_every_engine(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from kvfabric.sim.workload import demo_workload

    for var in ("KVFABRIC_LIFECYCLE", "KVFABRIC_SINK", "KVFABRIC_EVICTION_POLICY"):
        monkeypatch.delenv(var, raising=False)
    bench = _bench()
    monkeypatch.setattr(bench, "CHUNK_STEPS", 7)  # several turns even on a short slice
    out = bench.run_round(("plain", "off", "recording"), str(tmp_path / "unused.sock"), demo_workload(seed=0)[:24])
    assert set(out) == {"plain", "off", "recording"}
    (_, plain_cpu, plain_events, _), (_, off_cpu, off_events, _), (_, rec_cpu, rec_events, _) = (
        out["plain"], out["off"], out["recording"])
    assert plain_events == 0 and off_events == 0  # nothing of KVFabric in these engines
    assert rec_events > 24  # the recording engine's hook made records for every request
    assert min(plain_cpu, off_cpu, rec_cpu) > 0


def test_bytecode_counts_are_exact_and_put_kvfabrics_where_the_mode_asks(tmp_path: Path) -> None:
    """benchmarks/bench_hook_bytecode.py on a short run: the same mode counted twice gives the same numbers but for
    the hand-overs, which follow the clock (the point of counting instead of timing), plain executes no KVFabric
    code, and steering adds to recording's."""
    import json
    import subprocess
    import sys

    def counts(modes: str, out: Path) -> dict:
        proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_hook_bytecode.py"), "--modes", modes,
                               "--steps", "120", "--out", str(out)], capture_output=True, text=True, timeout=600,
                              cwd=ROOT, check=False)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    first = counts("plain,recording,adaptive_aging", tmp_path / "a.md")
    again = counts("recording", tmp_path / "b.md")
    assert abs(again["recording_opcodes"] - first["recording_opcodes"]) <= 0.001 * first["recording_opcodes"]
    assert first["plain_kvfabric_opcodes"] == 0
    assert 0 < first["recording_kvfabric_opcodes"] < first["adaptive_aging_kvfabric_opcodes"]
    assert first["plain_opcodes"] < first["recording_opcodes"] < first["adaptive_aging_opcodes"]
    assert "| adaptive_aging | 120 |" in (tmp_path / "a.md").read_text()


def test_call_timings_cover_each_entry_point_in_place_and_time_warm_and_cold(tmp_path: Path) -> None:
    """benchmarks/bench_hook_calls.py on a short run: every entry point it times was called in the run (the
    timers sit where vLLM's calls go), and the warm and cold repeats ran on the run's final state (what the
    medians are, the script's results say: timings are not asserted)."""
    import json
    import subprocess
    import sys

    out = tmp_path / "calls.md"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_hook_calls.py"), "--steps", "4000",
                           "--samples", "20", "--out", str(out)], capture_output=True, text=True, timeout=600,
                          cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["steps"] == 4000 and got["samples"] == 20
    for entry in ("free_record", "touch_record", "allocation_record", "free_list_popleft_n_1",
                  "free_list_popleft_n_many", "victim_index_pop", "policy_on_evicted_one_block"):
        assert got[f"{entry}_calls"] > 0 and got[f"{entry}_in_place_us"] > 0, entry
    assert "seal_record_calls" not in got  # adaptive_aging's keeper follows no sealing (StatisticsKeeper.sealless)
    # vLLM's get_new_blocks calls popleft_n once and is recorded once (an allocation record).
    assert got["free_list_popleft_n_1_calls"] + got["free_list_popleft_n_many_calls"] <= got["allocation_record_calls"]
    for entry in ("victim_index_pop", "policy_on_evicted_one_block"):
        assert got[f"{entry}_warm_us"] > 0 and got[f"{entry}_cold_us"] > 0
    assert "| `allocation record (keeper)` |" in out.read_text()


def test_a_target_is_judged_on_every_rounds_ratio() -> None:
    """Met only when every round's ratio is at or under the target, not met only when every one is over it: one
    round on the other side leaves the run undecided (the min-max interval of n rounds covers their median with
    probability 1 - 2 * 0.5**n)."""
    bench = _bench()
    assert bench.verdict([1.04, 1.05, 1.03], 1.05) == "met"
    assert bench.verdict([1.11, 1.12, 1.101], 1.10) == "not met"
    assert bench.verdict([1.09, 1.12, 1.13], 1.10) == "undecided"
    assert bench.coverage(5) == pytest.approx(0.9375) and bench.coverage(10) == pytest.approx(0.998046875)
    assert set(bench.TARGETS) <= set(bench.MODES)
