"""Scheduler time under each policy on traffic with no sharing (``ordinary_unique_cold``): the policy must cost ~0.

vLLM's real Scheduler runs :func:`kvfabric.sim.workload.unique_cold_workload` (random prompts that share nothing)
on a pool small enough that every allocation evicts. The figure is the CPU time of ``schedule()`` +
``update_from_output()`` summed over the run (the harness measures exactly that), for:

* ``lru``: vLLM without the hook (the baseline);
* each policy with lifecycle recording off (what ``KVFABRIC_EVICTION_POLICY=<p>`` alone installs);
* ``lru +events`` and ``<p> +events``: lifecycle recording on (call records made and handed over every step, then
  dropped: the hot path's whole cost without a forwarder), where the policy's own cost is the difference.

Runs are interleaved (round robin over configurations, ``--repeats`` rounds) and each configuration's median is
reported with its ratio to its baseline, and with the range of each round's own ratio (a round's runs ran under the
same machine speed). The target (docs/design.md §9: a policy costs at most 1 % more scheduler time than LRU on
traffic without sharing) is judged as ``bench_hook_overhead`` judges its targets: *met* when every round's ratio is
at or under it, *not met* when every one is over it, *undecided* otherwise.

Usage: python benchmarks/bench_policy_overhead.py [--requests 400] [--repeats 5] [--out FILE.md]

``--out X.md`` also writes ``X.json``: per configuration the median, every round's seconds and ratio, the verdict;
with the command, machine, date and the 1-minute load average when the rounds began and ended.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

TARGET = 1.01
"""A policy's scheduler time over LRU's, with the same recording, on traffic without sharing (at most)."""


def verdict(ratios: list[float], target: float) -> str:
    """``met`` when every round's ratio is at or under ``target``, ``not met`` when every one is over, else
    ``undecided`` (the rule of ``bench_hook_overhead.verdict``)."""
    under = sum(r <= target for r in ratios)
    return "met" if under == len(ratios) else "not met" if under == 0 else "undecided"


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
    load_start = os.getloadavg()[0]
    run_once("lru", False, 20, args.num_blocks, 99)  # warm imports and caches
    for r in range(args.repeats):
        for policy, events in configs:
            samples[(policy, events)].append(run_once(policy, events, args.requests, args.num_blocks, seed=r))
        print(f"round {r + 1}/{args.repeats} done", file=sys.stderr, flush=True)
    med = {c: statistics.median(v) for c, v in samples.items()}
    # Each round's own ratio to the same round's baseline: the modes of a round ran under the same machine speed.
    ratios = {c: [x / b for x, b in zip(v, samples[("lru", c[1])], strict=True)] for c, v in samples.items()}
    command = f"python benchmarks/bench_policy_overhead.py {' '.join(sys.argv[1:] if argv is None else argv)}"
    lines = [
        "# Scheduler time per policy on traffic with no sharing",
        "",
        f"Command: `{command.strip()}`",
        f"Machine: {platform.node()}, {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}",
        "",
        f"`unique_cold_workload` ({args.requests} requests, 256-1024 prompt tokens, 16-64 output tokens), pool of "
        f"{args.num_blocks} blocks (every admission evicts), zero-latency model; CPU seconds of schedule() + "
        f"update_from_output(), median of {args.repeats} interleaved runs (min-max in brackets).",
        "",
        f"Target: each policy at most {TARGET:.2f}x of LRU's time with the same recording; verdict on the rounds' own "
        "ratios (met: every round at or under it; not met: every round over it; otherwise undecided).",
        "",
        "| configuration | scheduler s | vs baseline | each round vs baseline | verdict | baseline |",
        "|---|---|---|---|---|---|",
    ]
    for policy, events in configs:
        base = med[("lru", events)]
        v = samples[(policy, events)]
        label = policy + (" +events" if events else "")
        rr = ratios[(policy, events)]
        lines.append(
            f"| {label} | {med[(policy, events)]:.3f} [{min(v):.3f}-{max(v):.3f}] | "
            f"{med[(policy, events)] / base:.3f}x | {min(rr):.3f}-{max(rr):.3f} | "
            f"{'-' if policy == 'lru' else verdict(rr, TARGET)} | {'lru (no hook)' if not events else 'lru +events'} |"
        )
    report = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(report)
        result = {
            "command": command.strip(),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
            "date": time.strftime("%Y-%m-%d"),
            "load_average_1m": [round(load_start, 2), round(os.getloadavg()[0], 2)],
            "requests": args.requests, "num_blocks": args.num_blocks, "repeats": args.repeats, "target": TARGET,
            "configurations": [{
                "policy": policy, "events": events, "baseline": "lru +events" if events else "lru (no hook)",
                "median_s": round(med[(policy, events)], 4),
                "rounds_s": [round(x, 4) for x in samples[(policy, events)]],
                "vs_baseline": round(med[(policy, events)] / med[("lru", events)], 4),
                "round_ratios": [round(x, 4) for x in ratios[(policy, events)]],
                "verdict": None if policy == "lru" else verdict(ratios[(policy, events)], TARGET),
            } for policy, events in configs],
        }
        with open(os.path.splitext(args.out)[0] + ".json", "w") as fh:
            fh.write(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
