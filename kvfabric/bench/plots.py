"""The A/B report's PNG plots (matplotlib, headless): hit rate, TTFT CDF (overall and per traffic component),
evictions split, rebuilt over time; under ``--capacities`` hit rate and TTFT p50 against capacity. Plots of one
capacity show the primary one (:func:`kvfabric.bench.stats.primary_runs`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")  # headless: no display on servers and in CI
import matplotlib.pyplot as plt

from kvfabric.bench.stats import median, primary_runs

__all__ = ["write_plots"]

_COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C"]


def _color(policies: list[str], p: str) -> str:
    return _COLORS[policies.index(p) % len(_COLORS)]


def _hit_rate(result: dict[str, Any], path: Path) -> None:
    policies = result["policies"]
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    series = [("prefix_hit_rate", "collector (hit / prompt tokens)"), ("client_hit_rate", "client (cached / prompt)")]
    width = 0.38
    for i, (key, label) in enumerate(series):
        for j, p in enumerate(policies):
            s = result["by_policy"][p][key]
            if s["median"] is None:
                continue
            x = j + (i - 0.5) * width
            err = [[100 * (s["median"] - s["min"])], [100 * (s["max"] - s["median"])]]
            ax.bar(x, 100 * s["median"], width, color=_color(policies, p), alpha=1.0 if i == 0 else 0.55,
                   yerr=err, capsize=4, label=label if j == 0 else None, edgecolor="black", linewidth=0.4)
            ax.scatter([x] * len(s["values"]), [100 * v for v in s["values"] if v is not None], s=10, color="black",
                       zorder=3)
    ax.set_xticks(range(len(policies)), policies)
    ax.set_ylabel("prefix hit rate (%)")
    ax.set_title("Prefix hit rate (median, range, each repetition)")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _ttft_cdf(result: dict[str, Any], path: Path) -> None:
    policies = result["policies"]
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for p in policies:
        pooled: list[float] = []
        for r in primary_runs(result):
            if r["policy"] != p or not r["ttfts"]:
                continue
            xs = sorted(1000 * t for t in r["ttfts"])
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            ax.plot(xs, ys, color=_color(policies, p), alpha=0.25, linewidth=0.8)
            pooled.extend(xs)
        if pooled:
            pooled.sort()
            ax.plot(pooled, [(i + 1) / len(pooled) for i in range(len(pooled))], color=_color(policies, p),
                    linewidth=2, label=f"{p} (all repetitions)")
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("time to first token (ms, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF (thin: each repetition)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _evictions(result: dict[str, Any], path: Path) -> None:
    policies = result["policies"]
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for j, p in enumerate(policies):
        mine = [r for r in primary_runs(result) if r["policy"] == p]
        shared = median([r["evicted_shared"] for r in mine]) or 0
        private = median([r["evicted_private"] for r in mine]) or 0
        ax.bar(j, private, 0.6, color=_color(policies, p), alpha=0.45, edgecolor="black", linewidth=0.4,
               label="private tails" if j == 0 else None)
        ax.bar(j, shared, 0.6, bottom=private, color=_color(policies, p), edgecolor="black", linewidth=0.4,
               hatch="//", label="shared anchors" if j == 0 else None)
        ax.text(j, private + shared, f"{shared:,.0f} shared\n{private:,.0f} private", ha="center", va="bottom",
                fontsize=8)
    ax.set_xticks(range(len(policies)), policies)
    ax.set_ylabel("evicted blocks (median)")
    ax.set_title("Evictions: shared anchors (2+ requests) vs private tails")
    ax.legend(fontsize=8, loc="upper right")
    ax.margins(y=0.2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _rebuilt(result: dict[str, Any], path: Path) -> None:
    policies = result["policies"]
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    labelled: set[str] = set()
    for r in primary_runs(result):
        xs = r["rebuilt_s"]
        p = r["policy"]
        if not xs:  # nothing rebuilt: a flat line over the run, so the arm is still seen
            ax.plot([0, r["wall_s"]], [0, 0], color=_color(policies, p), linewidth=2,
                    label=p if p not in labelled else None)
        else:
            ax.step(xs, range(1, len(xs) + 1), where="post", color=_color(policies, p), alpha=0.8,
                    label=p if p not in labelled else None)
        labelled.add(p)
    ax.set_xlabel("seconds since the run's first event")
    ax.set_ylabel("blocks rebuilt after eviction (cumulative)")
    ax.set_title("Rebuilt-from-eviction blocks over time (one line per run)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _ttft_cdf_by_component(result: dict[str, Any], path: Path) -> None:
    policies = result["policies"]
    names = list(result["traffic"])
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.6), squeeze=False, sharey=True)
    for ax, name in zip(axes[0], names, strict=True):
        for p in policies:
            pooled = sorted(1000 * t for r in primary_runs(result) if r["policy"] == p
                            for t in r["ttfts_by_component"].get(name, []))
            if pooled:
                ax.plot(pooled, [(i + 1) / len(pooled) for i in range(len(pooled))], color=_color(policies, p),
                        linewidth=1.8, label=p)
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_title(f"{name}", fontsize=10)
        ax.set_xlabel("TTFT (ms, log scale)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    axes[0][0].set_ylabel("fraction of requests (all repetitions)")
    fig.suptitle("TTFT CDF per traffic component", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _vs_capacity(result: dict[str, Any], path: Path, key: str, scale: float, ylabel: str, title: str) -> None:
    policies = result["policies"]
    sw = result["sweep"]
    caps = sw["capacities"]
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for p in policies:
        xs, ys, lo, hi = [], [], [], []
        for c in caps:
            s = sw["per_capacity"][str(c)]["by_policy"][p][key]
            if s["median"] is None:
                continue
            xs.append(c)
            ys.append(scale * s["median"])
            lo.append(scale * (s["median"] - s["min"]))
            hi.append(scale * (s["max"] - s["median"]))
        if xs:
            ax.errorbar(xs, ys, yerr=[lo, hi], color=_color(policies, p), marker="o", capsize=3, label=p)
    ax.set_xlabel("KV pool (blocks)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _hit_rate_vs_capacity(result: dict[str, Any], path: Path) -> None:
    _vs_capacity(result, path, "prefix_hit_rate", 100.0, "prefix hit rate (%, collector)",
                 "Prefix hit rate against KV capacity (median, range)")


def _ttft_vs_capacity(result: dict[str, Any], path: Path) -> None:
    _vs_capacity(result, path, "ttft_p50_s", 1000.0, "TTFT p50 (ms)", "TTFT p50 against KV capacity (median, range)")


def write_plots(directory: Path, result: dict[str, Any]) -> dict[str, str]:
    """Write the plots; returns {title: path relative to the report}."""
    directory.mkdir(parents=True, exist_ok=True)
    plots: dict[str, tuple[str, Any]] = {}
    if result.get("sweep"):
        plots["Prefix hit rate against KV capacity"] = ("hit_rate_vs_capacity.png", _hit_rate_vs_capacity)
        plots["TTFT p50 against KV capacity"] = ("ttft_vs_capacity.png", _ttft_vs_capacity)
    at = f" at {result['capacity']:,} blocks" if result.get("capacity") is not None else ""
    plots.update({
        f"Prefix hit rate{at}": ("hit_rate.png", _hit_rate),
        f"TTFT CDF{at}": ("ttft_cdf.png", _ttft_cdf),
    })
    if result.get("traffic"):
        plots[f"TTFT CDF per traffic component{at}"] = ("ttft_cdf_by_component.png", _ttft_cdf_by_component)
    plots.update({
        f"Evictions: shared anchors vs private tails{at}": ("evictions.png", _evictions),
        f"Rebuilt blocks over time{at}": ("rebuilt_over_time.png", _rebuilt),
    })
    out: dict[str, str] = {}
    for title, (name, fn) in plots.items():
        fn(result, directory / name)
        out[title] = f"{directory.name}/{name}"
    return out
