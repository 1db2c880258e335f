"""A vLLM model executor that fabricates outputs and spends the time a GPU would (``kvfabric sim-serve``).

vLLM's ``EngineCore`` talks to its model through an ``Executor`` (``vllm/v1/executor/abstract.py``): KV-cache
specs and memory at start-up, then ``execute_model`` + ``sample_tokens`` once per scheduler step. This class
answers those calls without a model and without a worker process, so everything above it (OpenAI server, AsyncLLM,
EngineCore, Scheduler, KVCacheManager, BlockPool and whatever a general plugin installs there) is vLLM's own code.
It is selected with ``--distributed-executor-backend kvfabric.sim.executor.SimulatedExecutor``.

Outputs follow the GPU model runner's rule (as :mod:`kvfabric.sim.harness` does): a request samples one token in a
step iff the step brings its computed tokens up to all its known tokens (prompt plus outputs so far); a partial
prefill chunk samples nothing. The executor counts each request's outputs itself (with async scheduling the
scheduler sends no token ids for running requests) and takes the scheduler's count when a preempted request
resumes (as a resumed cached request, or re-sent as new with all its tokens). Output number ``i`` of a request
is :func:`answer_token` ``(prompt digest, i)``: a pure function of the prompt, so the same workload gets the same
answers in every run and in every arm of an A/B.

Time: each step costs what a :class:`~kvfabric.sim.latency.LatencyModel` says it takes on an H200, times
``KVFABRIC_SIM_LATENCY_SCALE``. Steps run back to back on one simulated device: a step starts when it is
submitted or when the previous one ends, whichever is later, and its result is ready at its end. ``result()``
sleeps until then, so with async scheduling vLLM schedules step N+1 while step N "runs", as on a GPU.

Settings come from the environment (the EngineCore inherits it): ``KVFABRIC_SIM_LATENCY`` (a latency model name,
default ``llama``) and ``KVFABRIC_SIM_LATENCY_SCALE`` (default 1.0; 0 makes the model infinitely fast).
"""

from __future__ import annotations

import time
import zlib
from array import array
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.executor.abstract import Executor
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheSpec
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

from kvfabric import settings
from kvfabric.sim.harness import TOKEN_ID_HIGH, TOKEN_ID_LOW
from kvfabric.sim.latency import LatencyModel, StepWork, get_latency_model

__all__ = [
    "LATENCY_ENV",
    "LATENCY_SCALE_ENV",
    "SimulatedExecutor",
    "answer_token",
    "prompt_digest",
]

LATENCY_ENV = "KVFABRIC_SIM_LATENCY"
LATENCY_SCALE_ENV = "KVFABRIC_SIM_LATENCY_SCALE"


def prompt_digest(prompt_token_ids: list[int]) -> int:
    """CRC-32 of the prompt's token ids (stable across processes and Python versions)."""
    return zlib.crc32(array("q", prompt_token_ids).tobytes())


def answer_token(digest: int, index: int) -> int:
    """Output token number ``index`` (0-based) of a request whose prompt has ``digest``.

    Lies in ``[TOKEN_ID_LOW, TOKEN_ID_HIGH)``: inside every bundled model's vocabulary and clear of special tokens
    (so never an EOS).
    """
    h = zlib.crc32(index.to_bytes(4, "little"), digest)
    return TOKEN_ID_LOW + h % (TOKEN_ID_HIGH - TOKEN_ID_LOW)


@dataclass(slots=True)
class _ReqState:
    digest: int
    prompt_len: int
    outputs: int = 0


class _TimedFuture(Future):  # type: ignore[type-arg]
    """A future whose value is known now but only "ready" at ``ready_at`` (``time.monotonic``).

    ``result()`` sleeps until then: the engine thread waits for the simulated device as it would for a GPU.
    """

    def __init__(self, value: Any, ready_at: float) -> None:
        super().__init__()
        self._value = value
        self._ready_at = ready_at

    def done(self) -> bool:
        return time.monotonic() >= self._ready_at

    def result(self, timeout: float | None = None) -> Any:
        delay = self._ready_at - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        return self._value


class SimulatedExecutor(Executor):
    """The executor. One instance per EngineCore; all calls come from the engine's thread."""

    uses_ray = False
    supports_pp = False

    # ---------------------------------------------------------------------------------------- start-up

    def _init_executor(self) -> None:
        self.latency: LatencyModel = get_latency_model(settings.read(LATENCY_ENV))
        self.latency_scale: float = settings.read(LATENCY_SCALE_ENV)
        self._requests: dict[str, _ReqState] = {}
        self._device_free_at = 0.0
        self._pending: ModelRunnerOutput | None = None
        self._pending_ready_at = 0.0
        self.kv_cache_config: KVCacheConfig | None = None
        self.steps = 0
        self.busy_seconds = 0.0

    def _layer_specs(self) -> dict[str, KVCacheSpec]:
        """One full-attention KV spec per decoder layer, from the model's ``config.json``."""
        hf = self.model_config.hf_text_config
        layers = int(getattr(hf, "num_hidden_layers", 1) or 1)
        heads = int(getattr(hf, "num_attention_heads", 1) or 1)
        kv_heads = int(getattr(hf, "num_key_value_heads", None) or heads)
        head_size = int(getattr(hf, "head_dim", None) or int(hf.hidden_size) // heads)
        dtype = self.model_config.dtype if isinstance(self.model_config.dtype, torch.dtype) else torch.bfloat16
        block_size = self.cache_config.block_size or 16
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=kv_heads, head_size=head_size, dtype=dtype)
        return {f"model.layers.{i}.self_attn.attn": spec for i in range(layers)}

    def get_kv_cache_specs(self) -> list[dict[str, KVCacheSpec]]:
        return [self._layer_specs()]

    def determine_available_memory(self) -> list[int]:
        """Bytes for the requested pool (``--num-gpu-blocks-override``), never less than one longest request (vLLM's
        start-up check wants ``max_model_len`` tokens beside its null block; the override then sets the pool)."""
        specs = self._layer_specs()
        per_block = sum(s.page_size_bytes for s in specs.values())
        block_size = next(iter(specs.values())).block_size
        need = -(-int(self.model_config.max_model_len) // block_size) + 2
        blocks = max(int(self.cache_config.num_gpu_blocks_override or 0), need)
        return [blocks * per_block]

    def get_supported_kv_cache_layouts(self) -> list[list[str]]:
        return [["NHD"]]

    def set_kv_cache_layout(self, layout_name: str, cp_kv_cache_interleave_size: int) -> None:
        return None

    def initialize_from_config(self, kv_cache_configs: list[KVCacheConfig]) -> None:
        self.kv_cache_config = kv_cache_configs[0]

    def compile_or_warm_up_model(self) -> None:
        return None

    @property
    def supported_tasks(self) -> tuple[str, ...]:  # type: ignore[override]
        return ("generate",)

    def collective_rpc(  # type: ignore[override]
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        non_block: bool = False,
    ) -> Any:
        """Worker RPCs that reach here need no worker (there is none): answer each with ``None``."""
        name = method if isinstance(method, str) else getattr(method, "__name__", "callable")
        if name == "get_supported_tasks":
            result: list[Any] = [("generate",)]
        else:
            result = [None]
        if non_block:
            future: Future[list[Any]] = Future()
            future.set_result(result)
            return future
        return result

    def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        return None

    @classmethod
    def supports_async_scheduling(cls) -> bool:
        return True

    # ---------------------------------------------------------------------------------------- steps

    def _fabricate(self, so: SchedulerOutput) -> tuple[ModelRunnerOutput, float]:
        """The step's output and its modelled duration in seconds."""
        reqs = self._requests
        for rid in so.finished_req_ids:
            reqs.pop(rid, None)
        if not so.total_num_scheduled_tokens:
            return EMPTY_MODEL_RUNNER_OUTPUT, 0.0
        computed_before: dict[str, int] = {}
        admitted_prompt_tokens = 0
        for new in so.scheduled_new_reqs:
            prompt = list(new.prompt_token_ids or ())
            state = reqs[new.req_id] = _ReqState(prompt_digest(prompt), len(prompt))
            # vLLM's v2 model runner path re-sends a resumed (preempted) request as new, with all its tokens.
            resent = getattr(new, "prefill_token_ids", None)
            if resent is not None and len(resent) > len(prompt):
                state.outputs = len(resent) - len(prompt)
            else:
                admitted_prompt_tokens += len(prompt)
            computed_before[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        resumed = cached.resumed_req_ids
        for i, rid in enumerate(cached.req_ids):
            computed_before[rid] = cached.num_computed_tokens[i]
            state = reqs.get(rid)
            if state is None:  # unknown (should not happen): rebuild from what the scheduler sent
                tokens = cached.all_token_ids.get(rid, [])
                state = reqs[rid] = _ReqState(prompt_digest(tokens), len(tokens))
            if rid in resumed:
                # After a preemption the scheduler's count is the truth: in-flight tokens may have been dropped.
                state.outputs = cached.num_output_tokens[i]

        req_ids: list[str] = []
        sampled: list[list[int]] = []
        chunks: list[tuple[int, int]] = []
        decodes: list[int] = []
        for rid, n in so.num_scheduled_tokens.items():
            state = reqs[rid]
            k = computed_before.get(rid, 0)
            known = state.prompt_len + state.outputs
            if state.outputs > 0 and n == 1 and k + 1 >= known:
                decodes.append(k + 1)
            else:
                chunks.append((n, k))
            req_ids.append(rid)
            if k + n >= known:
                sampled.append([answer_token(state.digest, state.outputs)])
                state.outputs += 1
            else:
                sampled.append([])
        out = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=sampled,
        )
        work = StepWork(prefill_chunks=chunks, decode_contexts=decodes, admitted_prompt_tokens=admitted_prompt_tokens)
        seconds = self.latency.step_seconds(work) * self.latency_scale
        return out, seconds

    def _run_on_device(self, seconds: float) -> float:
        """Queue ``seconds`` of work on the simulated device; returns when it is done (``time.monotonic``)."""
        start = max(time.monotonic(), self._device_free_at)
        self._device_free_at = start + seconds
        self.steps += 1
        self.busy_seconds += seconds
        return self._device_free_at

    def execute_model(  # type: ignore[override]
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> Any:
        """Runs the "forward pass". Like the GPU runner: returns ``None`` when ``sample_tokens`` will carry the
        output, and the (empty) output itself when nothing was scheduled (the async engine reads it directly)."""
        out, seconds = self._fabricate(scheduler_output)
        if out is EMPTY_MODEL_RUNNER_OUTPUT:
            value: ModelRunnerOutput | None = out
            ready_at = time.monotonic()
        else:
            self._pending = out
            self._pending_ready_at = ready_at = self._run_on_device(seconds)
            value = None
        if non_block:
            return _TimedFuture(value, ready_at)
        _TimedFuture(None, ready_at).result()
        return value

    def sample_tokens(self, grammar_output: Any, non_block: bool = False) -> Any:  # type: ignore[override]
        out = self._pending if self._pending is not None else EMPTY_MODEL_RUNNER_OUTPUT
        ready_at = self._pending_ready_at
        self._pending = None
        future = _TimedFuture(out, ready_at)
        return future if non_block else future.result()

    def take_draft_token_ids(self) -> None:
        return None

    def execute_dummy_batch(self) -> None:
        return None
