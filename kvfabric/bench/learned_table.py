"""The learned policy's part of ``python -m kvfabric.bench.policy_table``: models trained on one part of the traffic,
evaluated on another, in both directions.

Two splits, each run both ways, and no constant is fitted on the evaluated part (the model's class counts are the
only numbers learned, and they come from the training part alone):

* **across traces** (vLLM's 16-token blocks, the main sweep's capacities): a model learned from the whole
  conversation trace replays the synthetic trace, and a model learned from the synthetic trace replays the
  conversation trace. LRU, adaptive_aging and the optimum on the same (trace, capacity) come from the sweep;
* **across halves** (512-token blocks, as the robustness section, for speed): each trace's first half of rows
  trains a model evaluated on its second half, and the second half one evaluated on the first.

The models are written with ``kvfabric learn``'s code (:func:`kvfabric.learn.fit.learn`, its default features and
capacities) to ``benchmarks/results/policy_models/``. With ``--real-full-fractions``, the across-traces models
also replay the whole traces through vLLM's real scheduler.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvfabric.bench.table_rows import MissingRows, gap_closed, need, pick, resolve, trace_key, trace_name
from kvfabric.learn.fit import learn
from kvfabric.learn.source import from_trace
from kvfabric.policies.reuse_model import DEFAULT_FEATURES

MODELS_DIR = "benchmarks/results/policy_models"
HALF_BLOCK_SIZE = 512


def _rows(path: str) -> int:
    with open(resolve(path)) as fh:
        return sum(1 for line in fh if line.strip())


def model_tasks(traces: Sequence[str], block_size: int, models_dir: str) -> list[dict[str, Any]]:
    """What to train: each whole trace at ``block_size``, each half of each trace at 512-token blocks."""
    tasks = []
    for tr in traces:
        name = trace_name(tr)
        tasks.append({"policy": "learn", "num_blocks": 0, "trace": tr, "skip": 0, "limit": None,
                      "block_size": block_size, "out": f"{models_dir}/{name}.json", "split": "trace"})
        n = _rows(tr)
        half = n // 2
        for part, skip, limit in (("a", 0, half), ("b", half, n - half)):
            tasks.append({"policy": "learn", "num_blocks": 0, "trace": tr, "skip": skip, "limit": limit,
                          "block_size": HALF_BLOCK_SIZE, "out": f"{models_dir}/{name}-half-{part}.json",
                          "split": "half", "part": part})
    return tasks


def train(task: dict[str, Any]) -> dict[str, Any]:
    """One model (a worker process): the learner's own code, default features and capacities."""
    t0 = time.perf_counter()
    traffic = from_trace(resolve(task["trace"]), task["block_size"], task["skip"], task["limit"])
    model = learn(traffic, DEFAULT_FEATURES, (0.05, 0.2))
    limit = f" --limit {task['limit']}" if task["limit"] is not None else ""
    model.training["command"] = (f"kvfabric learn --trace {task['trace']} --block-size {task['block_size']}"
                                 f" --skip {task['skip']}{limit} --out {task['out']}")
    model.training["wall_s"] = round(time.perf_counter() - t0, 1)
    Path(task["out"]).parent.mkdir(parents=True, exist_ok=True)
    model.save(task["out"])
    val = model.metrics["validation"]
    return {**task, "predictive": model.predictive, "validation": val, "classes": len(model.classes),
            "favoured_classes": sum(1 for i in model.classes if model.lift(i) > 1.0),
            "base_rate": model.base_rate, "wall_s": time.perf_counter() - t0}


def eval_tasks(traces: Sequence[str], fractions: Sequence[float], block_size: int, models_dir: str,
               unique: Callable[[str, int | None, int, int], int],
               floor: Callable[[str, int | None, int, int], int]) -> list[dict[str, Any]]:
    """Replays of held-out traffic. ``unique(trace, limit, block_size, skip)`` and ``floor(...)`` size the pools
    exactly as the sweep does."""
    tasks = []
    if len(traces) == 2:
        for tr, other in ((traces[0], traces[1]), (traces[1], traces[0])):
            u = unique(tr, None, block_size, 0)
            for f in fractions:
                n = max(int(u * f), floor(tr, None, block_size, 0))
                tasks.append({"split": "trace", "trace": tr, "trained_on": other, "skip": 0, "limit": None,
                              "fraction": f, "num_blocks": n, "policy": "learned", "block_size": block_size,
                              "model": f"{models_dir}/{trace_name(other)}.json", "anchor": 0})
    for tr in traces:
        total = _rows(tr)
        half = total // 2
        for part, skip, limit, other in (("b", half, total - half, "a"), ("a", 0, half, "b")):
            u = unique(tr, limit, HALF_BLOCK_SIZE, skip)
            for f in fractions:
                n = max(int(u * f), 400, floor(tr, limit, HALF_BLOCK_SIZE, skip))
                for p in ("lru", "adaptive_aging", "optimal", "learned"):
                    task = {"split": "half", "trace": tr, "part": part, "trained_on": f"{trace_name(tr)} half {other}",
                            "skip": skip, "limit": limit, "fraction": f, "num_blocks": n, "policy": p,
                            "block_size": HALF_BLOCK_SIZE, "anchor": 0}
                    if p == "learned":
                        task["model"] = f"{models_dir}/{trace_name(tr)}-half-{other}.json"
                    tasks.append(task)
    return tasks


def real_tasks(traces: Sequence[str], fractions: Sequence[float], block_size: int, models_dir: str,
               unique: Callable[[str, int | None, int, int], int],
               floor: Callable[[str, int | None, int, int], int]) -> list[dict[str, Any]]:
    if len(traces) != 2:
        return []
    tasks = []
    for tr, other in ((traces[0], traces[1]), (traces[1], traces[0])):
        u = unique(tr, None, block_size, 0)
        for f in fractions:
            n = max(int(u * f), floor(tr, None, block_size, 0))
            tasks.append({"trace": tr, "trained_on": other, "limit": None, "fraction": f, "num_blocks": n,
                          "policy": "learned", "block_size": block_size, "anchor": 0,
                          "model": f"{models_dir}/{trace_name(other)}.json"})
    return tasks


# --------------------------------------------------------------------------------------------- rendering


def held_out_points(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Every held-out (split, trace, part, capacity) with LRU, adaptive_aging, learned and the optimum (%).
    Raises :class:`MissingRows` when a held-out replay lacks the LRU, adaptive_aging or optimum row beside it."""
    points = []
    sweep = data.get("sweep", [])
    for r in data.get("learned_eval", []):
        if r["policy"] != "learned":
            continue
        if r["split"] == "trace":
            # Matched by the trace's file name (need's trace key): results written from another checkout, or by
            # another section, hold other paths.
            base = {p: need(sweep, "sweep (beside a held-out replay)", trace=r["trace"], fraction=r["fraction"],
                            policy=p, anchor=0) for p in ("lru", "adaptive_aging", "optimal")}
        else:
            base = {p: need(data["learned_eval"], "learned_eval (beside a held-out replay)", split="half",
                            trace=r["trace"], part=r["part"], fraction=r["fraction"], policy=p)
                    for p in ("lru", "adaptive_aging", "optimal")}
        pt = {"split": r["split"], "trace": trace_name(r["trace"]), "part": r.get("part"), "fraction": r["fraction"],
              "num_blocks": r["num_blocks"], "trained_on": trace_name(r["trained_on"]) if r["split"] == "trace"
              else r["trained_on"], "learned": r["prefix_hit_rate"] * 100,
              "trust": (r.get("policy_state") or {}).get("guard_trust"),
              "learned_wasted": r["wasted_prefill_tokens"]}
        for p, v in base.items():
            pt[p] = v["prefix_hit_rate"] * 100
        pt["gap"] = pt["optimal"] - pt["lru"]
        pt["closed_learned"] = gap_closed(pt["learned"], pt["lru"], pt["optimal"])
        pt["closed_aa"] = gap_closed(pt["adaptive_aging"], pt["lru"], pt["optimal"])
        points.append(pt)
    return points


def _pct(c: float | None) -> str:
    return "-" if c is None else f"{c:.0%}"


def render(data: dict[str, Any], w: Callable[[str], None]) -> list[dict[str, Any]]:
    """The learned policy's section; none when the results hold no ``learned`` section (it was not run). When they
    do, every table in it must have rows (:class:`MissingRows` otherwise). Returns the held-out points for
    :func:`plot` (empty when there is no section)."""
    models = data.get("learned_models", [])
    if not data.get("learned_eval") and not models:
        return []
    points = held_out_points(data)
    if not points:
        raise MissingRows("learned_eval holds no replay of the learned policy: its tables would be empty")
    if not models:
        raise MissingRows("learned_models is empty while learned_eval has rows: the models table would be empty")
    w("### The learned policy on traffic it was not trained on")
    w("")
    w("`learned` (docs/design.md §6): adaptive_aging's structure, with the blocks it favours chosen by a reuse model")
    w("learned from recorded traffic (`kvfabric learn`), and an online guard that turns it back to LRU order when")
    w("it loses to LRU. Each model below was learned from one part of the traffic and replayed on the other; the")
    w("model's class counts are the only numbers it learns, and they come from the training part alone.")
    w("")
    w("Models (`benchmarks/results/policy_models/`; validation = a model of the first 80 % of the training")
    w("requests scored on the last 20 %; *predictive* = validation log loss below the base rate's, otherwise the")
    w("policy falls back to adaptive_aging's rule, content used twice):")
    w("")
    w("| model | trained on | blocks | classes (favoured) | reuse rate | validation AUC | log loss (base rate) | "
      "predictive | learn s |")
    w("|---|---|---|---|---|---|---|---|---|")
    for m in sorted(models, key=lambda m: m["out"]):
        v = m["validation"]
        part = "whole trace" if m["split"] == "trace" else f"half {m['part']} (rows {m['skip']:,}-"\
            f"{m['skip'] + m['limit']:,})"
        w(f"| `{os.path.basename(m['out'])}` | {trace_name(m['trace'])}, {part} | {m['block_size']} tokens | "
          f"{m['classes']} ({m['favoured_classes']}) | {m['base_rate']:.3f} | {v.get('auc')} | "
          f"{v.get('log_loss')} ({v.get('log_loss_base_rate')}) | {'yes' if m['predictive'] else 'no'} | "
          f"{m['wall_s']:.0f} |")
    w("")
    for split, title in (("trace", "Trained on one trace, replaying the other (16-token blocks, whole traces)"),
                         ("half", "Trained on one half of a trace, replaying the other half (512-token blocks)")):
        rows = [p for p in points if p["split"] == split]
        if not rows:
            continue
        w(f"#### {title}")
        w("")
        w("| replayed | trained on | capacity | blocks | lru | adaptive_aging | learned | optimal | gap | "
          "closed by adaptive_aging | closed by learned | guard trust at end |")
        w("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for p in sorted(rows, key=lambda p: (p["trace"], p["part"] or "", p["fraction"])):
            mark = " ↓" if p["learned"] < p["lru"] - 0.005 else ""
            replayed = p["trace"] + (f" half {p['part']}" if p["part"] else "")
            trust = "-" if p["trust"] is None else f"{p['trust']:.2f}"
            w(f"| {replayed} | {p['trained_on']} | {p['fraction']:.0%} | {p['num_blocks']:,} | {p['lru']:.2f} | "
              f"{p['adaptive_aging']:.2f} | {p['learned']:.2f}{mark} | {p['optimal']:.2f} | {p['gap']:.2f} | "
              f"{_pct(p['closed_aa'])} | {_pct(p['closed_learned'])} | {trust} |")
        w("")
    worst = min(points, key=lambda p: p["learned"] - p["lru"])
    big = [p for p in points if p["gap"] > 5]
    met = [p for p in big if (p["closed_learned"] or 0) >= 0.4]
    w("Targets on held-out traffic (every row above):")
    w("")
    w(f"* never below LRU by more than 0.2 point: worst {worst['learned'] - worst['lru']:+.2f} point "
      f"({worst['trace']}{' half ' + worst['part'] if worst['part'] else ''}, {worst['fraction']:.0%}); "
      f"{sum(1 for p in points if p['learned'] < p['lru'] - 0.2)} of {len(points)} points more than 0.2 below;")
    if big:
        best = max(big, key=lambda p: p["closed_learned"] or 0)
        w(f"* at least 40 % of the gap closed where it exceeds 5 points: {len(met)} of {len(big)} points; best "
          f"{_pct(best['closed_learned'])} ({best['trace']}{' half ' + best['part'] if best['part'] else ''}, "
          f"{best['fraction']:.0%}), median {_pct(sorted(p['closed_learned'] or 0 for p in big)[len(big) // 2])} "
          f"(adaptive_aging: median {_pct(sorted(p['closed_aa'] or 0 for p in big)[len(big) // 2])}).")
    w("")
    real = data.get("learned_real", [])
    if real:
        w("#### Through vLLM's real scheduler")
        w("")
        w("The across-traces models in `kvfabric replay` (no `--fast`, hook on, counted from the hook's events), "
          "beside fast mode's figure and the real-scheduler rows of LRU and the optimum above.")
        w("")
        w("| replayed | trained on | capacity | blocks | lru real | learned real | learned fast | optimal real | "
          "gap closed | replay wall s |")
        w("|---|---|---|---|---|---|---|---|---|---|")
        for r in sorted(real, key=lambda r: (trace_key(r["trace"]), r["fraction"])):
            fast = pick(points, split="trace", trace=trace_name(r["trace"]), fraction=r["fraction"])
            lru = pick(data.get("full_real", []), trace=r["trace"], fraction=r["fraction"], policy="lru")
            opt = pick(data.get("full_real", []), trace=r["trace"], fraction=r["fraction"], policy="optimal")
            lr = lru["prefix_hit_rate"] * 100 if lru else None
            orr = opt["prefix_hit_rate"] * 100 if opt else None
            lv = r["prefix_hit_rate"] * 100
            c = gap_closed(lv, lr, orr) if lr is not None and orr is not None else None
            lru_s = "-" if lr is None else f"{lr:.2f}"
            fast_s = "-" if fast is None else f"{fast['learned']:.2f}"
            opt_s = "-" if orr is None else f"{orr:.2f}"
            w(f"| {trace_name(r['trace'])} | {trace_name(r['trained_on'])} | {r['fraction']:.0%} | "
              f"{r['num_blocks']:,} | {lru_s} | {lv:.2f} | {fast_s} | {opt_s} | {_pct(c)} | {r['replay_wall_s']:.0f} |")
        w("")
    w("![gap closed on held-out traffic: learned vs adaptive_aging](policy-learned-gap.png)")
    w("")
    return points


def plot(points: list[dict[str, Any]], plots_dir: Path) -> None:
    """``policy-learned-gap.png``: the share of the gap closed at each held-out point."""
    if not points:
        raise MissingRows("policy-learned-gap.png: no held-out point to plot")
    import matplotlib  # matplotlib: only for plots (the Agg backend is set before pyplot loads)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # matplotlib: only for plots, after the backend is chosen

    groups: dict[str, list[dict[str, Any]]] = {}
    for p in points:
        label = (f"{p['trace']} (model: {p['trained_on']})" if p["split"] == "trace"
                 else f"{p['trace']} half {p['part']} (model: other half)")
        groups.setdefault(label, []).append(p)
    fig, axes = plt.subplots(1, len(groups), figsize=(4.2 * len(groups), 3.8), squeeze=False, sharey=True)
    for ax, (label, rows) in zip(axes[0], sorted(groups.items()), strict=True):
        rows = sorted(rows, key=lambda p: p["fraction"])
        xs = range(len(rows))
        width = 0.38
        aa = [max(-1.0, p["closed_aa"] or 0.0) * 100 for p in rows]
        le = [max(-1.0, p["closed_learned"] or 0.0) * 100 for p in rows]
        ax.bar([x - width / 2 for x in xs], aa, width, color="tab:green", label="adaptive_aging")
        ax.bar([x + width / 2 for x in xs], le, width, color="tab:blue", label="learned (held out)")
        ax.axhline(0, color="k", linewidth=0.8)
        ax.axhline(40, color="tab:red", linewidth=0.8, linestyle=":", label="target (40%)")
        ax.set_xticks(list(xs))
        ax.set_xticklabels([f"{p['fraction']:.0%}" for p in rows])
        ax.set_ylim(-20, 60)
        ax.set_title(label, fontsize=8)
        ax.set_xlabel("capacity")
        ax.grid(True, axis="y", alpha=0.3)
    axes[0][0].set_ylabel("LRU-to-optimum gap closed (%)")
    axes[0][0].legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(plots_dir / "policy-learned-gap.png", dpi=110)
    plt.close(fig)
