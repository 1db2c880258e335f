"""Drive vLLM's real ``Scheduler`` and ``KVCacheManager`` on a CPU with a simulated model.

Only the forward pass is modelled. Scheduling, prefix caching, block allocation, eviction and preemption are
vLLM's own code, built exactly as an ``EngineCore`` builds them (DESIGN §3), so whatever a vLLM general plugin
installs on the scheduler (the kvfabric hook) runs here as it would in a server.

The loop mirrors ``EngineCore.step``: ``schedule()`` -> a fabricated ``ModelRunnerOutput`` -> ``update_from_output()``.
The fabricated output follows the GPU model runner's rule: a request samples one token in a step iff that step
brings its computed tokens up to all its known tokens (prompt plus outputs so far); a chunked-prefill step that
stops short samples nothing. The token sampled for the ``i``-th output of request ``r`` is
:func:`output_token` ``(r, i)``, a pure function, so a workload generator can build the next turn of a conversation
from the exact tokens the engine will answer with. Because the rule is stated on computed versus known tokens,
it also re-synchronises after a preemption: the re-prefill samples the next token only when it has caught up.

Time is simulated: each step advances a clock by what a :class:`~kvfabric.sim.latency.LatencyModel` says the step
would take on a GPU, and requests arrive when the clock reaches their arrival time. The CPU time of
``schedule()`` + ``update_from_output()`` is measured separately (it is the quantity hook-overhead benchmarks
compare).
"""

from __future__ import annotations

import atexit
import heapq
import os
import shutil
import tempfile
import time
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvfabric.sim.latency import LatencyModel, StepWork, get_latency_model

if TYPE_CHECKING:  # vLLM is an optional extra; import it only where it is used.
    from vllm.config import KVEventsConfig
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request

__all__ = [
    "DEFAULT_MODEL",
    "TOKEN_ID_HIGH",
    "TOKEN_ID_LOW",
    "EngineStats",
    "RequestMetrics",
    "SimulatedEngine",
    "StepResult",
    "available_models",
    "build_scheduler",
    "make_request",
    "output_token",
    "resolve_model_dir",
]

#: Bundled model config used when ``model_dir`` is not given (a Qwen2-0.5B shape, like the latency data).
DEFAULT_MODEL = "qwen2-0.5b"

#: Token ids the simulator uses for prompts and outputs lie in [TOKEN_ID_LOW, TOKEN_ID_HIGH): inside every
#: bundled model's vocabulary and clear of the special tokens at both ends.
TOKEN_ID_LOW = 1000
TOKEN_ID_HIGH = 100_000


def output_token(request_id: str, index: int) -> int:
    """The token the simulated model samples as output number ``index`` (0-based) of ``request_id``.

    A pure function of its arguments (CRC-32, stable across processes and Python versions), so workloads can
    know answers in advance.
    """
    return TOKEN_ID_LOW + zlib.crc32(f"{request_id}\x00{index}".encode()) % (TOKEN_ID_HIGH - TOKEN_ID_LOW)


# --------------------------------------------------------------------------------------------- construction


def available_models() -> list[str]:
    """Names of the model configs bundled in ``kvfabric/sim/models/`` (``<name>.json``)."""
    root = resources.files("kvfabric.sim") / "models"
    return sorted(p.name.removesuffix(".json") for p in root.iterdir() if p.name.endswith(".json"))


_model_dirs: dict[str, str] = {}


def resolve_model_dir(model_dir: str | None = None) -> str:
    """A directory holding only a ``config.json``, as vLLM's ``ModelConfig`` wants it.

    ``model_dir`` may be ``None`` (the default bundled model), a bundled model name, a ``.json`` file or a
    directory that already holds a ``config.json``. Bundled configs and files are copied once per process into a
    temporary directory that is removed at exit.
    """
    if model_dir is not None and Path(model_dir).is_dir():
        if not (Path(model_dir) / "config.json").is_file():
            raise FileNotFoundError(f"{model_dir} holds no config.json")
        return str(model_dir)
    key = model_dir or DEFAULT_MODEL
    cached = _model_dirs.get(key)
    if cached is not None and Path(cached, "config.json").is_file():
        return cached
    if key.endswith(".json") and Path(key).is_file():
        text = Path(key).read_text()
    else:
        source = resources.files("kvfabric.sim") / "models" / f"{key}.json"
        if not source.is_file():
            raise FileNotFoundError(f"no model {key!r}: not a directory, .json file or one of {available_models()}")
        text = source.read_text()
    tmp = tempfile.mkdtemp(prefix=f"kvfabric-sim-{Path(key).stem}-")
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    Path(tmp, "config.json").write_text(text)
    _model_dirs[key] = tmp
    return tmp


def build_scheduler(
    num_blocks: int,
    block_size: int = 16,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 2048,
    max_model_len: int = 8192,
    enable_prefix_caching: bool = True,
    model_dir: str | None = None,
    load_plugins: bool = True,
    kv_events: KVEventsConfig | None = None,
) -> Scheduler:
    """Build vLLM's real ``Scheduler`` (and through it ``KVCacheManager`` and ``BlockPool``) on a CPU.

    ``num_blocks`` counts vLLM's null block, so ``num_blocks - 1`` blocks are usable. Installed vLLM general
    plugins are loaded first (as ``EngineCore.__init__`` does; ``load_plugins=False`` skips them, for a plain
    vLLM baseline), and the class is looked up on its module at call time, so a plugin that wraps
    ``Scheduler.__init__`` sees this construction exactly as in a real engine. ``kv_events`` is vLLM's
    ``--kv-events-config``: the Scheduler builds vLLM's own event publisher from it (``ZmqEventPublisher`` for
    ``publisher="zmq"``) and publishes one batch per step; ``Scheduler.shutdown()`` stops it.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model is a local config.json; never reach for the Hub
    # vLLM, torch: only when a scheduler is built (this module loads for several commands' --help)
    import torch
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.plugins import load_general_plugins
    from vllm.v1.core.sched import scheduler as scheduler_module
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    if num_blocks < 2:
        raise ValueError("num_blocks must be >= 2 (block 0 is vLLM's null block)")
    if load_plugins:
        load_general_plugins()
    model_config = ModelConfig(
        model=resolve_model_dir(model_dir), skip_tokenizer_init=True, max_model_len=max_model_len
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        is_encoder_decoder=False,
        enable_chunked_prefill=True,
        async_scheduling=False,  # the plain Scheduler; AsyncScheduler needs an executor that runs ahead
    )
    cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching)
    vllm_config = VllmConfig(
        model_config=model_config,
        cache_config=cache_config,
        scheduler_config=scheduler_config,
        device_config=DeviceConfig(device="cpu"),  # without it: "Failed to infer device type"
        kv_events_config=kv_events,
    )
    # What EngineCore learns from the workers' memory profiling; here we simply decide it.
    cache_config.num_gpu_blocks = num_blocks
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer"],
                FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32),
            )
        ],
    )
    return scheduler_module.Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
        log_stats=True,
    )


_none_hash_ready = False


def make_request(
    request_id: str,
    prompt_token_ids: list[int],
    max_tokens: int,
    extra_args: dict[str, Any] | None = None,
    *,
    block_size: int = 16,
    arrival_time: float | None = None,
) -> Request:
    """A vLLM ``Request`` that generates exactly ``max_tokens`` tokens (EOS is ignored; no stop tokens).

    Block hashes use sha256 with vLLM's fixed root seed (unless ``PYTHONHASHSEED`` is set), so equal token
    prefixes give equal hashes across processes. ``block_size`` must match the scheduler's. ``extra_args``
    lands in ``SamplingParams.extra_args`` (where a real server puts ``vllm_xargs``).
    """
    global _none_hash_ready
    # vLLM: only when a request is built
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    if max_tokens < 1:
        raise ValueError("max_tokens must be >= 1")
    if not prompt_token_ids:
        raise ValueError("prompt must not be empty")
    if not _none_hash_ready:
        # Once per process, as EngineCore does; every request's chain starts from this root hash.
        init_none_hash(sha256)
        _none_hash_ready = True
    params = SamplingParams(
        max_tokens=max_tokens, ignore_eos=True, detokenize=False, extra_args=dict(extra_args) if extra_args else None
    )
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt_token_ids),
        sampling_params=params,
        pooling_params=None,
        arrival_time=arrival_time,
        block_hasher=get_request_block_hasher(block_size, sha256),
    )


# --------------------------------------------------------------------------------------------- results


@dataclass(slots=True)
class RequestMetrics:
    """Life of one request on the simulated clock (seconds). ``None`` until the event happened."""

    request_id: str
    arrival_s: float
    num_prompt_tokens: int
    max_tokens: int
    #: First time the scheduler gave it tokens.
    first_scheduled_s: float | None = None
    #: End of the step that sampled its first output token.
    first_token_s: float | None = None
    finish_s: float | None = None
    num_output_tokens: int = 0
    #: Prompt tokens served from vLLM's prefix cache at its first admission (vLLM's own ``PrefillStats``).
    num_cached_tokens: int | None = None
    num_preemptions: int = 0
    #: Full blocks it recomputed at admission whose hash had been evicted earlier in this run.
    rebuilt_blocks: int = 0
    finish_reason: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float | None:
        return None if self.finish_s is None else self.finish_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first."""
        if self.finish_s is None or self.first_token_s is None or self.num_output_tokens < 2:
            return None
        return (self.finish_s - self.first_token_s) / (self.num_output_tokens - 1)


@dataclass(slots=True)
class StepResult:
    """One engine step. ``start_s``/``end_s`` are simulated; ``wall_s`` is real CPU time of vLLM's calls."""

    step: int
    start_s: float
    end_s: float
    num_scheduled_tokens: int
    num_prefill_tokens: int
    num_prefill_reqs: int
    num_decode_reqs: int
    #: CPU seconds of ``schedule()`` + ``update_from_output()`` (the executor's fabrication is excluded).
    wall_s: float
    wall_schedule_s: float
    wall_update_s: float
    #: Requests that sampled a token in this step (including the finished ones).
    num_sampled: int
    admitted: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    kv_cache_usage: float = 0.0

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(slots=True)
class EngineStats:
    """Counters over the whole run. Token counts are per admission (a preempted request counts again)."""

    steps: int = 0
    busy_steps: int = 0
    wall_s: float = 0.0
    #: CPU time of the calling thread inside vLLM's calls (what the scheduler thread itself spends; unlike
    #: ``wall_s`` it does not count time this thread waited for a core other processes held).
    cpu_s: float = 0.0
    requests_added: int = 0
    requests_finished: int = 0
    admissions: int = 0
    #: Known tokens (prompt plus outputs so far) of admitted requests, and how many of them hit the cache.
    admitted_tokens: int = 0
    admitted_hit_tokens: int = 0
    preemptions: int = 0
    #: vLLM's own prefix-cache counters (``vllm:prefix_cache_queries/hits``; preempted requests excluded).
    vllm_prefix_queries: int = 0
    vllm_prefix_hits: int = 0
    #: Cached blocks that lost their hash because the pool reused them (needs ``track_evictions``).
    evicted_blocks: int = 0
    #: Full blocks recomputed at admission whose hash had been evicted before (needs ``track_evictions``).
    rebuilt_blocks: int = 0
    output_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.admitted_hit_tokens / self.admitted_tokens if self.admitted_tokens else 0.0


class _EvictionObserver:
    """Counts evictions through vLLM's own residency-metrics hook on the pool (``BlockPool.metrics_collector``).

    ``BlockPool._maybe_evict_cached_block`` calls ``on_block_evicted`` for every block it takes from the free
    queue, *before* clearing the hash, so a block that still has one is an eviction. Observation only: vLLM
    ignores this object's answers. An existing collector (``--kv-cache-metrics``) is chained, not replaced.
    """

    __slots__ = ("evicted_blocks", "evicted_hashes", "inner")

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.evicted_blocks = 0
        #: Hashes (without group id) evicted and not yet recomputed.
        self.evicted_hashes: set[bytes] = set()

    # The methods below are the KVCacheMetricsCollector interface the pool calls.
    def on_block_allocated(self, block: KVCacheBlock) -> None:
        if self.inner is not None:
            self.inner.on_block_allocated(block)

    def on_block_accessed(self, block: KVCacheBlock) -> None:
        if self.inner is not None:
            self.inner.on_block_accessed(block)

    def on_block_evicted(self, block: KVCacheBlock) -> None:
        key = block.block_hash
        if key is not None:
            self.evicted_blocks += 1
            # BlockHashWithGroupId is the hash bytes followed by a 4-byte group id (one group here).
            self.evicted_hashes.add(bytes(key[:-4]))
        if self.inner is not None:
            self.inner.on_block_evicted(block)

    def reset(self) -> None:
        self.evicted_hashes.clear()
        if self.inner is not None:
            self.inner.reset()

    def drain_events(self) -> list[Any]:
        return self.inner.drain_events() if self.inner is not None else []


# --------------------------------------------------------------------------------------------- engine


class SimulatedEngine:
    """The engine loop around a real vLLM scheduler, with a modelled GPU and a simulated clock.

    Invariants:

    * the clock never goes backwards; a request is handed to the scheduler only once the clock has reached its
      arrival time; when nothing is running the clock jumps to the next arrival;
    * every request that is not aborted produces exactly ``max_tokens`` tokens, the ``i``-th being
      ``output_token(request_id, i)``;
    * a request is only accepted if it can ever be scheduled (fits ``max_model_len`` and the pool).
    """

    def __init__(
        self,
        scheduler: Scheduler,
        latency: str | LatencyModel = "qwen",
        *,
        track_evictions: bool = True,
        record_steps: bool = False,
    ) -> None:
        """Wrap ``scheduler``. ``track_evictions`` attaches :class:`_EvictionObserver` (one Python call per block
        allocation, so turn it off for overhead benchmarks); ``record_steps`` keeps every :class:`StepResult`."""
        self.scheduler = scheduler
        self.latency = get_latency_model(latency)
        self.block_size: int = scheduler.block_size
        self.max_model_len: int = scheduler.max_model_len
        self.clock_s = 0.0
        self.stats = EngineStats()
        self.metrics: dict[str, RequestMetrics] = {}
        self.step_wall_s: list[float] = []
        self.steps: list[StepResult] | None = [] if record_steps else None
        self._pending: list[tuple[float, int, Request]] = []  # heap of (arrival_s, seq, request)
        self._seq = 0
        self._requests: dict[str, Request] = {}  # every request ever added, including finished ones
        self._admitted_preemptions: dict[str, int] = {}  # request id -> num_preemptions at its last admission
        self._idle_empty_steps = 0
        self._last_step_empty = False
        self._observer: _EvictionObserver | None = None
        if track_evictions:
            pool = self.block_pool
            self._observer = _EvictionObserver(pool.metrics_collector)
            pool.metrics_collector = self._observer

    @classmethod
    def create(
        cls,
        num_blocks: int,
        latency: str | LatencyModel = "qwen",
        *,
        track_evictions: bool = True,
        record_steps: bool = False,
        **scheduler_kwargs: Any,
    ) -> SimulatedEngine:
        """``build_scheduler(num_blocks, **scheduler_kwargs)`` wrapped in an engine."""
        return cls(
            build_scheduler(num_blocks, **scheduler_kwargs),
            latency,
            track_evictions=track_evictions,
            record_steps=record_steps,
        )

    # -- views for tests and tools

    @property
    def kv_cache_manager(self) -> KVCacheManager:
        return self.scheduler.kv_cache_manager

    @property
    def block_pool(self) -> BlockPool:
        return self.scheduler.kv_cache_manager.block_pool

    @property
    def num_pending(self) -> int:
        """Requests added but not yet arrived (not yet in the scheduler)."""
        return len(self._pending)

    def request(self, request_id: str) -> Request:
        """The vLLM ``Request`` object (kept after it finished)."""
        return self._requests[request_id]

    def has_unfinished(self) -> bool:
        return bool(self._pending) or self.scheduler.has_requests()

    # -- input

    def add_request(self, request: Request, arrival_s: float | None = None) -> None:
        """Queue ``request`` to arrive at ``arrival_s`` on the simulated clock (now if ``None`` or in the past)."""
        rid = request.request_id
        if rid in self._requests:
            raise ValueError(f"duplicate request id {rid!r}")
        total = request.num_prompt_tokens + request.max_tokens
        if total > self.max_model_len:
            raise ValueError(f"{rid}: prompt + max_tokens = {total} exceeds max_model_len {self.max_model_len}")
        usable_blocks = self.block_pool.num_gpu_blocks - 1  # block 0 is the null block
        if -(-total // self.block_size) > usable_blocks:
            raise ValueError(f"{rid}: needs {-(-total // self.block_size)} blocks, the pool has {usable_blocks}")
        arrival = self.clock_s if arrival_s is None else max(float(arrival_s), self.clock_s)
        self._requests[rid] = request
        self.metrics[rid] = RequestMetrics(
            request_id=rid,
            arrival_s=arrival,
            num_prompt_tokens=request.num_prompt_tokens,
            max_tokens=request.max_tokens,
        )
        heapq.heappush(self._pending, (arrival, self._seq, request))
        self._seq += 1
        self.stats.requests_added += 1

    def add_workload(self, items: Iterable[tuple[float, str, list[int], int, dict[str, Any] | None]]) -> int:
        """Add ``(arrival_s, request_id, prompt_token_ids, max_tokens, extra_args)`` items; returns how many."""
        count = 0
        for arrival_s, rid, prompt, max_tokens, extra in items:
            self.add_request(
                make_request(rid, prompt, max_tokens, extra, block_size=self.block_size, arrival_time=arrival_s),
                arrival_s,
            )
            count += 1
        return count

    def _admit_arrivals(self) -> None:
        pending = self._pending
        while pending and pending[0][0] <= self.clock_s:
            _, _, request = heapq.heappop(pending)
            self.scheduler.add_request(request)

    # -- the loop

    def step(self) -> StepResult:
        """One engine step: admit arrivals, schedule, fabricate the model output, update, advance the clock."""
        # vLLM: only when the engine steps
        from vllm.v1.outputs import ModelRunnerOutput

        scheduler = self.scheduler
        if self._pending and (self._last_step_empty or not scheduler.has_requests()):
            # Idle engine (or one whose last step could schedule nothing): nothing can change before the next
            # arrival, so jump there instead of spinning.
            self.clock_s = max(self.clock_s, self._pending[0][0])
        self._admit_arrivals()
        start = self.clock_s

        c0 = time.thread_time()
        t0 = time.perf_counter()
        sched_out = scheduler.schedule()
        t1 = time.perf_counter()
        c1 = time.thread_time()

        # Fabricate what the GPU model runner would return, and describe the work for the latency model.
        req_ids: list[str] = []
        sampled: list[list[int]] = []
        chunks: list[tuple[int, int]] = []
        decode_contexts: list[int] = []
        admitted: list[str] = []
        admitted_prompt_tokens = 0
        requests = scheduler.requests
        for rid, n in sched_out.num_scheduled_tokens.items():
            req = requests[rid]
            computed = req.num_computed_tokens  # already advanced by schedule()
            k = computed - n
            if self._note_admission(rid, req, k, start):
                admitted.append(rid)
                if req.num_preemptions == 0:
                    admitted_prompt_tokens += req.num_prompt_tokens
            if req.num_output_tokens > 0 and n == 1 and computed == req.num_tokens:
                decode_contexts.append(computed)
            else:
                chunks.append((n, k))
            req_ids.append(rid)
            # The GPU runner samples for every request but discards the token of a partial prefill chunk.
            sampled.append([output_token(rid, req.num_output_tokens)] if computed >= req.num_tokens else [])
        runner_out = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=sampled,
        )
        work = StepWork(
            prefill_chunks=chunks, decode_contexts=decode_contexts, admitted_prompt_tokens=admitted_prompt_tokens
        )
        end = start + self.latency.step_seconds(work)

        c2 = time.thread_time()
        t2 = time.perf_counter()
        engine_outputs = scheduler.update_from_output(sched_out, runner_out)
        t3 = time.perf_counter()
        c3 = time.thread_time()

        self.clock_s = end
        finished = self._record_outputs(engine_outputs, end)
        preempted = sorted(sched_out.preempted_req_ids or ())
        wall = (t1 - t0) + (t3 - t2)
        st = self.stats
        st.steps += 1
        st.wall_s += wall
        st.cpu_s += (c1 - c0) + (c3 - c2)
        st.preemptions += len(preempted)
        self._last_step_empty = sched_out.total_num_scheduled_tokens == 0
        if not self._last_step_empty:
            st.busy_steps += 1
            self._idle_empty_steps = 0
        elif scheduler.has_unfinished_requests() and not self._pending:
            # Nothing scheduled, nothing arriving: the state cannot change any more.
            self._idle_empty_steps += 1
            if self._idle_empty_steps > 3:
                raise RuntimeError("scheduler makes no progress (a request that can never be scheduled?)")
        if self._observer is not None:
            st.evicted_blocks = self._observer.evicted_blocks
        self.step_wall_s.append(wall)
        result = StepResult(
            step=st.steps,
            start_s=start,
            end_s=end,
            num_scheduled_tokens=sched_out.total_num_scheduled_tokens,
            num_prefill_tokens=work.num_prefill_tokens,
            num_prefill_reqs=len(chunks),
            num_decode_reqs=len(decode_contexts),
            wall_s=wall,
            wall_schedule_s=t1 - t0,
            wall_update_s=t3 - t2,
            num_sampled=sum(1 for s in sampled if s),
            admitted=admitted,
            finished=finished,
            preempted=preempted,
            kv_cache_usage=scheduler.get_kv_cache_usage(),
        )
        if self.steps is not None:
            self.steps.append(result)
        return result

    def _note_admission(self, rid: str, req: Request, k: int, now: float) -> bool:
        """Account an admission (first schedule, or first schedule after a preemption). Returns whether it was.

        At admission ``k`` (computed tokens before this step's chunk) is exactly the prefix-cache hit.
        """
        previous = self._admitted_preemptions.get(rid)
        if previous is not None and previous == req.num_preemptions:
            return False
        self._admitted_preemptions[rid] = req.num_preemptions
        m = self.metrics[rid]
        if m.first_scheduled_s is None:
            m.first_scheduled_s = now
        st = self.stats
        st.admissions += 1
        st.admitted_tokens += req.num_tokens
        st.admitted_hit_tokens += k
        obs = self._observer
        if obs is not None and obs.evicted_hashes:
            # Blocks beyond the hit are recomputed now; those whose hash was evicted are rebuilt-from-eviction.
            evicted = obs.evicted_hashes
            rebuilt = 0
            for h in req.block_hashes[k // self.block_size :]:
                if h in evicted:
                    evicted.discard(h)
                    rebuilt += 1
            m.rebuilt_blocks += rebuilt
            st.rebuilt_blocks += rebuilt
        return True

    def _record_outputs(self, engine_outputs: dict[int, Any], now: float) -> list[str]:
        finished: list[str] = []
        st = self.stats
        for eco in engine_outputs.values():
            sched_stats = eco.scheduler_stats
            if sched_stats is not None:
                st.vllm_prefix_queries += sched_stats.prefix_cache_stats.queries
                st.vllm_prefix_hits += sched_stats.prefix_cache_stats.hits
            for out in eco.outputs:
                m = self.metrics[out.request_id]
                if out.new_token_ids:
                    if m.first_token_s is None:
                        m.first_token_s = now
                    m.num_output_tokens += len(out.new_token_ids)
                    st.output_tokens += len(out.new_token_ids)
                if out.prefill_stats is not None and m.num_cached_tokens is None:
                    m.num_cached_tokens = out.prefill_stats.num_local_cached_tokens
                if out.finish_reason is not None:
                    m.finish_s = now
                    m.finish_reason = str(out.finish_reason)
                    m.num_preemptions = self._requests[out.request_id].num_preemptions
                    self._admitted_preemptions.pop(out.request_id, None)
                    st.requests_finished += 1
                    finished.append(out.request_id)
        return finished

    def run_until_done(
        self, progress: Callable[[StepResult], None] | None = None, max_steps: int | None = None
    ) -> EngineStats:
        """Step until every added request has finished (and vLLM has flushed its finished-request ids).

        ``progress`` is called after every step. Raises ``RuntimeError`` after ``max_steps`` steps.
        """
        taken = 0
        while self.has_unfinished():
            if max_steps is not None and taken >= max_steps:
                raise RuntimeError(f"not done after {max_steps} steps")
            result = self.step()
            taken += 1
            if progress is not None:
                progress(result)
        return self.stats

    def summary(self) -> dict[str, Any]:
        """A flat, JSON-friendly summary of the run (counters plus latency percentiles)."""
        ttfts = sorted(m.ttft_s for m in self.metrics.values() if m.ttft_s is not None)
        e2es = sorted(m.e2e_s for m in self.metrics.values() if m.e2e_s is not None)
        st = self.stats

        def pct(values: list[float], q: float) -> float | None:
            return values[min(len(values) - 1, int(q * len(values)))] if values else None

        return {
            "latency_model": self.latency.name,
            "num_blocks": self.block_pool.num_gpu_blocks,
            "block_size": self.block_size,
            "sim_time_s": self.clock_s,
            "steps": st.steps,
            "busy_steps": st.busy_steps,
            "wall_s": st.wall_s,
            "requests": st.requests_added,
            "finished": st.requests_finished,
            "output_tokens": st.output_tokens,
            "admissions": st.admissions,
            "admitted_tokens": st.admitted_tokens,
            "admitted_hit_tokens": st.admitted_hit_tokens,
            "hit_rate": st.hit_rate,
            "vllm_prefix_queries": st.vllm_prefix_queries,
            "vllm_prefix_hits": st.vllm_prefix_hits,
            "preemptions": st.preemptions,
            "evicted_blocks": st.evicted_blocks,
            "rebuilt_blocks": st.rebuilt_blocks,
            "wasted_prefill_tokens": st.rebuilt_blocks * self.block_size,
            "ttft_p50_s": pct(ttfts, 0.5),
            "ttft_p99_s": pct(ttfts, 0.99),
            "e2e_p50_s": pct(e2es, 0.5),
            "e2e_p99_s": pct(e2es, 0.99),
        }
