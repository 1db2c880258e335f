#!/usr/bin/env python3
"""Write ``benchmarks/results/gpu_h200.md`` from the files ``h200_overhead.py`` brought back from the H200.

    python benchmarks/gpu/overhead_table.py [--dir benchmarks/results/gpu/overhead] \
        [--out benchmarks/results/gpu_h200.md]

Each run is a ``<run>-summary.json`` (written by ``h200_overhead.py``) in ``--dir``; ``RUNS`` below names the command
that made it. Raw py-spy profiles (``<run>-profile-<arm>.txt.gz``, collapsed stacks) get a table of where the
EngineCore's samples went in KVFabric's own frames.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import math
from pathlib import Path
from typing import Any

#: run -> (what it is, the command on the GPU machine; PYTHONPATH=$PWD:/tmp/site, VLLM_USE_FLASHINFER_SAMPLER=0).
RUNS: dict[str, tuple[str, str]] = {
    "8b-r1": ("Llama-3-8B shape, 5 rounds, revision 537d192",
              "python3 benchmarks/gpu/h200_overhead.py --out /tmp/o8 --shape llama-3-8b --rounds 5 --scale 1.5 "
              "--arms plain,kv_events,lru,lru_before --before .gpu/before"),
    "8b-r2": ("Llama-3-8B shape, 4 rounds, with the recording-only arm and py-spy, revision 537d192",
              "python3 benchmarks/gpu/h200_overhead.py --out /tmp/d8 --shape llama-3-8b --rounds 4 --scale 1.5 "
              "--arms plain,lru,lru_nosink,lru_before --before .gpu/before --profile 8"),
    "q05b": ("Qwen2-0.5B shape, 5 rounds, revision 537d192",
             "python3 benchmarks/gpu/h200_overhead.py --out /tmp/q5 --shape qwen2-0.5b --rounds 5 --scale 3 "
             "--arms plain,kv_events,lru,lru_nosink"),
    "8b-r4": ("Llama-3-8B shape, 5 rounds, revision f9589de (this session's hook: no scheduler wrappers, no "
              "__class__ swaps, hand-over every 100 ms)",
              "python3 benchmarks/gpu/h200_overhead.py --out /tmp/o8 --shape llama-3-8b --rounds 5 --scale 1.5 "
              "--arms plain,kv_events,lru,lru_nosink"),
    "8b-r5": ("Llama-3-8B shape, 8 rounds, revision a01d0ae",
              "python3 benchmarks/gpu/h200_overhead.py --out /tmp/o8 --shape llama-3-8b --rounds 8 --scale 1.5 "
              "--arms plain,kv_events,lru,lru_nosink"),
    "q05b-r2": ("Qwen2-0.5B shape, 6 rounds, revision a01d0ae, plain in the first engine slot",
                "python3 benchmarks/gpu/h200_overhead.py --out /tmp/q5 --shape qwen2-0.5b --rounds 6 --scale 3 "
                "--arms plain,kv_events,lru,lru_nosink"),
    "q05b-r3": ("Qwen2-0.5B shape, 5 rounds, revision a01d0ae, the engine slots reversed (plain last)",
                "python3 benchmarks/gpu/h200_overhead.py --out /tmp/q6 --shape qwen2-0.5b --rounds 5 --scale 3 "
                "--arms lru,kv_events,lru_nosink,plain"),
    "q05b-r4": ("Qwen2-0.5B shape, 6 rounds, revision 049013f, the running arm pinned to cores 0-7 and idle arms and "
                "the collector to cores 8-15 (`--pin`, the default since)",
                "python3 benchmarks/gpu/h200_overhead.py --out $OUT/q05b-r4 --shape qwen2-0.5b --rounds 6 --scale 3 "
                "--arms plain,kv_events,lru,lru_nosink"),
    "q05b-r5": ("Qwen2-0.5B shape, 6 rounds, revision 049013f, pinned, the engine slots reversed (plain last)",
                "python3 benchmarks/gpu/h200_overhead.py --out $OUT/q05b-r5 --shape qwen2-0.5b --rounds 6 --scale 3 "
                "--arms lru,kv_events,lru_nosink,plain"),
    "8b-r6": ("Llama-3-8B shape, 6 rounds, revision 049013f, pinned",
              "python3 benchmarks/gpu/h200_overhead.py --out $OUT/8b-r6 --shape llama-3-8b --rounds 6 --scale 1.5 "
              "--arms plain,kv_events,lru,lru_nosink"),
    "8b-r7": ("Llama-3-8B shape, 6 rounds, revision e044d86, pinned, with `adaptive_aging` steering",
              "python3 benchmarks/gpu/h200_overhead.py --out $OUT/8b-r7 --shape llama-3-8b --rounds 6 --scale 1.5 "
              "--arms plain,lru,adaptive_aging"),
    "8b-r8": ("Llama-3-8B shape, 6 rounds, revision e044d86, pinned, the engine slots reversed (plain last)",
              "python3 benchmarks/gpu/h200_overhead.py --out $OUT/8b-r8 --shape llama-3-8b --rounds 6 --scale 1.5 "
              "--arms adaptive_aging,lru,plain"),
    "q05b-r6": ("Qwen2-0.5B shape, 5 rounds, revision e044d86, pinned, with `adaptive_aging` steering",
                "python3 benchmarks/gpu/h200_overhead.py --out $OUT/q05b-r6 --shape qwen2-0.5b --rounds 5 --scale 3 "
                "--arms plain,lru,adaptive_aging"),
    "q05b-r7": ("Qwen2-0.5B shape, 5 rounds, revision e044d86, pinned, the engine slots reversed (plain last)",
                "python3 benchmarks/gpu/h200_overhead.py --out $OUT/q05b-r7 --shape qwen2-0.5b --rounds 5 --scale 3 "
                "--arms adaptive_aging,lru,plain"),
    "q05b-r8": ("Qwen2-0.5B shape, 5 rounds, revision cf5f3b9 (`adaptive_aging`'s cheaper free path, victims in the "
                "allocation's record), pinned, with `adaptive_aging` steering",
                "python3 benchmarks/gpu/h200_overhead.py --out $OUT/q05b-r8 --shape qwen2-0.5b --rounds 5 --scale 3 "
                "--arms plain,lru,adaptive_aging"),
    "q05b-r9": ("Qwen2-0.5B shape, 5 rounds, revision cf5f3b9, pinned, the engine slots reversed (plain last)",
                "python3 benchmarks/gpu/h200_overhead.py --out $OUT/q05b-r9 --shape qwen2-0.5b --rounds 5 --scale 3 "
                "--arms adaptive_aging,lru,plain"),
    "8b-r9": ("Llama-3-8B shape, 5 rounds, revision 4c437c0 (the compiled pool hooks, built on the GPU machine with "
              "`benchmarks/gpu/staging/build_ext.sh`: gcc over `_recorder.c` and `_order.c`), pinned",
              "python3 benchmarks/gpu/h200_overhead.py --out /tmp/o9 --shape llama-3-8b --rounds 5 --scale 1.5 "
              "--arms plain,kv_events,lru,lru_python"),
    "8b-r10": ("Llama-3-8B shape, 5 rounds, revision 4c437c0 (compiled pool hooks), pinned, the engine slots reversed "
               "(plain last)",
               "python3 benchmarks/gpu/h200_overhead.py --out /tmp/o10 --shape llama-3-8b --rounds 5 --scale 1.5 "
               "--arms lru_python,lru,kv_events,plain"),
}

#: Runs of one revision and shape with the arms in opposite engine slots: taken together, the slot's effect cancels
#: better (on the 0.5B shape, plain in the first slot beat every arm in every round, and in the last slot lost to
#: them on average).
POOLS: dict[str, tuple[str, ...]] = {
    "q05b-r2+r3": ("q05b-r2", "q05b-r3"),
    "q05b-r4+r5 (pinned)": ("q05b-r4", "q05b-r5"),
    "8b-r7+r8 (adaptive_aging)": ("8b-r7", "8b-r8"),
    "q05b-r6+r7 (adaptive_aging)": ("q05b-r6", "q05b-r7"),
    "q05b-r8+r9 (adaptive_aging, revision cf5f3b9)": ("q05b-r8", "q05b-r9"),
    "8b-r9+r10 (compiled pool hooks, revision 4c437c0)": ("8b-r9", "8b-r10"),
}

ARM_TEXT = {
    "plain": "vLLM alone (plugin installed, no `KVFABRIC_*`)",
    "kv_events": "vLLM's own KV-event publisher (ZMQ), drained",
    "lru": "KVFabric streaming to a collector (the run's revision)",
    "lru_nosink": "KVFabric recording, `KVFABRIC_SINK=none` (the run's revision)",
    "lru_python": "KVFabric streaming, the Python hooks (`KVFABRIC_NATIVE=0`; the run's revision)",
    "lru_before": "KVFabric streaming, revision fab6a7f (before issue 7)",
    "adaptive_aging": "KVFabric streaming with `adaptive_aging` steering (the run's revision)",
}


def profile_shares(path: Path) -> tuple[int, list[tuple[str, float]]]:
    """(samples, [(KVFabric frame, % of samples spent in that frame itself)]) of a collapsed-stack profile.

    Only self time in KVFabric's frames counts: the wrappers' inclusive time holds vLLM's own work below them."""
    own: collections.Counter[str] = collections.Counter()
    total = 0
    with gzip.open(path, "rt") as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            c = int(count)
            total += c
            leaf = stack.split(";")[-1]
            if "kvfabric/" in leaf:
                own[leaf] += c
    return total, [(f, 100.0 * c / total) for f, c in own.most_common(8)] if total else []


def _f(x: float | None, fmt: str) -> str:
    # A negative CPU delta means the process of that role was replaced during the round (not measurable).
    return "-" if x is None else "n/a" if x < 0 else format(x, fmt)


def run_table(summary: dict[str, Any]) -> list[str]:
    lines = ["| arm | what | wall mean s | min-max s | spread | wall vs plain | tok/s vs plain | outputs = plain | "
             "EngineCore CPU s | forwarder CPU s | prefix-cache hit tokens per round |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for arm, e in summary["arms"].items():
        cpu = e.get("cpu_s_mean", {})
        hits = e.get("cached_tokens") or []
        lines.append(
            f"| {arm} | {ARM_TEXT.get(arm, arm)} | {e['wall_mean_s']:.2f} | "
            f"{e['wall_min_s']:.2f}-{e['wall_max_s']:.2f} | {100 * e['wall_spread']:.1f}% | "
            f"{_f(e.get('wall_vs_plain'), '.3f')}x | "
            f"{_f(e.get('throughput_vs_plain'), '.3f')}x | {e.get('outputs_identical_to_plain')} | "
            f"{_f(cpu.get('engine_core'), '.2f')} | {_f(cpu.get('forwarder'), '.2f')} | "
            f"{', '.join(sorted({f'{h:,}' for h in hits})) if hits else '-'} |")
    return lines


def pool_table(pool: str, names: tuple[str, ...], summaries: list[dict[str, Any]]) -> list[str]:
    """Each arm's tokens/s ratio to plain in each run (a run's own plain: the machine's speed differed between
    runs), and their geometric mean: with the arms in opposite engine slots, the slot's own effect cancels in it."""
    if len(summaries) < 2:
        return []
    lines = [f"## {pool}: the runs together (engine slots in opposite orders)", "",
             "| arm | " + " | ".join(f"tok/s vs plain, {n}" for n in names) + " | geometric mean | "
             "EngineCore CPU s vs plain, geometric mean |",
             "|---|" + "---|" * (len(names) + 2)]

    def core_s(s: dict[str, Any], arm: str) -> float | None:
        return s["arms"][arm].get("cpu_s_mean", {}).get("engine_core")

    for arm in summaries[0]["arms"]:
        ratios = [s["arms"][arm]["throughput_vs_plain"] for s in summaries]
        cores = [(core_s(s, arm), core_s(s, "plain")) for s in summaries]
        cpu = (math.prod(a / b for a, b in cores) ** (1 / len(cores))
               if all(a and b for a, b in cores) else None)
        lines.append(f"| {arm} | " + " | ".join(f"{r:.3f}x" for r in ratios)
                     + f" | {math.prod(ratios) ** (1 / len(ratios)):.3f}x | {_f(cpu, '.3f')}x |")
    return [*lines, ""]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="benchmarks/results/gpu/overhead")
    ap.add_argument("--out", default="benchmarks/results/gpu_h200.md")
    args = ap.parse_args()
    d = Path(args.dir)
    lines = [
        "# The hook on the real vLLM 0.26.0 engine, one H200",
        "",
        "Written by `python benchmarks/gpu/overhead_table.py` from the files `benchmarks/gpu/h200_overhead.py` brought",
        f"back (`{args.dir}/`). Dates of the runs: 2026-12-01 and 2026-12-02. Machine: one NVIDIA H200",
        "(143,771 MiB), 16 CPU cores, Python 3.12, torch 2.11, vLLM 0.26.0 and this project's wheel staged by",
        "benchmarks/gpu/staging/README.md",
        "(PYTHONPATH=$PWD:/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONHASHSEED=0).",
        "",
        "Method: every arm is one `vllm.LLM` engine (dummy weights, torch.compile + CUDA graphs, 1,500 KV blocks,",
        "`max_num_seqs=64`, greedy) resident in its own process for the whole run, all started side by side; each",
        "round runs the same seeded `demo_workload` (scale given) once per arm, in an order that alternates between",
        "rounds, from an empty prefix cache. Wall = `llm.generate` of the whole workload. CPU seconds are per round",
        "(psutil, user + system). Since q05b-r4 the arm that runs is pinned, with every thread of its process tree,",
        "to cores 0-7 and every idle arm and the collector to cores 8-15 (`--pin`): before, where an engine's",
        "processes happened to land moved whole arms by 20-40 % on the CPU-bound 0.5B shape (q05b-r2 against",
        "q05b-r3, one revision in opposite slots). Earlier results of `benchmarks/gpu/h200_engine.py` (one fresh",
        "engine per arm): `benchmarks/results/gpu_h200_engine.md`.",
        "",
    ]
    for run, (what, cmd) in RUNS.items():
        path = d / f"{run}-summary.json"
        if not path.exists():
            lines += [f"## {run}: {what}", "", f"(no `{path.name}`)", ""]
            continue
        s = json.loads(path.read_text())
        lines += [f"## {run}: {what}", "", f"`{cmd}`", "",
                  f"{s['rounds']} rounds, workload scale {s['scale']}, {s['num_blocks']} blocks; engines ready in "
                  f"{s['engines_start_s']:.0f} s.", ""]
        lines += run_table(s)
        runs = s.get("collector_runs")
        if isinstance(runs, list):
            for r in runs:
                lines += ["", f"Collector: run `{r['run_id']}` stored {r['events']:,} events over all rounds, "
                              f"{r['sequence_gaps']} sequence gaps."]
        for prof in sorted(d.glob(f"{run}-profile-*.txt.gz")):
            arm = prof.name.removeprefix(f"{run}-profile-").removesuffix(".txt.gz")
            total, shares = profile_shares(prof)
            lines += ["", f"py-spy, EngineCore of `{arm}` ({total:,} samples at 200 Hz over one round): self time in "
                          f"KVFabric's frames {sum(p for _, p in shares):.2f}% of samples", "",
                      "| frame | % of samples |", "|---|---|"]
            lines += [f"| `{f}` | {p:.2f} |" for f, p in shares]
        lines.append("")
    for pool, members in POOLS.items():
        if all((d / f"{m}-summary.json").exists() for m in members):
            lines += pool_table(pool, members, [json.loads((d / f"{m}-summary.json").read_text()) for m in members])
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
