"""A failure anywhere in KVFabric never reaches vLLM: injected into every recording path, every policy callback,
the victim index, the admission gate, the cache-aware hold and the hand-over to the outlet, vLLM's real Scheduler
finishes the same workload, every request completes, the pool's invariants hold, and the failure is counted.

Where KVFabric only observes (``lru``), the scheduler's decisions are also identical step by step to a run without
it: a broken recorder turns itself off and vLLM carries on as if it had never been there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kvfabric.contract import records as R
from kvfabric.engine.config import load_hook_settings
from kvfabric.engine.install import Installation, build_hook
from kvfabric.engine.recorder import Recorder
from kvfabric.sim.harness import SimulatedEngine, build_scheduler
from kvfabric.sim.workload import demo_workload

pytestmark = pytest.mark.vllm
NUM_BLOCKS = 160


def workload() -> list[Any]:
    return demo_workload(seed=5, duration_s=0.5, template_requests=24, num_conversations=3, unique_requests=8,
                         unique_prompt_tokens=(200, 500), first_turn_tokens=(100, 300), max_tokens=(40, 120))


def run(env: dict[str, str] | None, inject: Callable[[Installation], None] | None = None,
        ) -> tuple[SimulatedEngine, Installation | None]:
    scheduler = build_scheduler(NUM_BLOCKS, max_num_batched_tokens=4096, load_plugins=False)
    inst = None
    if env is not None:
        inst = build_hook(scheduler.kv_cache_manager, load_hook_settings(env), scheduler=scheduler, engine="t",
                          outlet="local")
        assert inst is not None
        if inject is not None:
            inject(inst)
    engine = SimulatedEngine(scheduler, "qwen", record_steps=True)
    items = workload()
    engine.add_workload(items)
    while engine.has_unfinished():
        engine.step()
        if inst is not None:
            inst.drain()
    assert engine.stats.requests_finished == len(items)
    assert engine.stats.output_tokens == sum(it[3] for it in items)
    pool = engine.block_pool
    assert pool.free_block_queue.num_free_blocks == sum(1 for b in pool.blocks if not b.is_null and b.ref_cnt == 0)
    return engine, inst


def decisions(engine: SimulatedEngine) -> list[tuple]:
    assert engine.steps is not None
    return [(s.num_scheduled_tokens, tuple(s.admitted), tuple(s.finished), tuple(s.preempted)) for s in engine.steps]


def _failing_recorder(op: int) -> type[Recorder]:
    """A Recorder whose ``add`` raises for records of one kind (swapped in as the instance's class)."""

    class Failing(Recorder):
        __slots__ = ()

        def add(self, record: tuple) -> None:
            if record[0] == op:
                raise RuntimeError(f"injected failure on record {op}")
            Recorder.add(self, record)

    return Failing


RECORDING_PATHS = {
    "lookup": R.LOOKUP, "admitted": R.ADMITTED, "allocated": R.ALLOCATED, "touched": R.TOUCHED,
    "freed": R.FREED, "sealed": R.SEALED, "done": R.DONE,
}


@pytest.fixture(scope="module")
def plain() -> SimulatedEngine:
    engine, _ = run(None)
    assert engine.stats.evicted_blocks > 0 and engine.stats.preemptions > 0  # every path is exercised
    return engine


@pytest.mark.parametrize("path", sorted(RECORDING_PATHS))
def test_a_failing_recording_path_turns_kvfabric_off_and_changes_nothing(plain: SimulatedEngine, path: str) -> None:
    def inject(inst: Installation) -> None:
        inst.recorder.__class__ = _failing_recorder(RECORDING_PATHS[path])

    engine, inst = run({"KVFABRIC_LIFECYCLE": "1"}, inject)
    assert inst is not None and inst.recorder.errors == 1 and not inst.recorder.on
    assert decisions(engine) == decisions(plain)


def test_a_failing_hand_over_turns_kvfabric_off_and_changes_nothing(plain: SimulatedEngine) -> None:
    def inject(inst: Installation) -> None:
        def broken(records: list[tuple]) -> None:
            raise OSError("injected: the outlet is gone")

        inst.outlet.put = broken  # type: ignore[method-assign]

    engine, inst = run({"KVFABRIC_LIFECYCLE": "1"}, inject)
    assert inst is not None and inst.flush_errors >= 1 and not inst.recorder.on
    assert decisions(engine) == decisions(plain)


def _break_policy(method: str) -> Callable[[Installation], None]:
    def inject(inst: Installation) -> None:
        policy = inst.steering.policy  # type: ignore[union-attr]

        def broken(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f"injected failure in {method}")

        setattr(policy, method, broken)
        if method == "on_evicted_all":
            inst.steering.on_evicted = broken  # type: ignore[union-attr]  # bound when steering attached

    return inject


def _break_index(method: str) -> Callable[[Installation], None]:
    def inject(inst: Installation) -> None:
        def broken(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f"injected failure in index.{method}")

        setattr(inst.steering.index, method, broken)  # type: ignore[union-attr]

    return inject


@pytest.mark.parametrize("where", [  # what the hook calls: the per-call forms (keys, report, add_many, pop_n ...)
    "keys", "report", "on_request_started", "on_evicted_all",
    "index.add_many", "index.pop_n", "index.discard_all",
])
def test_a_failing_policy_or_index_falls_back_to_vllms_order(where: str) -> None:
    inject = _break_index(where[6:]) if where.startswith("index.") else _break_policy(where)
    engine, inst = run({"KVFABRIC_LIFECYCLE": "1", "KVFABRIC_EVICTION_POLICY": "adaptive_aging"}, inject)
    assert inst is not None and inst.steering is not None
    assert inst.steering.errors >= 1  # counted (and logged once)
    assert engine.stats.evicted_blocks > 0


def test_a_failing_admission_gate_leaves_vllms_mask() -> None:
    def inject(inst: Installation) -> None:
        def broken(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("injected failure in the gate")

        inst.steering.gate.decide = broken  # type: ignore[union-attr, method-assign]

    _engine, inst = run({"KVFABRIC_LIFECYCLE": "1", "KVFABRIC_ADMISSION_ANCHOR_BLOCKS": "2"}, inject)
    assert inst is not None and inst.steering is not None and inst.steering.gate is not None
    assert inst.steering.gate.limited_blocks == 0  # nothing was narrowed: vLLM's own mask stood every time
    assert inst.recorder.on  # the gate's failure is its own; recording carries on


def test_a_failing_cache_aware_hold_releases_every_request() -> None:
    def inject(inst: Installation) -> None:
        def broken(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("injected failure in the hold")

        inst.steering.hold.should_hold = broken  # type: ignore[union-attr, method-assign]

    _engine, inst = run({"KVFABRIC_CACHE_AWARE_SCHEDULING": "1"}, inject)
    assert inst is not None and inst.steering is not None and inst.steering.hold is not None
    assert inst.steering.hold.errors >= 1 and inst.steering.hold.held_steps == 0
