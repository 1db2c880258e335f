"""The hook inside vLLM's real Scheduler on CPU: installed through the real plugin path, and in ``lru`` mode it
changes no scheduling decision while its events agree with vLLM's own view."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from vllm.v1.core.sched.scheduler import Scheduler

from kvfabric.contract import schema as S
from kvfabric.engine.plugin import wrap_scheduler_class
from kvfabric.sim.harness import SimulatedEngine
from kvfabric.sim.workload import demo_workload

pytestmark = pytest.mark.vllm

NUM_BLOCKS = 200  # small: the workload below evicts, preempts and rebuilds


def small_workload() -> list[Any]:
    # Compressed arrivals and long answers on a small pool: vLLM evicts, rebuilds *and* preempts (about 50
    # preemptions at 200 blocks with the H200-calibrated latency model), so every path the hook wraps is taken.
    return demo_workload(seed=3, duration_s=0.5, template_requests=50, num_conversations=5, unique_requests=15,
                         unique_prompt_tokens=(200, 600), first_turn_tokens=(100, 300), max_tokens=(100, 300))


def run_engine(monkeypatch: pytest.MonkeyPatch, hooked: bool, log: Path | None = None) -> tuple[SimulatedEngine, Any]:
    wrap_scheduler_class(Scheduler)  # what the plugin's register() does when KVFabric is on (idempotent)
    for var in ("KVFABRIC_LIFECYCLE", "KVFABRIC_SINK", "KVFABRIC_EVICTION_POLICY", "KVFABRIC_LIFECYCLE_LOG_PATH"):
        monkeypatch.delenv(var, raising=False)
    if hooked:
        assert log is not None
        monkeypatch.setenv("KVFABRIC_LIFECYCLE", "1")
        monkeypatch.setenv("KVFABRIC_SINK", f"jsonl://{log}")
        monkeypatch.setenv("KVFABRIC_RUN_ID", "equivalence")
    engine = SimulatedEngine.create(NUM_BLOCKS, "qwen", record_steps=True, max_num_batched_tokens=4096)
    installation = getattr(engine.scheduler, "_kvfabric", None)
    assert (installation is not None) == hooked
    engine.add_workload(small_workload())
    engine.run_until_done(max_steps=100_000)
    if installation is not None:
        installation.close()
    return engine, installation


def decisions(engine: SimulatedEngine) -> list[tuple]:
    assert engine.steps is not None
    return [(s.num_scheduled_tokens, s.num_prefill_tokens, tuple(s.admitted), tuple(s.finished),
             tuple(s.preempted)) for s in engine.steps]


def test_lru_hook_changes_no_decision_and_events_match_vllm(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    plain, _ = run_engine(monkeypatch, hooked=False)
    log = tmp_path / "events.jsonl"
    hooked, inst = run_engine(monkeypatch, hooked=True, log=log)

    # Identical scheduling, step by step, and identical final cache state.
    assert decisions(hooked) == decisions(plain)
    pool_a, pool_b = plain.block_pool, hooked.block_pool
    assert [b.block_id for b in pool_b.free_block_queue.get_all_free_blocks()] == [
        b.block_id for b in pool_a.free_block_queue.get_all_free_blocks()
    ]
    assert [b.ref_cnt for b in pool_b.blocks] == [b.ref_cnt for b in pool_a.blocks]
    assert [b.block_hash for b in pool_b.blocks] == [b.block_hash for b in pool_a.blocks]
    for key in ("admissions", "admitted_hit_tokens", "evicted_blocks", "rebuilt_blocks", "preemptions", "steps",
                "output_tokens"):
        assert getattr(hooked.stats, key) == getattr(plain.stats, key), key
    # The workload is sized to exercise every path the equivalence must cover: evictions and preemptions.
    assert plain.stats.evicted_blocks > 0 and plain.stats.preemptions > 0

    # The events agree with what vLLM itself observed (its metrics-collector seam, independent of the hook).
    lines = log.read_text().splitlines()
    meta = json.loads(lines[0])["kvfabric_stream"]
    assert meta[S.META_POLICY] == "lru" and meta[S.META_NUM_BLOCKS] == str(NUM_BLOCKS)
    events = [json.loads(x) for x in lines[1:]]
    kinds = Counter(e["event"] for e in events)
    assert kinds[S.BLOCK_EVICTED] == hooked.stats.evicted_blocks
    assert kinds[S.PREFIX_LOOKUP] == hooked.stats.admissions
    assert sum(e["hit_tokens"] for e in events if e["event"] == S.PREFIX_LOOKUP) == hooked.stats.admitted_hit_tokens
    assert kinds[S.BLOCK_REBUILT] > 0
    assert sum(1 for e in events if e["event"] == S.BLOCK_EVICTED and e["share_degree"] >= 2) > 0
    outlet = inst.outlet
    assert outlet.lost_events == 0 and outlet.expanded_events == outlet.delivered_events == len(events)
    assert {e["step"] for e in events} <= set(range(1, hooked.stats.steps + 1))
    # Every eviction names a block that was sealed before, with the same digest.
    sealed = {e["block_hash"] for e in events if e["event"] == S.BLOCK_SEALED}
    assert all(e["block_hash"] in sealed for e in events if e["event"] == S.BLOCK_EVICTED)


_PROBE = textwrap.dedent(
    """
    import json, sys
    from kvfabric.sim.harness import build_scheduler
    s = build_scheduler(64)
    inst = getattr(s, "_kvfabric", None)
    pool = s.kv_cache_manager.block_pool
    print(json.dumps({"installed": inst is not None, "pool": type(pool).__name__,
                      "hooked": getattr(pool.get_new_blocks, "__name__", "") == "kvfabric_get_new_blocks",
                      "wrapped": hasattr(type(s).__init__, "__kvfabric_original__")}))
    """
)


@pytest.mark.parametrize("enabled", [True, False])
def test_entry_point_installs_only_when_asked(enabled: bool, tmp_path: Path) -> None:
    """A fresh process: vLLM's load_general_plugins finds the entry point; without KVFABRIC_* nothing is touched."""
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFABRIC_")}
    if enabled:
        env |= {"KVFABRIC_LIFECYCLE": "1", "KVFABRIC_SINK": f"jsonl://{tmp_path / 'e.jsonl'}"}
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    # The pool keeps vLLM's class either way (the hook wraps this instance's methods, docs/design.md §3).
    assert result == {"installed": enabled, "pool": "BlockPool", "hooked": enabled, "wrapped": enabled}
