"""Every event says where it comes from (``host``, ``dp_rank``) and whose it is (``tenant``: vLLM's ``cache_salt``;
``lora``: the LoRA adapter's name), docs/design.md §4.

vLLM's real Scheduler on CPU, built with a LoRA config and as data-parallel rank 1, runs requests of two tenants,
one LoRA adapter and neither; the rows the hook's records expand into carry the right four columns, and the
collector's validation and writer store them (with the stream's host and rank in ``streams``).
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from kvfabric.contract import schema as S
from kvfabric.engine.config import load_hook_settings
from kvfabric.engine.install import Installation, build_hook, dp_rank_of, engine_id, host_name
from kvfabric.forwarder.sinks import rows_to_batch
from kvfabric.ingest.metrics import CollectorMetrics
from kvfabric.ingest.queue import BatchQueue, BatchReceived, StreamOpened
from kvfabric.ingest.store import open_database
from kvfabric.ingest.validate import BatchLimits, check_batch, parse_stream_meta
from kvfabric.ingest.writer import EventWriter
from kvfabric.sim.harness import SimulatedEngine, resolve_model_dir

pytestmark = pytest.mark.vllm

BLOCK = 16
NUM_BLOCKS = 128
PROMPT = list(range(1000, 1000 + 4 * BLOCK + 5))  # four full blocks and a partial one
OTHER = list(range(5000, 5000 + 3 * BLOCK + 2))


def scheduler(dense: bool) -> Any:
    """vLLM's Scheduler with LoRA enabled, as data-parallel rank 1 of 2. ``dense``: as vLLM's EngineCore runs a dense
    model's ranks, each an independent engine (``data_parallel_rank`` reset to 0, ``data_parallel_index`` kept)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        LoRAConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    cache_config = CacheConfig(block_size=BLOCK, enable_prefix_caching=True)
    vllm_config = VllmConfig(
        model_config=ModelConfig(model=resolve_model_dir(None), skip_tokenizer_init=True, max_model_len=1024),
        cache_config=cache_config,
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1024, max_model_len=1024,
                                         is_encoder_decoder=False, enable_chunked_prefill=True,
                                         async_scheduling=False),
        device_config=DeviceConfig(device="cpu"),
        lora_config=LoRAConfig(max_loras=2, max_lora_rank=8),
        parallel_config=ParallelConfig(data_parallel_size=2, data_parallel_rank=1),
    )
    if dense:
        vllm_config.parallel_config.reconfigure_for_independent_dp_rank()
        assert vllm_config.parallel_config.data_parallel_rank == 0
    cache_config.num_gpu_blocks = NUM_BLOCKS
    kv_cache_config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1,
                                                      dtype=torch.float32))])
    return Scheduler(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                     structured_output_manager=StructuredOutputManager(vllm_config), block_size=BLOCK, log_stats=True)


def request(rid: str, tokens: list[int], *, salt: str | None = None, lora: str | None = None) -> Any:
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    return Request(request_id=rid, prompt_token_ids=tokens,
                   sampling_params=SamplingParams(max_tokens=3, ignore_eos=True, detokenize=False),
                   pooling_params=None, cache_salt=salt,
                   lora_request=None if lora is None else LoRARequest(lora, 1, "/adapters/" + lora),
                   block_hasher=get_request_block_hasher(BLOCK, sha256))


# request id -> (tenant, lora)
OWNERS: dict[str, tuple[str | None, str | None]] = {
    "t1-a": ("tenant-1", None), "lora-a": (None, "adapter-x"), "plain": (None, None),  # first wave
    "t1-b": ("tenant-1", None), "t2-a": ("tenant-2", None), "lora-b": (None, "adapter-x"),  # second wave
}


def run(dense: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[Installation, list[dict[str, Any]]]:
    monkeypatch.delenv("KVFABRIC_ENGINE_ID", raising=False)
    sched = scheduler(dense)
    settings = load_hook_settings({"KVFABRIC_LIFECYCLE": "1", "KVFABRIC_SINK": "none", "KVFABRIC_HOST": "node-a"})
    # (what the plugin's install() does, with an in-process outlet to read the rows back)
    inst = build_hook(sched.kv_cache_manager, settings, scheduler=sched, outlet="local",
                      engine=engine_id(sched, settings.engine_id, host_name(settings.host)))
    assert inst is not None
    engine = SimulatedEngine(sched, "qwen")
    waves = [[request("t1-a", PROMPT, salt="tenant-1"), request("lora-a", OTHER, lora="adapter-x"),
              request("plain", OTHER)],
             # the same prompts again: t1-b and lora-b hit their own tenant's and adapter's blocks; t2-a, with
             # t1-a's prompt but another salt, hits nothing
             [request("t1-b", PROMPT, salt="tenant-1"), request("t2-a", PROMPT, salt="tenant-2"),
              request("lora-b", OTHER, lora="adapter-x")]]
    for wave in waves:
        for req in wave:
            engine.add_request(req)
        engine.run_until_done(max_steps=1000)
    assert inst.recorder.errors == 0 and inst.recorder.on
    rows = [dict(zip(S.EMIT_COLUMNS, row, strict=True)) for row in inst.drain()]
    return inst, rows


@pytest.mark.parametrize("dense", [False, True], ids=["moe-rank", "dense-rank"])
def test_rows_of_a_real_scheduler_say_host_rank_tenant_and_lora(dense: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    inst, rows = run(dense, monkeypatch)
    assert dp_rank_of(inst.recorder.stepper) == 1
    assert inst.metadata[S.META_HOST] == "node-a" and inst.metadata[S.META_DP_RANK] == "1"
    assert inst.metadata[S.META_ENGINE] == "node-a/dp1"
    assert rows and all(r["host"] == "node-a" and r["dp_rank"] == 1 for r in rows)

    lookups = {r["request_id"]: r for r in rows if r["event"] == S.PREFIX_LOOKUP}
    assert set(lookups) == set(OWNERS)
    for rid, owner in OWNERS.items():
        assert (lookups[rid]["tenant"], lookups[rid]["lora"]) == owner, rid
    # vLLM hashes the salt and the adapter: a tenant's (an adapter's) blocks serve only its own requests.
    assert lookups["t1-b"]["hit_tokens"] == 4 * BLOCK and lookups["t2-a"]["hit_tokens"] == 0
    assert lookups["lora-b"]["hit_tokens"] == 3 * BLOCK and lookups["plain"]["hit_tokens"] == 0

    # A block's content belongs to the request that sealed it: every row of that content says so, whichever
    # request touched, freed or evicted it.
    sealed_by: dict[int, tuple[str | None, str | None]] = {}
    for r in rows:
        if r["event"] == S.BLOCK_SEALED:
            sealed_by[r["block_hash"]] = OWNERS[r["request_id"]]
    by_content: defaultdict[int, set[tuple[str | None, str | None]]] = defaultdict(set)
    for r in rows:
        if r["block_hash"] is not None:
            by_content[r["block_hash"]].add((r["tenant"], r["lora"]))
    assert {h: seen for h, seen in by_content.items()} == {h: {sealed_by[h]} for h in by_content}
    touched = [r for r in rows if r["event"] == S.BLOCK_TOUCHED]
    assert {(r["request_id"], r["tenant"], r["lora"]) for r in touched} == {
        ("t1-b", "tenant-1", None), ("lora-b", None, "adapter-x")}
    # Rows of a request with no content of their own (allocations, the partial block's frees) are the request's.
    for r in rows:
        if r["request_id"] is not None and r["block_hash"] is None:
            assert (r["tenant"], r["lora"]) == OWNERS[r["request_id"]], r
    assert {r["tenant"] for r in rows} == {"tenant-1", "tenant-2", None}
    assert {r["lora"] for r in rows} == {"adapter-x", None}


def test_the_collector_stores_the_four_columns(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    inst, rows = run(False, monkeypatch)
    tuples = [tuple(r[c] for c in S.EMIT_COLUMNS) for r in rows]
    schema = S.stream_schema({**inst.metadata, S.META_STREAM_ID: "s1"})
    stream = parse_stream_meta(schema)
    assert (stream.host, stream.dp_rank) == ("node-a", 1)
    checked, info = check_batch(rows_to_batch(tuples, 0, schema), BatchLimits(), stream)
    con = open_database(str(tmp_path / "events.duckdb"))
    try:
        queue = BatchQueue(10**6, 1 << 30)
        writer = EventWriter(con, queue, CollectorMetrics())
        queue.put(StreamOpened(meta=stream, peer="test"))
        writer.start()
        queue.put(BatchReceived("s1", checked, info))
        assert writer.stop().clean
        stored = con.execute(
            "SELECT request_id, tenant, lora FROM events WHERE event = 'prefix_lookup' ORDER BY request_id").fetchall()
        assert stored == sorted((rid, *owner) for rid, owner in OWNERS.items())
        assert con.execute("SELECT DISTINCT host, dp_rank FROM events").fetchall() == [("node-a", 1)]
        assert con.execute("SELECT count(*) FROM events").fetchone() == (len(rows),)
        assert con.execute("SELECT host, dp_rank FROM streams").fetchall() == [("node-a", 1)]
    finally:
        con.close()
