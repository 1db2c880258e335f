"""The compiled pool hooks (kvfabric/engine/_recorder.c through compiled.Hook) against the Python ones they copy.

vLLM's real Scheduler runs one workload (preemptions and evictions included) with the hook built twice, compiled
and not (``KVFABRIC_NATIVE=0``): the records must be the same, field by field, timestamps aside, and vLLM's
decisions the same as without the hook. Direct calls on a real pool cover the argument shapes vLLM may use
(keywords, positions, a mask, an iterator), the slow path for every case the compiled hook leaves to Python, and
a failure while recording (counted, recording off, vLLM's result returned).
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from kvfabric.contract import records as R
from kvfabric.engine import compiled
from kvfabric.engine.config import load_hook_settings
from kvfabric.engine.install import Installation, build_hook
from kvfabric.engine.recorder import Recorder
from kvfabric.sim.harness import SimulatedEngine, build_scheduler
from kvfabric.sim.workload import demo_workload

pytestmark = pytest.mark.vllm
NUM_BLOCKS = 160
HOOKED = ("get_new_blocks", "touch", "free_blocks", "cache_full_blocks")


def hooked(native: bool, num_blocks: int = NUM_BLOCKS, policy: str = "lru") -> tuple[Any, Installation, list[tuple]]:
    """A real scheduler with the hook, its records collected at every hand-over (and at the end: :func:`rest`)."""
    scheduler = build_scheduler(num_blocks, max_num_batched_tokens=4096, load_plugins=False)
    settings = load_hook_settings({"KVFABRIC_LIFECYCLE": "1", "KVFABRIC_SINK": "none",
                                   "KVFABRIC_EVICTION_POLICY": policy, "KVFABRIC_NATIVE": "1" if native else "0"})
    inst = build_hook(scheduler.kv_cache_manager, settings, scheduler=scheduler, engine="t")
    assert inst is not None
    records: list[tuple] = []
    inst.recorder.handover = lambda: records.extend(inst.recorder.take())
    pool = scheduler.kv_cache_manager.block_pool
    assert all(isinstance(getattr(pool, n), compiled.Hook) == native for n in HOOKED)
    return scheduler, inst, records


def rest(inst: Installation, records: list[tuple]) -> list[tuple]:
    records.extend(inst.recorder.take())
    return records


UNTIMED = (R.CANCELLED, R.DONE, R.SCORED)  # (the records without a timestamp: records.py)


def untimed(records: list[tuple]) -> list[tuple]:
    """Records without their timestamps (field 1 of every record that has one)."""
    return [r if r[0] in UNTIMED else r[:1] + r[2:] for r in records]


def workload() -> list[Any]:
    return demo_workload(seed=5, duration_s=0.5, template_requests=24, num_conversations=3, unique_requests=8,
                         unique_prompt_tokens=(200, 500), first_turn_tokens=(100, 300), max_tokens=(40, 120))


def run(native: bool, policy: str) -> tuple[SimulatedEngine, list[tuple]]:
    scheduler, inst, records = hooked(native, policy=policy)
    engine = SimulatedEngine(scheduler, "qwen", record_steps=True)
    engine.add_workload(workload())
    while engine.has_unfinished():
        engine.step()
    assert inst.recorder.errors == 0 and inst.recorder.on
    return engine, rest(inst, records)


@pytest.mark.parametrize("policy", ["lru", "adaptive_aging"])
def test_compiled_hooks_record_what_the_python_hooks_record(policy: str) -> None:
    """With a policy, the steering keeper applies each record too (and the victim index is compiled or not)."""
    fast_engine, fast = run(native=True, policy=policy)
    slow_engine, slow = run(native=False, policy=policy)
    assert fast_engine.stats.evicted_blocks > 0 and fast_engine.stats.preemptions > 0  # every path is exercised
    kinds = {r[0] for r in fast}
    assert {R.ALLOCATED, R.TOUCHED, R.FREED, R.SEALED} <= kinds
    assert untimed(fast) == untimed(slow)
    assert [s.num_scheduled_tokens for s in fast_engine.steps or []] == [
        s.num_scheduled_tokens for s in slow_engine.steps or []]
    stamps = [r[1] for r in fast if r[0] not in UNTIMED]
    assert stamps == sorted(stamps)  # the wall clock, in call order


def pool_calls(native: bool) -> list[tuple]:
    """The same direct calls on a real pool, in every shape vLLM may use; the records they made."""
    scheduler, inst, records = hooked(native, num_blocks=20)
    pool = scheduler.kv_cache_manager.block_pool
    request = scheduler_request("p", [i // 16 for i in range(4 * 16)])
    blocks = pool.get_new_blocks(4)
    pool.cache_full_blocks(request=request, blocks=blocks, num_cached_blocks=0, num_full_blocks=2, block_size=16,
                           kv_cache_group_id=0, block_mask=None)  # vLLM 0.33's call: keywords
    pool.cache_full_blocks(request, blocks, 2, 3, 16, 0)  # positions, no mask
    pool.cache_full_blocks(request, blocks, 3, 4, 16, 0, block_mask=[False])  # a mask: read what vLLM stored
    pool.cache_full_blocks(request, blocks, 4, 4, 16, 0)  # nothing to cache: no record
    pool.touch(blocks[:2])
    pool.free_blocks(reversed(blocks))  # an iterator, read once
    pool.free_blocks(iter(blocks[:2]))
    more = pool.get_new_blocks(num_blocks=3)  # a keyword
    pool.free_blocks(more)
    assert inst.recorder.errors == 0
    return rest(inst, records)


def scheduler_request(rid: str, tokens: list[int]) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    params = SamplingParams(max_tokens=4)
    return Request(request_id=rid, prompt_token_ids=tokens, sampling_params=params, pooling_params=None,
                   block_hasher=get_request_block_hasher(16, sha256))


def test_every_call_shape_records_alike() -> None:
    fast, slow = pool_calls(native=True), pool_calls(native=False)
    assert untimed(fast) == untimed(slow)
    assert [r[0] for r in fast] == [R.ALLOCATED, R.SEALED, R.SEALED, R.SEALED, R.TOUCHED, R.FREED, R.FREED,
                                    R.ALLOCATED, R.FREED]
    masked = [r for r in fast if r[0] == R.SEALED][2]
    assert masked[8] == [None]  # (the masked block keeps no hash)


def test_calls_the_compiled_hook_is_not_sure_of_take_the_python_hook() -> None:
    scheduler, inst, records = hooked(native=True, num_blocks=20)
    pool = scheduler.kv_cache_manager.block_pool
    hook = pool.get_new_blocks
    assert hook.__wrapped__ == pool.__class__.get_new_blocks.__get__(pool) and callable(hook.slow)
    calls: list[str] = []

    class Watched(Recorder):
        __slots__ = ()

        def add(self, record: tuple) -> None:
            calls.append("add")
            Recorder.add(self, record)

    inst.recorder.__class__ = Watched  # (as the fault tests do): the compiled path must honour the override
    pool.get_new_blocks(1)
    assert calls == ["add"]
    inst.recorder.__class__ = Recorder
    pool.get_new_blocks(1)
    assert calls == ["add"]  # the compiled path appended this one itself
    assert [r[0] for r in rest(inst, records)] == [R.ALLOCATED, R.ALLOCATED]


def test_a_simulated_clock_stamps_every_record() -> None:
    """A replay's clock is not the wall clock the compiled path stamps with: its calls take the Python hooks."""
    scheduler = build_scheduler(20, load_plugins=False)
    settings = load_hook_settings({"KVFABRIC_LIFECYCLE": "1", "KVFABRIC_SINK": "none"})
    inst = build_hook(scheduler.kv_cache_manager, settings, scheduler=scheduler, engine="t", clock=lambda: 42)
    assert inst is not None
    records: list[tuple] = []
    inst.recorder.handover = lambda: records.extend(inst.recorder.take())
    pool = scheduler.kv_cache_manager.block_pool
    assert isinstance(pool.get_new_blocks, compiled.Hook)
    pool.free_blocks(pool.get_new_blocks(2))
    rest(inst, records)
    assert [r[0] for r in records] == [R.ALLOCATED, R.FREED] and {r[1] for r in records} == {42}


class _BrokenStepper:
    @property
    def current_step(self) -> int:
        raise RuntimeError("injected: no step")


@pytest.mark.parametrize("native", [True, False], ids=["compiled", "python"])
def test_a_failure_while_recording_is_counted_and_vllm_gets_its_blocks(native: bool,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    scheduler, inst, records = hooked(native, num_blocks=20)
    pool = scheduler.kv_cache_manager.block_pool
    inst.recorder.stepper = _BrokenStepper()
    with caplog.at_level(logging.ERROR, logger="kvfabric.engine"):
        blocks = pool.get_new_blocks(2)
    assert len(blocks) == 2 and all(b.ref_cnt == 1 for b in blocks)  # vLLM's result, unchanged
    assert inst.recorder.errors == 1 and not inst.recorder.on
    assert "recording an allocation failed" in caplog.text and "injected: no step" in caplog.text
    pool.free_blocks(blocks)  # recording is off: vLLM alone
    assert rest(inst, records) == [] and inst.recorder.errors == 1
    assert pool.get_num_free_blocks() == 19


def test_the_compiled_hooks_are_built_and_installed_unless_switched_off() -> None:
    """The install builds them (a compiler is on every machine this suite runs on); the hook installs them by
    default and ``KVFABRIC_NATIVE=0`` keeps the Python hooks (``hooked`` checks each pool method's type)."""
    assert compiled.BUILT
    for native in (True, False):
        hooked(native, num_blocks=8)


def test_vllms_own_errors_pass_through_unchanged() -> None:
    scheduler, inst, _ = hooked(native=True, num_blocks=20)
    pool = scheduler.kv_cache_manager.block_pool
    with pytest.raises(ValueError, match="Cannot get 50 free blocks"):
        pool.get_new_blocks(50)
    assert inst.recorder.errors == 0 and inst.recorder.on
