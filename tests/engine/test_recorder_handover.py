"""The exact-signature wrapper (kvfabric/engine/signature.py) and the recorder's hand-over rules
(kvfabric/engine/recorder.py).

The wrapper must hand vLLM the call it was given, whatever the parameter kinds; the recorder must hand records
over when a request ends, when HANDOVER_RECORDS wait and once HANDOVER_S has passed, and not at every record.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Any

import pytest

from kvfabric.engine import install as I
from kvfabric.engine import recorder as R_
from kvfabric.engine import signature
from kvfabric.engine.handover import Outlet


class _Calls:
    """A stand-in for a vLLM method with every kind of parameter; records what it was called with."""

    def __init__(self) -> None:
        self.seen: list[tuple[Any, ...]] = []

    def method(self, request: Any, n: int, /, hit: int = 0, blocks: Any = None, *rest: Any, lookahead: int = 0,
               **extra: Any) -> tuple[Any, ...]:
        call = (request.request_id, n, hit, blocks, rest, lookahead, extra)
        self.seen.append(call)
        return call


class _Context:
    rid: str | None = None


def _request(rid: str, computed: int) -> Any:
    return SimpleNamespace(request_id=rid, num_computed_tokens=computed)


def test_the_wrapper_has_the_original_signature_and_forwards_every_argument() -> None:
    calls = _Calls()
    ctx = _Context()
    seen_rid: list[str | None] = []
    slow_calls: list[tuple[Any, ...]] = []

    original = calls.method

    def observing(*args: Any, **kwargs: Any) -> Any:
        seen_rid.append(ctx.rid)
        return original(*args, **kwargs)

    observing.__signature__ = inspect.signature(original)  # type: ignore[attr-defined]

    def slow(request: Any, *args: Any, **kwargs: Any) -> Any:
        slow_calls.append((request.request_id, args, kwargs))
        return original(request, *args, **kwargs)

    wrapped = signature.request_context_wrapper(observing, ctx, slow, "kvfabric_method")
    assert wrapped.__name__ == "kvfabric_method" and wrapped.__code__.co_filename == "<string>"  # generated
    assert inspect.signature(wrapped) == inspect.signature(original)

    running = _request("r1", 32)
    direct = _Calls().method
    for args, kwargs in [((16,), {}), ((16, 3), {}), ((16, 3, "b", "x", "y"), {"lookahead": 2, "z": 1}),
                         ((16,), {"blocks": "b", "hit": 5})]:
        assert wrapped(running, *args, **kwargs) == direct(running, *args, **kwargs)
    assert seen_rid == ["r1"] * 4 and ctx.rid is None  # the context holds only for the call
    assert slow_calls == []

    fresh = _request("r2", 0)
    assert wrapped(fresh, 16, hit=32) == direct(fresh, 16, hit=32)
    assert slow_calls == [("r2", (16, 32, None), {"lookahead": 0})]  # same values, by position or keyword


def test_an_unreadable_signature_falls_back_to_the_generic_wrapper() -> None:
    ctx = _Context()
    wrapped = signature.request_context_wrapper(print, ctx, print, "kvfabric_print")
    assert wrapped.__code__.co_filename != "<string>"  # not generated: print has no readable Python signature
    with pytest.raises(AttributeError):
        wrapped(object())  # the generic wrapper still reads the request's fields


def test_argument_reader_finds_a_parameter_by_position_keyword_or_default() -> None:
    read = signature.argument_reader(_Calls().method, "hit")
    assert read(None, 16) == 0
    assert read(None, 16, 7) == 7
    assert read(None, 16, hit=9) == 9
    assert signature.argument_reader(_Calls().method, "absent", 42)(None, 16, 7) == 42


class _Counting(Outlet):
    def __init__(self) -> None:
        super().__init__()
        self.puts: list[int] = []

    def put(self, records: list[tuple]) -> None:
        super().put(records)
        self.puts.append(len(records))


def _recorder(outlet: _Counting) -> R_.Recorder:
    from kvfabric.engine.config import load_hook_settings

    r = R_.Recorder(load_hook_settings({"KVFABRIC_LIFECYCLE": "1", "KVFABRIC_SINK": "none"}), True, 16)
    inst = I.Installation(r, outlet, {}, 64, 16)
    r.handover = inst.flush
    return r


def test_records_are_handed_over_in_batches_not_one_by_one(monkeypatch: pytest.MonkeyPatch) -> None:
    outlet = _Counting()
    r = _recorder(outlet)
    clock = [100.0]
    monkeypatch.setattr(R_.time, "monotonic", lambda: clock[0])
    r.add((99, "first"))  # the first record finds the deadline passed (nothing handed over yet)
    assert outlet.puts == [1]
    for i in range(10):
        r.add((99, i))
    assert outlet.puts == [1]  # within HANDOVER_S: they wait
    clock[0] += R_.HANDOVER_S
    r.add((99, "late"))
    assert outlet.puts == [1, 11]


def test_a_full_batch_goes_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    outlet = _Counting()
    r = _recorder(outlet)
    monkeypatch.setattr(R_, "HANDOVER_RECORDS", 5)
    monkeypatch.setattr(R_.time, "monotonic", lambda: 100.0)
    r.handover_at = 1e9
    for i in range(12):
        r.add((99, i))
    assert outlet.puts == [5, 5]
    assert len(r.log or []) == 2


@pytest.mark.vllm
def test_a_request_end_hands_its_records_over_on_vllms_manager(monkeypatch: pytest.MonkeyPatch) -> None:
    """On vLLM's real KVCacheManager with time frozen: the admission's first record goes at once (nothing was
    handed over yet), the rest wait, and ``free`` (the request's end) hands them all over, so an engine that
    goes idle after its last request holds nothing back."""
    import torch
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from kvfabric.contract import records as R
    from kvfabric.engine.config import load_hook_settings
    from kvfabric.sim.harness import make_request

    monkeypatch.setattr(R_.time, "monotonic", lambda: 100.0)
    cfg = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["l"], FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=1, dtype=torch.float32))])
    manager = KVCacheManager(cfg, max_model_len=8192, scheduler_block_size=16, enable_caching=True,
                             hash_block_size=16)
    outlet = _Counting()
    inst = I.build_hook(manager, load_hook_settings({"KVFABRIC_LIFECYCLE": "1", "KVFABRIC_SINK": "none"}),
                        block_size=16, outlet=outlet)
    assert inst is not None
    req = make_request("r0", list(range(70)), 1)
    computed, hit, _ = manager.get_computed_blocks(req)
    assert manager.allocate_slots(req, 70 - hit, hit, computed) is not None
    assert outlet.puts == [1]  # LOOKUP went at once; ALLOCATED, SEALED, ADMITTED wait
    assert [rec[0] for rec in inst.recorder.log or []] == [R.ALLOCATED, R.SEALED, R.ADMITTED]
    manager.free(req)
    assert outlet.puts == [1, 5] and not inst.recorder.log  # ... + FREED, DONE: everything went


@pytest.mark.vllm
def test_on_vllms_scheduler_only_the_last_request_end_forces_a_hand_over(monkeypatch: pytest.MonkeyPatch) -> None:
    """Time frozen, four requests of different lengths at once on vLLM's real Scheduler: the first record goes at
    once, the three requests that end while others run hold nothing up, and the last one's end hands everything
    over (an engine about to idle keeps nothing back)."""
    from kvfabric.engine.config import load_hook_settings
    from kvfabric.sim.harness import SimulatedEngine

    monkeypatch.setattr(R_.time, "monotonic", lambda: 100.0)
    engine = SimulatedEngine.create(64, "zero", track_evictions=False, load_plugins=False)
    outlet = _Counting()
    inst = I.build_hook(engine.scheduler.kv_cache_manager,
                        load_hook_settings({"KVFABRIC_LIFECYCLE": "1", "KVFABRIC_SINK": "none"}),
                        scheduler=engine.scheduler, outlet=outlet)
    assert inst is not None
    engine.add_workload([(0.0, f"r{i}", [i + 1] * (40 + 16 * i), 4 + 3 * i, None) for i in range(4)])
    engine.run_until_done()
    assert engine.stats.requests_finished == 4
    assert len(outlet.puts) == 2 and outlet.puts[0] == 1  # the first record, then everything at the last end
    assert not inst.recorder.log and outlet.records > 20


@pytest.mark.vllm
def test_a_pool_without_unpin_blocks_is_hooked_as_on_vllm_0_26() -> None:
    """vLLM 0.26's BlockPool has no ``unpin_blocks`` (0.33's has): the hook installs without wrapping it and still
    records, instead of failing to install (an H200 run on 0.26 once went unhooked for this reason)."""
    import torch
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from kvfabric.engine.config import load_hook_settings
    from kvfabric.sim.harness import make_request

    class PoolOf026(BlockPool):
        @property
        def unpin_blocks(self) -> Any:
            raise AttributeError("unpin_blocks")

    cfg = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["l"], FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=1, dtype=torch.float32))])
    manager = KVCacheManager(cfg, max_model_len=8192, scheduler_block_size=16, enable_caching=True,
                             hash_block_size=16)
    manager.block_pool.__class__ = PoolOf026
    assert not hasattr(manager.block_pool, "unpin_blocks")
    outlet = _Counting()
    inst = I.build_hook(manager, load_hook_settings({"KVFABRIC_LIFECYCLE": "1", "KVFABRIC_SINK": "none"}),
                        block_size=16, outlet=outlet)
    assert inst is not None and manager.block_pool.get_new_blocks.__name__ == "kvfabric_get_new_blocks"
    req = make_request("r0", list(range(40)), 1)
    computed, hit, _ = manager.get_computed_blocks(req)
    assert manager.allocate_slots(req, 40 - hit, hit, computed) is not None
    manager.free(req)
    assert outlet.records == 6 and inst.recorder.on  # LOOKUP, ALLOCATED, SEALED, ADMITTED, FREED, DONE
