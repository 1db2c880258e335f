"""What one call of the steering hook costs inside vLLM's step, against the same call warm and cold.

Usage::

    python benchmarks/bench_hook_calls.py [--steps N] [--samples 300] [--out benchmarks/results/hook_calls.md]

Runs the CPU demo workload of ``bench_hook_overhead.py`` (vLLM 0.33's real scheduler, 640 blocks, zero-latency
model) once with ``adaptive_aging`` and lifecycle recording (sink ``none``), timing each of steering's entry points
per call with ``perf_counter_ns`` (about 0.1 µs per reading): the statistics keeper's record handlers, those it
has (a free's and a touch's include following the record into the victim index; a keeper that follows no sealing
has no seal handler, so that row is absent), the free list's ``popleft_n`` (of one block, and of several: a
prompt's), and the two halves of vLLM's usual eviction, one block per call: the index's ``pop`` and the policy's
``on_evicted``. Those are *in place*: each call runs between stretches of vLLM's own work, which uses the caches in
between.

Then, on the run's final state, two of those calls are timed again ``--samples`` times each: taking one victim
(``pop``, at most half the candidates left) and entering one eviction (``on_evicted`` of one block):

* *warm*: back to back, so the code and data they touch are in the CPU's caches;
* *cold*: each after writing one byte per 64 of a 32 MiB buffer, which pushes them out.

The ratio says what the hook's time is made of. If an in-place call costs several warm ones and approaches a cold
one, its time is mostly the memory it touches for the first time since its last call (code, objects, the
interpreter's caches), not the instructions it executes: removing instructions then saves little, and removing
whole calls, or the data they touch, is what pays. Timings, unlike ``bench_hook_bytecode.py``'s counts, move with
the machine: compare ratios within one run.

Writes ``--out`` (Markdown) and, next to it, the same name with ``.json``: every entry point's calls and medians,
with the command, machine, date (UTC) and the 1-minute load average at the start and the end (timings move with
what else runs on the machine).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

ENV = {"KVFABRIC_LIFECYCLE": "1", "KVFABRIC_SINK": "none", "KVFABRIC_EVICTION_POLICY": "adaptive_aging"}
THRASH_BYTES = 32 << 20


def _timed_by(samples_for: Callable[..., list[int]], fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with each call's duration (ns) appended to the list ``samples_for(*args)`` names."""
    from time import perf_counter_ns

    def call(*args: Any) -> Any:
        t0 = perf_counter_ns()
        try:
            return fn(*args)
        finally:
            samples_for(*args).append(perf_counter_ns() - t0)

    return call


def _timed(samples: list[int], fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with each call's duration (ns) appended to ``samples``."""
    return _timed_by(lambda *args: samples, fn)


def in_place(steps: int | None) -> tuple[Any, dict[str, list[int]], int]:
    """Run the workload with steering's entry points timed. Returns the engine, the samples, steps run."""
    from kvfabric.contract import records as R
    from kvfabric.sim.harness import SimulatedEngine
    from kvfabric.sim.workload import demo_workload

    os.environ.update(ENV)
    engine = SimulatedEngine.create(640, "zero", track_evictions=False, load_plugins=True)
    engine.add_workload(demo_workload(seed=0))
    inst = getattr(engine.scheduler, "_kvfabric", None)
    st = getattr(inst, "steering", None)
    if st is None or st.index is None or st.keeper is None or st.on_evicted_one is None:
        raise SystemExit("adaptive_aging's steering was not attached as expected")
    samples: dict[str, list[int]] = collections.defaultdict(list)
    keeper = st.keeper
    for op, name in ((R.FREED, "free record (keeper + victim index)"), (R.TOUCHED, "touch record (keeper + index)"),
                     (R.SEALED, "seal record (keeper)"), (R.ALLOCATED, "allocation record (keeper)")):
        handler = keeper._handlers.get(op)
        if handler is not None:
            keeper._handlers[op] = _timed(samples[name], handler)
    keeper.handler = keeper._handlers.get  # (the recorder looks handlers up through this)
    queue = engine.scheduler.kv_cache_manager.block_pool.free_block_queue
    # One block per call (a decoding request's next block) and several (a prompt's blocks), apart: the first goes
    # through steering's one-block path, the second through the general one.
    queue.popleft_n = _timed_by(lambda n: samples["free list popleft_n(1)" if n == 1 else "free list popleft_n(many)"],
                                queue.popleft_n)
    st.index.pop = _timed(samples["victim index pop()"], st.index.pop)
    st.on_evicted_one = _timed(samples["policy on_evicted, one block"], st.on_evicted_one)
    done = 0
    while engine.has_unfinished() and (steps is None or done < steps):
        engine.step()
        done += 1
    inst.close()
    return engine, samples, done


def warm_and_cold(engine: Any, n: int) -> dict[str, dict[str, list[int]]]:
    """Time ``pop()`` and ``on_evicted`` of one block on the final state, back to back and after a thrash."""
    from time import perf_counter_ns

    st = engine.scheduler.kv_cache_manager.block_pool._kvfabric_steering
    index, policy = st.index, st.policy
    index.__dict__.pop("pop", None)  # (the in-place timer)
    table = index.owner.table
    cached = [b for b in range(index.num_blocks) if table.hash[b] is not None]
    if index.size < 2 or not cached:
        raise SystemExit("the run ended with no cached candidates to time (use more --steps)")
    buf = bytearray(THRASH_BYTES)
    ones = bytes(len(buf[::64]))
    out: dict[str, dict[str, list[int]]] = {"victim index pop()": {"warm": [], "cold": []},
                                            "policy on_evicted, one block": {"warm": [], "cold": []}}
    pops = min(n, index.size // 2)  # (each pop takes a candidate for good: putting it back would move others)
    for kind in ("warm", "cold"):
        for i in range(n):
            if i < pops:
                if kind == "cold":
                    buf[::64] = ones
                t0 = perf_counter_ns()
                index.pop()
                out["victim index pop()"][kind].append(perf_counter_ns() - t0)
            if kind == "cold":
                buf[::64] = ones
            b = cached[i % len(cached)]
            t0 = perf_counter_ns()
            policy.on_evicted(table, b, index.now)
            out["policy on_evicted, one block"][kind].append(perf_counter_ns() - t0)
    return out


def _us(ns: list[int]) -> float:
    return round(statistics.median(ns) / 1000, 2) if ns else 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=None, help="stop the run after this many steps (default: all)")
    ap.add_argument("--samples", type=int, default=300, help="warm and cold calls timed, of each (default 300)")
    ap.add_argument("--out", default="benchmarks/results/hook_calls.md", help="results file ('' for none)")
    args = ap.parse_args()
    if args.samples < 1:
        ap.error("--samples must be at least 1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    started = time.monotonic()
    load_start = os.getloadavg()[0]
    engine, samples, done = in_place(args.steps)
    print(f"run: {done} steps in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    again = warm_and_cold(engine, args.samples)
    summary: dict[str, Any] = {"steps": done, "samples": args.samples}
    command = "python benchmarks/bench_hook_calls.py " + " ".join(sys.argv[1:])
    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    loads = [round(load_start, 2), round(os.getloadavg()[0], 2)]
    entries: list[dict[str, Any]] = []
    lines = [
        "# One steering call inside vLLM's step, against warm and cold (CPU demo workload, `adaptive_aging`)",
        "",
        f"Command: `{command.strip()}`  ",
        f"Machine: {machine}, {date}; 1-minute load average {loads[0]:.2f} at the start, {loads[1]:.2f} at the end  ",
        "What: median µs per call, in place (inside the run) and, for two of them, on the final state back to back "
        "(warm) and after a 32 MiB cache thrash (cold); see the script's docstring.",
        "",
        "| entry point | calls | in place, median µs | in place, total ms | warm µs | cold µs | in place / warm |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, ns in samples.items():
        row = again.get(name)
        warm = _us(row["warm"]) if row else None
        cold = _us(row["cold"]) if row else None
        key = name.split(" (")[0].replace(" ", "_").replace(",", "").replace("(1)", "_1").replace("(many)", "_many")
        key = key.replace("()", "")
        summary[f"{key}_calls"] = len(ns)
        summary[f"{key}_in_place_us"] = _us(ns)
        if row:
            summary[f"{key}_warm_us"] = warm
            summary[f"{key}_cold_us"] = cold
        entries.append({"entry_point": name, "calls": len(ns), "in_place_median_us": _us(ns),
                        "in_place_total_ms": round(sum(ns) / 1e6, 1), "warm_us": warm, "cold_us": cold})
        ratio = f"{_us(ns) / warm:.1f}x" if warm else "-"
        lines.append(f"| `{name}` | {len(ns):,} | {_us(ns)} | {sum(ns) / 1e6:.1f} | {warm if row else '-'} | "
                     f"{cold if row else '-'} | {ratio} |")
    lines += ["", "JSON:", "", "```", json.dumps(summary, sort_keys=True), "```", ""]
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write("\n".join(lines))
        data = {"command": command.strip(), "machine": machine, "date": date, "load_average_1m": loads,
                "steps": done, "samples": args.samples, "entry_points": entries, "summary": summary}
        with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
            f.write(json.dumps(data, indent=1) + "\n")
    print("\n".join(lines[7:-5]))
    print(json.dumps(summary, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
