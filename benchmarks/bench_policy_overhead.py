"""Scheduler time under each policy on traffic with no sharing (``ordinary_unique_cold``): the policy must cost ~0.

vLLM's real Scheduler runs :func:`kvfabric.sim.workload.unique_cold_workload` (random prompts that share nothing)
on a pool small enough that every allocation evicts. The figure is the CPU time of ``schedule()`` +
``update_from_output()`` summed over the run (the harness measures exactly that), for:

* ``lru``: vLLM without the hook (the baseline);
* each policy with lifecycle recording off (what ``KVFABRIC_EVICTION_POLICY=<p>`` alone installs);
* ``lru +events`` and ``<p> +events``: lifecycle recording on (call records made and handed over every step, then
  dropped: the hot path's whole cost without a forwarder), where the policy's own cost is the difference.

Runs are interleaved (round robin over configurations, ``--repeats`` rounds) and each configuration's median is
reported with its ratio to its baseline.

Usage: python benchmarks/bench_policy_overhead.py [--requests 400] [--repeats 5] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys


def run_once(policy: str, events: bool, requests: int, num_blocks: int, seed: int) -> float:
    from kvfabric.engine.config import load_hook_settings
    from kvfabric.engine.handover import NullOutlet
    from kvfabric.engine.install import build_hook
    from kvfabric.sim.harness import SimulatedEngine, build_scheduler
    from kvfabric.sim.workload import unique_cold_workload

    scheduler = build_scheduler(num_blocks, max_num_seqs=16, max_num_batched_tokens=2048, load_plugins=False)
    if policy != "lru" or events:
        env = {"KVFABRIC_EVICTION_POLICY": policy, "KVFABRIC_SINK": "none", "KVFABRIC_ADMISSION_ANCHOR_BLOCKS": "0"}
        if events:
            env["KVFABRIC_LIFECYCLE"] = "1"
        inst = build_hook(scheduler.kv_cache_manager, load_hook_settings(env), scheduler=scheduler,
                          engine="bench", outlet=NullOutlet())
        assert inst is not None
    engine = SimulatedEngine(scheduler, "zero", track_evictions=False)
    engine.add_workload(unique_cold_workload(seed, num_requests=requests))
    engine.run_until_done()
    return engine.stats.wall_s


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--num-blocks", type=int, default=400, help="pool size (16-token blocks); small = evicting")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    from kvfabric.policies import POLICY_NAMES

    configs = [("lru", False)] + [(p, False) for p in POLICY_NAMES if p != "lru"]
    configs += [("lru", True)] + [(p, True) for p in POLICY_NAMES if p != "lru"]
    samples: dict[tuple[str, bool], list[float]] = {c: [] for c in configs}
    run_once("lru", False, 20, args.num_blocks, 99)  # warm imports and caches
    for r in range(args.repeats):
        for policy, events in configs:
            samples[(policy, events)].append(run_once(policy, events, args.requests, args.num_blocks, seed=r))
        print(f"round {r + 1}/{args.repeats} done", file=sys.stderr, flush=True)
    med = {c: statistics.median(v) for c, v in samples.items()}
    lines = [
        "# Scheduler time per policy on traffic with no sharing",
        "",
        f"Command: `python benchmarks/bench_policy_overhead.py {' '.join(sys.argv[1:] if argv is None else argv)}`",
        f"Machine: {platform.node()}, {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}",
        "",
        f"`unique_cold_workload` ({args.requests} requests, 256-1024 prompt tokens, 16-64 output tokens), pool of "
        f"{args.num_blocks} blocks (every admission evicts), zero-latency model; CPU seconds of schedule() + "
        f"update_from_output(), median of {args.repeats} interleaved runs (min-max in brackets).",
        "",
        "| configuration | scheduler s | vs baseline | baseline |",
        "|---|---|---|---|",
    ]
    for policy, events in configs:
        base = med[("lru", events)]
        v = samples[(policy, events)]
        label = policy + (" +events" if events else "")
        lines.append(
            f"| {label} | {med[(policy, events)]:.3f} [{min(v):.3f}-{max(v):.3f}] | "
            f"{med[(policy, events)] / base:.3f}x | {'lru (no hook)' if not events else 'lru +events'} |"
        )
    report = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(report)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
