"""``kvfabric replay``: a ``hash_ids`` trace through vLLM's real scheduler on CPU, with the hook on, under a policy.

Real mode (default): the trace becomes token prompts (:func:`kvfabric.sim.workload.iter_trace_workload`), vLLM's
own ``Scheduler``/``KVCacheManager``/``BlockPool`` run them with a simulated model (:mod:`kvfabric.sim.harness`),
and the kvfabric hook records every block's life. The numbers printed are counted from the hook's own events,
in-process (the replay expands the hook's records itself), so they are exactly what a collector would store;
``--collector SOCKET`` also streams those events to a running collector.

``--policy optimal`` runs Belady's MIN inside vLLM: a policy that knows, for every block hash, the next trace row
that needs it (ties towards deeper blocks). Blocks pinned by running requests are not candidates, so the optimum
runs under the same capacity as the policies.

Fast mode (``--fast``): :mod:`kvfabric.sim.offline`, block-level, no vLLM (seconds instead of minutes); for sweeps.

Defaults keep the two modes comparable: ``--concurrency 1`` (one request at a time, the traces' README's
"sequential replay") and ``--max-output-tokens 1`` (the replay's outputs are made up, so decode blocks are never
reused; one token keeps them out of the picture).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvfabric.argtypes import int_range, nonneg_int, positive_int
from kvfabric.contract import schema as S
from kvfabric.engine.config import HookSettings
from kvfabric.engine.hints import request_info
from kvfabric.engine.install import build_hook, engine_id
from kvfabric.policies import ALL_POLICIES, make_policy
from kvfabric.policies.base import EvictionPolicy, PolicySettings, RequestInfo
from kvfabric.policies.optimal import occurrences_of
from kvfabric.policies.reuse_model import load_model
from kvfabric.sim.harness import SimulatedEngine, build_scheduler, make_request
from kvfabric.sim.latency import LATENCY_MODELS
from kvfabric.sim.offline import load_trace, simulate
from kvfabric.sim.tracecheck import scan_trace
from kvfabric.sim.workload import iter_trace_workload
from kvfabric.usage import UsageError

REPLAY_POLICIES: tuple[str, ...] = ALL_POLICIES


# --------------------------------------------------------------------------------------------- event counting


@dataclass
class EventCounts:
    """The run's numbers, counted from hook events (docs/design.md §5 definitions)."""

    by_event: Counter[str] = field(default_factory=Counter)
    requests: int = 0
    prompt_tokens: int = 0
    prefix_hit_tokens: int = 0
    evicted_blocks: int = 0
    shared_anchor_evictions: int = 0
    protected_evictions: int = 0
    rebuilt_from_eviction_blocks: int = 0
    regretful_evictions: int = 0
    admission_limited_blocks: int = 0

    _EVENT = S.EMIT_COLUMNS.index("event")
    _PROMPT = S.EMIT_COLUMNS.index("prompt_tokens")
    _HIT = S.EMIT_COLUMNS.index("hit_tokens")
    _COUNT = S.EMIT_COLUMNS.index("count")
    _SHARE = S.EMIT_COLUMNS.index("share_degree")
    _PROTECTED = S.EMIT_COLUMNS.index("protected")

    def add(self, rows: Sequence[tuple]) -> None:
        by_event = self.by_event
        ev_i, count_i = self._EVENT, self._COUNT
        for row in rows:
            ev = row[ev_i]
            by_event[ev] += 1
            if ev == S.PREFIX_LOOKUP:
                self.requests += 1
                self.prompt_tokens += row[self._PROMPT] or 0
                self.prefix_hit_tokens += row[self._HIT] or 0
                self.regretful_evictions += row[count_i] or 0
            elif ev == S.BLOCK_EVICTED:
                self.evicted_blocks += 1
                if (row[self._SHARE] or 0) >= 2:
                    self.shared_anchor_evictions += 1
                if row[self._PROTECTED]:
                    self.protected_evictions += 1
            elif ev == S.BLOCK_REBUILT:
                self.rebuilt_from_eviction_blocks += 1
            elif ev == S.CACHE_ADMISSION_LIMITED:
                self.admission_limited_blocks += row[count_i] or 0


# --------------------------------------------------------------------------------------------- real mode


def _trace_row(request_id: str) -> int | None:
    tail = request_id.rsplit("/", 1)[-1]
    return int(tail) if tail.isdigit() else None


def _trace_info(request: Any) -> RequestInfo:
    """A trace request's context for policies: its hints, plus its row in the trace (the optimum's clock)."""
    info = request_info(request)
    return RequestInfo(info.request_id, info.family, info.session, info.session_end,
                       _trace_row(info.request_id))


@contextlib.contextmanager
def _without_env_hook() -> Iterator[None]:
    """Build the scheduler without the env-configured plugin: the replay installs the hook itself, as asked."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("KVFABRIC_")}
    for k in saved:
        del os.environ[k]
    try:
        yield
    finally:
        os.environ.update(saved)


def replay_real(
    trace: str,
    policy: str,
    num_blocks: int,
    *,
    limit: int | None = None,
    max_output_tokens: int | None = 1,
    concurrency: int = 1,
    collector: str | None = None,
    block_size: int = 16,
    max_num_batched_tokens: int = 8192,
    admission_anchor_blocks: int = 0,
    cache_aware_scheduling: bool = False,
    latency: str = "qwen",
    run_id: str | None = None,
    progress: bool = True,
    policy_settings: dict[str, Any] | None = None,
    policy_model: str | None = None,
) -> dict[str, Any]:
    """Replay ``trace`` through vLLM's real scheduler; returns the JSON object ``kvfabric replay`` prints.

    ``policy_model``: the learned policy's model file (None = the built-in one)."""
    if policy not in REPLAY_POLICIES:
        raise ValueError(f"unknown policy {policy!r} (known: {', '.join(REPLAY_POLICIES)})")
    items = list(iter_trace_workload(trace, limit=limit, max_output_tokens=max_output_tokens))
    if not items:
        raise ValueError(f"{trace}: no requests")
    longest = max(len(p) + mt for _, _, p, mt, _ in items)
    max_model_len = -(-longest // block_size) * block_size
    run = run_id or f"replay-{policy}-{num_blocks}"
    settings = HookSettings(
        # Rebuilt-from-eviction is detected against the expander's memory of evicted hashes; a replay keeps all
        # of them (a trace has at most a few million distinct blocks) so its wasted-prefill count is exact.
        evicted_memory=1 << 23,
        lifecycle=True,
        sink=f"unix://{collector}" if collector else "none",
        policy="lru" if policy == "optimal" else policy,
        admission_anchor_blocks=admission_anchor_blocks,
        cache_aware_scheduling=cache_aware_scheduling,
        run_id=run,
        policy_model=policy_model or "",
        **(policy_settings or {}),
    )
    # Trace prompts reach ~120k tokens, past the bundled model's 32k positions; the model is simulated, so the
    # position limit means nothing here (vLLM asks for this variable to allow it).
    os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    with _without_env_hook():
        scheduler = build_scheduler(
            num_blocks,
            block_size=block_size,
            max_num_seqs=concurrency,
            max_num_batched_tokens=max(max_num_batched_tokens, block_size),
            max_model_len=max(max_model_len, block_size),
        )
    requests = [
        make_request(rid, prompt, mt, extra, block_size=block_size, arrival_time=arrival)
        for arrival, rid, prompt, mt, extra in items
    ]
    oracle: EvictionPolicy | None = None
    if policy == "optimal":
        chains = []
        for req in requests:
            assert _trace_row(req.request_id) == len(chains)
            # Only blocks a request can hit are its uses: vLLM always recomputes the prompt's last token.
            hittable = req.block_hashes[: max(0, (req.num_prompt_tokens - 1) // block_size)]
            chains.append([S.hash64(h) for h in hittable])
        oracle = make_policy("optimal", oracle=occurrences_of(chains))  # type: ignore[arg-type]
    inst = build_hook(scheduler.kv_cache_manager, settings, scheduler=scheduler, block_size=block_size,
                      engine=engine_id(scheduler), policy=oracle, outlet="tee" if collector else "local",
                      info_of=_trace_info)
    if inst is None:
        raise RuntimeError("the hook could not attach (prefix caching off?)")
    engine = SimulatedEngine(scheduler, latency, track_evictions=False)
    for req, item in zip(requests, items, strict=True):
        engine.add_request(req, item[0])
    del items

    # Simulated time on the events: the trace's clock, anchored at the wall clock when the replay started.
    t0 = time.time_ns()
    inst.recorder.clock = lambda: t0 + int(engine.clock_s * 1e9)
    counts = EventCounts()

    bar = None
    if progress:
        try:
            # tqdm: only when a bar is drawn, and optional (a missing one costs the bar only)
            from tqdm import tqdm

            bar = tqdm(total=len(requests), desc=f"replay {policy}@{num_blocks}", unit="req", file=sys.stderr,
                       leave=False)
        except ImportError:  # tqdm is a dependency, but a progress bar is never worth failing for
            bar = None
    del requests
    wall0 = time.perf_counter()
    while engine.has_unfinished():
        result = engine.step()
        counts.add(inst.drain())
        if bar is not None and result.finished:
            bar.update(len(result.finished))
    wall = time.perf_counter() - wall0
    counts.add(inst.drain())
    if bar is not None:
        bar.close()
    inst.close()
    steering = inst.steering
    summary = engine.summary()
    bs = block_size
    out: dict[str, Any] = {
        "mode": "real",
        "trace": os.path.basename(trace),
        "policy": policy,
        "num_blocks": num_blocks,
        "block_size": bs,
        "requests": counts.requests,
        "prompt_tokens": counts.prompt_tokens,
        "prefix_hit_tokens": counts.prefix_hit_tokens,
        "prefix_hit_rate": counts.prefix_hit_tokens / counts.prompt_tokens if counts.prompt_tokens else 0.0,
        "evicted_blocks": counts.evicted_blocks,
        "shared_anchor_eviction_ratio": counts.shared_anchor_evictions / counts.evicted_blocks
        if counts.evicted_blocks else 0.0,
        "protected_eviction_ratio": counts.protected_evictions / counts.evicted_blocks
        if counts.evicted_blocks else 0.0,
        "rebuilt_from_eviction_blocks": counts.rebuilt_from_eviction_blocks,
        "wasted_prefill_tokens": counts.rebuilt_from_eviction_blocks * bs,
        "regretful_evictions": counts.regretful_evictions,
        "admission_limited_blocks": counts.admission_limited_blocks,
        "events_emitted": sum(counts.by_event.values()),
        "events_dropped": inst.outlet.lost_events,
        "events_by_type": dict(sorted(counts.by_event.items())),
        "concurrency": concurrency,
        "max_output_tokens": max_output_tokens,
        "admission_anchor_blocks": admission_anchor_blocks,
        "cache_aware_scheduling": cache_aware_scheduling,
        "limit": limit,
        "run_id": run,
        "steps": summary["steps"],
        "preemptions": summary["preemptions"],
        "sim_time_s": summary["sim_time_s"],
        "ttft_p50_s": summary["ttft_p50_s"],
        "ttft_p99_s": summary["ttft_p99_s"],
        "scheduler_wall_s": summary["wall_s"],
        "replay_wall_s": wall,
        "hook_errors": inst.recorder.errors,
    }
    if steering is not None:
        out["steering"] = {
            "victims": steering.victims,
            # Counted by the expander, which keeps the policy's protection flags (SCORED records).
            "protected_victims": expander.protected_evictions if (expander := inst.outlet.expander) else 0,
            "fallbacks": steering.fallbacks,
            "stale": steering.stale,
            "errors": steering.errors,
            "held_steps": steering.hold.held_steps if steering.hold is not None else 0,
        }
        if steering.policy is not None:
            out["policy_state"] = steering.policy.describe()
    return out


# --------------------------------------------------------------------------------------------- fast mode


def replay_fast(
    trace: str,
    policy: str,
    num_blocks: int,
    *,
    limit: int | None = None,
    max_output_tokens: int | None = 1,
    concurrency: int = 1,
    block_size: int = 16,
    admission_anchor_blocks: int = 0,
    progress: bool = True,
    policy_model: str | None = None,
) -> dict[str, Any]:
    """The same replay in :mod:`kvfabric.sim.offline` (block level, no vLLM)."""
    rows = load_trace(trace, limit)
    bar = None
    ticks = None
    if progress:
        try:
            # tqdm: only when a bar is drawn, and optional (a missing one costs the bar only)
            from tqdm import tqdm

            bar = tqdm(total=len(rows), desc=f"fast {policy}@{num_blocks}", unit="req", file=sys.stderr, leave=False)
            ticks = _ticker(bar)
        except ImportError:
            bar = None
    t0 = time.perf_counter()
    out = simulate(rows, policy, num_blocks, block_size=block_size, max_output_tokens=max_output_tokens,
                   concurrency=concurrency, anchor_blocks=admission_anchor_blocks, progress=ticks,
                   settings=PolicySettings(model_path=policy_model or None))
    if bar is not None:
        bar.close()
    out["trace"] = os.path.basename(trace)
    out["limit"] = limit
    out["replay_wall_s"] = time.perf_counter() - t0
    return out


def _ticker(bar: Any) -> Iterator[None]:
    while True:
        bar.update(1)
        yield None


# --------------------------------------------------------------------------------------------- CLI


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", required=True, help="hash_ids JSONL trace (Mooncake format)")
    parser.add_argument("--policy", default="lru", choices=REPLAY_POLICIES, help="eviction policy (default: lru)")
    parser.add_argument("--policy-model", default=None, metavar="MODEL",
                        help="the learned policy's reuse model (kvfabric learn --out MODEL; default: the built-in one)")
    parser.add_argument("--num-blocks", type=int_range(2), required=True,
                        help="KV pool size in blocks (vLLM counts its null block in it)")
    parser.add_argument("--limit", type=positive_int, default=None, help="replay only the first K rows")
    parser.add_argument("--max-output-tokens", type=positive_int, default=1,
                        help="cap on each request's output tokens (default 1; outputs are made up)")
    parser.add_argument("--concurrency", type=positive_int, default=1,
                        help="requests running at once (vLLM max_num_seqs; default 1 = sequential)")
    parser.add_argument("--collector", default=None, metavar="SOCKET",
                        help="also stream the hook's events to a collector's Unix socket")
    parser.add_argument("--format", choices=("json", "text"), default="text",
                        help="text: one line per number; json: one JSON object")
    parser.add_argument("--fast", action="store_true", help="block-level offline replay (no vLLM), for sweeps")
    parser.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block (default: 16)")
    parser.add_argument("--max-num-batched-tokens", type=positive_int, default=8192,
                        help="vLLM's per-step token budget")
    parser.add_argument("--admission-anchor-blocks", type=nonneg_int, default=0,
                        help="admission gate: cache at most N leading blocks of requests outside a known family "
                             "(default 0 = off)")
    parser.add_argument("--cache-aware-scheduling", action="store_true",
                        help="hold waiting requests whose prefix a running request is prefilling")

    parser.add_argument("--latency", default="qwen", choices=sorted(LATENCY_MODELS),
                        help="latency model of the simulated GPU (default: qwen)")
    parser.add_argument("--run-id", default=None, help="run label on the events (default replay-POLICY-N)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def run(args: argparse.Namespace) -> int:
    if not os.path.isfile(args.trace):
        raise UsageError(f"--trace: no trace file {args.trace!r}")
    try:
        scan_trace(args.trace, args.limit)  # a malformed row is refused here, by file and line
        return _run(args)
    except ValueError as exc:  # a request the pool can never hold, a malformed trace row, a bad flag value
        if "blocks, the pool has" in str(exc):
            raise UsageError(f"{exc} (raise --num-blocks: every request must fit the pool on its own)") from None
        raise UsageError(str(exc)) from None


def _run(args: argparse.Namespace) -> int:
    if args.policy_model:
        if args.policy != "learned":
            raise UsageError("--policy-model goes with --policy learned")
        load_model(args.policy_model)  # a ModelError (ValueError) here is one line and exit 2
    if args.fast:
        if args.collector:
            raise UsageError("--collector needs the real scheduler (drop --fast)")
        if args.cache_aware_scheduling:
            raise UsageError("--cache-aware-scheduling needs the real scheduler (drop --fast)")
        out = replay_fast(args.trace, args.policy, args.num_blocks, limit=args.limit,
                          max_output_tokens=args.max_output_tokens, concurrency=args.concurrency,
                          block_size=args.block_size, admission_anchor_blocks=args.admission_anchor_blocks,
                          progress=not args.no_progress, policy_model=args.policy_model)
    else:
        out = replay_real(args.trace, args.policy, args.num_blocks, limit=args.limit,
                          max_output_tokens=args.max_output_tokens, concurrency=args.concurrency,
                          collector=args.collector, block_size=args.block_size,
                          max_num_batched_tokens=args.max_num_batched_tokens,
                          admission_anchor_blocks=args.admission_anchor_blocks,
                          cache_aware_scheduling=args.cache_aware_scheduling, latency=args.latency,
                          run_id=args.run_id, progress=not args.no_progress, policy_model=args.policy_model)
    if args.format == "json":
        print(json.dumps(out, sort_keys=True))
    else:
        width = max(len(k) for k in out)
        for k, v in out.items():
            if isinstance(v, float):
                v = f"{v:.6g}"
            elif isinstance(v, dict):
                v = json.dumps(v, sort_keys=True)
            print(f"{k:<{width}}  {v}")
    return 0
