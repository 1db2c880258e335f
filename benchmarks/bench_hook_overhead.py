"""Hook overhead on vLLM's real scheduler: CPU time of schedule() + update_from_output(), side by side.

Modes, interleaved round by round in one process so machine noise hits them alike:
  plain      no KVFabric at all (the wrapper on Scheduler.__init__ present, settings off: nothing installed)
  recording  KVFABRIC_LIFECYCLE=1 with the null sink (the hot path's full cost, no transport)
  streaming  KVFABRIC_LIFECYCLE=1 streaming Arrow over a Unix socket to a real collector process

    python benchmarks/bench_hook_overhead.py [--rounds 5] [--out benchmarks/results/hook_overhead.md]

Also measures the per-operation cost of the hook at growing pool sizes (10^4 .. 10^6 blocks) by timing one
allocate/free cycle of a fixed request on a pool of that size (the hook's cost must not grow with the pool).
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from kvfabric.collector import CollectorConfig, CollectorProcess
from kvfabric.demo import free_port


def run_mode(mode: str, sock: str, workload: list) -> tuple[float, int]:
    """Scheduler CPU seconds for one run of ``workload`` in ``mode``; returns (seconds, events)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from kvfabric.hook.plugin import wrap_scheduler_class
    from kvfabric.sim.harness import SimulatedEngine

    wrap_scheduler_class(Scheduler)
    for var in ("KVFABRIC_LIFECYCLE", "KVFABRIC_SINK"):
        os.environ.pop(var, None)
    if mode != "plain":
        os.environ["KVFABRIC_LIFECYCLE"] = "1"
        os.environ["KVFABRIC_SINK"] = "none" if mode == "recording" else f"unix://{sock}"
        os.environ["KVFABRIC_RUN_ID"] = f"bench-{mode}"
    engine = SimulatedEngine.create(640, "zero", track_evictions=False)
    engine.add_workload(workload)
    engine.run_until_done()
    events = 0
    inst = getattr(engine.scheduler, "_kvfabric", None)
    if inst is not None:
        events = inst.tracker.buffer.total
        inst.close()
    return engine.stats.wall_s, events


def per_op_cost(num_blocks: int, hooked: bool, cycles: int = 2000) -> float:
    """Microseconds per allocate+free cycle of a 4-block request on a pool of ``num_blocks`` blocks."""
    import torch
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from kvfabric.config import load_hook_settings
    from kvfabric.hook.install import attach
    from kvfabric.sim.harness import make_request

    cfg = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["l"], FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=1, dtype=torch.float32))])
    manager = KVCacheManager(cfg, max_model_len=8192, scheduler_block_size=16, enable_caching=True,
                             hash_block_size=16)
    inst = None
    if hooked:
        inst = attach(manager, load_hook_settings({"KVFABRIC_LIFECYCLE": "1", "KVFABRIC_SINK": "none"}),
                      block_size=16, start_sink=False)
    best = float("inf")
    for rep in range(3):  # the least disturbed of three passes (a shared 2-core machine)
        reqs = [make_request(f"r{rep}-{i}", [i % 50_000 + 1] * 64, 1) for i in range(cycles)]
        gc.collect()
        gc.freeze()  # as vLLM's EngineCore does after start-up: collections then skip the long-lived heap
        t0 = time.perf_counter()
        for r in reqs:
            computed, n, _ = manager.get_computed_blocks(r)
            manager.allocate_slots(r, 64 - n, n, computed)
            manager.free(r)
            if inst is not None and len(inst.tracker.buffer) > 10_000:
                inst.tracker.buffer.drain()  # what the sink thread does
        best = min(best, (time.perf_counter() - t0) / cycles * 1e6)
        gc.unfreeze()
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/hook_overhead.md")
    args = ap.parse_args()

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from kvfabric.sim.workload import demo_workload

    workload = demo_workload(seed=0)
    tmp = tempfile.mkdtemp(prefix="kvf-bench-")
    sock = os.path.join(tmp, "c.sock")
    collector = CollectorProcess(CollectorConfig(db_path=os.path.join(tmp, "bench.duckdb"), socket_path=sock,
                                                 port=free_port(0)), log_path=os.path.join(tmp, "c.log"))
    collector.start()
    modes = ["plain", "recording", "streaming"]
    times: dict[str, list[float]] = {m: [] for m in modes}
    events = 0
    try:
        run_mode("plain", sock, workload)  # warm-up: imports, first-run effects
        for r in range(args.rounds):
            order = modes if r % 2 == 0 else modes[::-1]
            for m in order:
                t, ev = run_mode(m, sock, workload)
                times[m].append(t)
                events = max(events, ev)
            print(f"round {r + 1}: " + ", ".join(f"{m} {times[m][-1]:.3f}s" for m in modes), flush=True)
    finally:
        collector.stop()
    med = {m: statistics.median(v) for m, v in times.items()}
    best = {m: min(v) for m, v in times.items()}  # the least disturbed run of each mode: robust to a busy machine
    sizes = [10_000, 100_000, 1_000_000]
    costs = {n: (per_op_cost(n, False), per_op_cost(n, True)) for n in sizes}

    lines = [
        "# Hook overhead on vLLM's real scheduler (CPU)",
        "",
        f"Command: `python benchmarks/bench_hook_overhead.py --rounds {args.rounds}`  ",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"{time.strftime('%Y-%m-%d')}  ",
        f"Workload: `demo_workload(seed=0)` on 640 blocks, zero-latency model; {events:,} events per run.",
        "",
        "Scheduler time (schedule + update_from_output, wall clock), modes interleaved round by round:",
        "",
        "| mode | best s | best vs plain | median s | median vs plain | all rounds |",
        "|---|---|---|---|---|---|",
    ]
    for m in modes:
        lines.append(f"| {m} | {best[m]:.3f} | {best[m] / best['plain']:.3f}x | {med[m]:.3f} | "
                     f"{med[m] / med['plain']:.3f}x | {', '.join(f'{x:.3f}' for x in times[m])} |")
    spread = (max(times["plain"]) - min(times["plain"])) / med["plain"]
    lines += [
        "",
        f"Run-to-run spread of plain: {100 * spread:.1f}% (differences below it are noise).",
        "",
        "Per-operation cost (allocate + free of a 4-block request, µs) against pool size:",
        "",
        "| blocks | plain µs | hooked µs | hook adds µs |",
        "|---|---|---|---|",
    ]
    for n in sizes:
        p, h = costs[n]
        lines.append(f"| {n:,} | {p:.1f} | {h:.1f} | {h - p:.1f} |")
    text = "\n".join(lines) + "\n"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
