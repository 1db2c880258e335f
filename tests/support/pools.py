"""vLLM's real KV-cache manager with the hook installed, and traffic for it: :func:`make_manager` (a pool of
``num_blocks`` under ``policy``, events made and dropped), :func:`make_request`, :func:`admit`, :func:`traffic`
(requests of three families that evict and rebuild). Shared by ``tests/engine/`` (``test_steering.py``,
``test_policy_reads.py``) and ``tests/forwarder/`` (``test_forwarder.py``, ``test_sink_failures.py``): a test module
imports kits, never another test module. Imports vLLM and torch: only tests marked ``vllm`` import it.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request

from kvfabric.engine.config import load_hook_settings
from kvfabric.engine.install import Installation, build_hook
from kvfabric.engine.steering.victims import Steering
from kvfabric.policies import POLICY_NAMES

__all__ = ["BLOCK", "LIVE_POLICIES", "admit", "bare_manager", "make_manager", "make_request", "traffic"]

BLOCK = 16
LIVE_POLICIES = [p for p in POLICY_NAMES if p != "lru"]  # lru attaches nothing, so it keeps no statistics


def bare_manager(num_blocks: int, max_model_len: int = 4096) -> KVCacheManager:
    """vLLM's real KV-cache manager over ``num_blocks`` blocks of :data:`BLOCK` tokens, prefix caching on, no hook."""
    init_none_hash(sha256)
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1,
                                                          dtype=torch.float32))
        ],
    )
    return KVCacheManager(config, max_model_len=max_model_len, scheduler_block_size=BLOCK, enable_caching=True,
                          hash_block_size=BLOCK)


def make_manager(num_blocks: int, policy: str, anchor: int | None = 0, *,
                 native: bool = True) -> tuple[KVCacheManager, Installation, Steering | None]:
    manager = bare_manager(num_blocks)
    env = {"KVFABRIC_LIFECYCLE": "1", "KVFABRIC_SINK": "none", "KVFABRIC_EVICTION_POLICY": policy,
           "KVFABRIC_NATIVE": "1" if native else "0"}
    if anchor is not None:
        env["KVFABRIC_ADMISSION_ANCHOR_BLOCKS"] = str(anchor)
    hook_settings = load_hook_settings(env)
    inst = build_hook(manager, hook_settings, block_size=BLOCK, engine="test", outlet="local")
    assert inst is not None
    assert (inst.steering is not None) == hook_settings.steers
    return manager, inst, inst.steering


def make_request(rid: str, tokens: list[int], extra: dict[str, Any] | None = None) -> Request:
    params = SamplingParams(max_tokens=4, extra_args=extra)
    params.update_from_generation_config({}, eos_token_id=100)
    return Request(request_id=rid, prompt_token_ids=tokens, sampling_params=params, pooling_params=None,
                   block_hasher=get_request_block_hasher(BLOCK, sha256))


def admit(manager: KVCacheManager, req: Request) -> list[int] | None:
    computed, num_computed = manager.get_computed_blocks(req, req.num_tokens - 1)[:2]
    blocks = manager.allocate_slots(req, req.num_tokens - num_computed, num_computed, computed)
    return None if blocks is None else blocks.get_block_ids()[0]


def traffic(manager: KVCacheManager, inst: Installation, n: int, start: int = 0) -> None:
    """Requests of three families with private tails; the pool is small, so they evict and rebuild."""
    for i in range(start, start + n):
        tokens = [1 + i % 3] * 48 + [100 + i] * (20 + i % 40)
        params = SamplingParams(max_tokens=2)
        params.update_from_generation_config({}, eos_token_id=100_000)
        req = Request(request_id=f"q{i}", prompt_token_ids=tokens, sampling_params=params, pooling_params=None,
                      block_hasher=get_request_block_hasher(BLOCK, sha256))
        computed, hit = manager.get_computed_blocks(req, req.num_tokens - 1)[:2]
        assert manager.allocate_slots(req, req.num_tokens - hit, hit, computed) is not None
        manager.free(req)
        inst.flush()  # once per request here; once per step inside vLLM
