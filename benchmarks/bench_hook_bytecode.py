"""The hook's cost in Python bytecode: a noise-free companion to ``bench_hook_overhead.py``.

Usage::

    python benchmarks/bench_hook_bytecode.py [--modes plain,recording,adaptive_aging] [--steps N]
                                             [--out benchmarks/results/hook_bytecode.md]

Each mode runs the same CPU demo workload as ``bench_hook_overhead.py`` (vLLM 0.33's real scheduler, 640 blocks,
zero-latency model) once, in its own process, with a tracer that counts every bytecode instruction the
interpreter executes in the engine's steps, by where its code lives: vLLM, KVFabric (the hook, steering, policies),
the simulated engine driving them, and everything else (the standard library, torch). The counts repeat from run
to run but for the records' hand-overs, which follow the clock (a few dozen instructions in millions): they do not
move with the machine's speed, which on a shared 2-core machine swings from one round to the next by more than
the effects worth measuring here. They are not time: instructions differ in cost (a call
costs more than a local load), so a change is judged by both benchmarks, this one saying what changed and the
timed one how much it was worth. Lifecycle events are recorded with sink ``none`` (the forwarder is another
process: its work is not the scheduler thread's). Compiled code executes no bytecode: where the compiled parts
are built (kvfabric/policies/native_index.py, kvfabric/engine/compiled.py), the victim index's work, the free path's
one pass and the recording of the four frequent pool calls are not in these counts at all; the timed benchmark
and ``bench_hook_calls.py`` see them (``KVFABRIC_NATIVE=0`` counts the Python code instead). Tracing makes a run
~30x slower (minutes per mode).

Writes ``--out`` (Markdown) and, next to it, the same name with ``.json``: every mode's counts by group and its most
executed KVFabric functions, with the command, machine, date (UTC) and the 1-minute load average at the start and
the end (counts do not depend on the load; the run's duration does).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

GROUPS = ("vllm", "kvfabric", "simulated engine", "other")
MODES: dict[str, dict[str, str]] = {
    "plain": {},
    "recording": {"KVFABRIC_LIFECYCLE": "1", "KVFABRIC_SINK": "none"},
    "adaptive_aging": {"KVFABRIC_LIFECYCLE": "1", "KVFABRIC_SINK": "none",
                       "KVFABRIC_EVICTION_POLICY": "adaptive_aging"},
}


def _group(filename: str) -> str:
    if f"{os.sep}kvfabric{os.sep}sim{os.sep}" in filename:
        return "simulated engine"
    if f"{os.sep}kvfabric{os.sep}" in filename:
        return "kvfabric"
    if f"{os.sep}vllm{os.sep}" in filename:
        return "vllm"
    return "other"


def count_mode(mode: str, steps: int | None) -> dict[str, Any]:
    """Run ``mode`` in this process under the tracer: bytecode counts per group and per KVFabric function."""
    from kvfabric.sim.harness import SimulatedEngine
    from kvfabric.sim.workload import demo_workload

    os.environ.update(MODES[mode])  # (a process of its own: vLLM loads plugins once per process)
    # The timed benchmark's engine and workload ("plain" loads no plugin at all, as there).
    engine = SimulatedEngine.create(640, "zero", track_evictions=False, load_plugins=mode != "plain")
    engine.add_workload(demo_workload(seed=0))
    inst = getattr(engine.scheduler, "_kvfabric", None)
    if (mode != "plain") != (inst is not None) or (inst is not None and (mode == "adaptive_aging")
                                                      != (inst.steering is not None)):
        raise SystemExit(f"{mode}: the hook was not built as asked")
    groups: collections.Counter[str] = collections.Counter()
    functions: collections.Counter[str] = collections.Counter()
    names: dict[Any, tuple[str, str | None]] = {}

    def on_opcode(frame: Any, event: str, arg: Any) -> Any:
        if event == "opcode":
            group, name = names[frame.f_code]
            groups[group] += 1
            if name is not None:
                functions[name] += 1
        return on_opcode

    def on_call(frame: Any, event: str, arg: Any) -> Any:
        code = frame.f_code
        if code not in names:
            group = _group(code.co_filename)
            names[code] = (group, f"{os.path.basename(code.co_filename)}:{code.co_name}" if group == "kvfabric"
                           else None)
        frame.f_trace_opcodes = True
        return on_opcode

    done = 0
    sys.settrace(on_call)
    try:
        while engine.has_unfinished() and (steps is None or done < steps):
            engine.step()
            done += 1
    finally:
        sys.settrace(None)
    if inst is not None:
        inst.close()
    return {"mode": mode, "steps": done, "groups": dict(groups), "kvfabric_top": functions.most_common(15)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--steps", type=int, default=None, help="stop each run after this many steps (default: all)")
    ap.add_argument("--out", default="benchmarks/results/hook_bytecode.md")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # (internal: count one mode, print JSON)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.one:
        print(json.dumps(count_mode(args.one, args.steps)))
        return 0
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        ap.error(f"unknown mode(s) {', '.join(unknown)} (known: {', '.join(MODES)})")
    started = time.monotonic()
    load_start = os.getloadavg()[0]

    def run(mode: str) -> dict[str, Any]:
        cmd = [sys.executable, os.path.abspath(__file__), "--one", mode]
        if args.steps is not None:
            cmd += ["--steps", str(args.steps)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise SystemExit(f"{mode}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
        print(f"{mode}: done in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
        return json.loads(proc.stdout.strip().splitlines()[-1])

    with ThreadPoolExecutor(max_workers=max(1, min(len(modes), (os.cpu_count() or 1)))) as pool:
        results = {r["mode"]: r for r in pool.map(run, modes)}
    total = {m: sum(r["groups"].values()) for m, r in results.items()}
    base = total.get("plain")
    summary: dict[str, Any] = {f"{m}_opcodes": t for m, t in total.items()}
    if base:
        summary |= {f"{m}_vs_plain": round(t / base, 4) for m, t in total.items() if m != "plain"}
    summary |= {f"{m}_kvfabric_opcodes": r["groups"].get("kvfabric", 0) for m, r in results.items()}

    command = "python benchmarks/bench_hook_bytecode.py " + " ".join(sys.argv[1:])
    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    loads = [round(load_start, 2), round(os.getloadavg()[0], 2)]
    lines = [
        "# The hook's cost in bytecode (CPU demo workload)",
        "",
        f"Command: `{command.strip()}`  ",
        f"Machine: {machine}, {date}; 1-minute load average {loads[0]:.2f} at the start, {loads[1]:.2f} at the end "
        f"({time.monotonic() - started:.0f} s)  ",
        "What: Python bytecode instructions executed in the engine's steps, by where the code lives (repeatable but "
        "for the clock-driven hand-overs; see the script's docstring for what they are and are not).",
        "",
        "| mode | steps | " + " | ".join(GROUPS) + " | total | vs plain |",
        "|---|---|" + "---|" * len(GROUPS) + "---|---|",
    ]
    for m in modes:
        r = results[m]
        ratio = f"{total[m] / base:.4f}x" if base else "-"
        lines.append(f"| {m} | {r['steps']:,} | " + " | ".join(f"{r['groups'].get(g, 0):,}" for g in GROUPS)
                     + f" | {total[m]:,} | {ratio} |")
    for m in modes:
        if results[m]["kvfabric_top"]:
            lines += ["", f"KVFabric's most executed functions, `{m}`:", "", "| function | instructions |",
                      "|---|---|"]
            lines += [f"| `{name}` | {n:,} |" for name, n in results[m]["kvfabric_top"]]
    lines += ["", "JSON:", "", "```", json.dumps(summary, sort_keys=True), "```", ""]
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write("\n".join(lines))
        data = {"command": command.strip(), "machine": machine, "date": date, "load_average_1m": loads,
                "seconds": round(time.monotonic() - started), "steps": args.steps, "groups": list(GROUPS),
                "modes": [results[m] | {"total": total[m]} for m in modes], "summary": summary}
        with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
            f.write(json.dumps(data, indent=1) + "\n")
    print("\n".join(lines[:8 + len(modes)]))
    print(json.dumps(summary, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
