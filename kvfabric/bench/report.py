"""The A/B report: per-policy medians and spreads, verdicts, where the gain comes from, and the plots.

Input: an ``kvfabric ab`` output directory (``plan.json`` + ``runs/<run>.bench.json`` + ``runs/<run>.collector.json``).
Output: ``ab.json`` (everything computed here), ``report.md`` and ``plots/*.png``.

The rule for calling a difference (:func:`verdict`): with the baseline (the first policy) and another arm
summarised over their repetitions by median and range (min..max), the difference counts only if the two ranges do
not overlap *and* the medians differ by more than the wider of the two ranges. Otherwise the report says "no
difference": a difference within the arms' spread is noise.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

from kvfabric.bench.analytics import request_join
from kvfabric.bench.stats import median, spread

__all__ = ["HEADLINE", "build", "json_line", "print_table", "verdict", "write_report"]

# (key, label, direction: +1 higher is better, -1 lower is better, 0 neither; unit)
HEADLINE: list[tuple[str, str, int, str]] = [
    ("prefix_hit_rate", "prefix hit rate (collector)", +1, "pct"),
    ("ttft_p50_s", "TTFT p50", -1, "ms"),
    ("ttft_p99_s", "TTFT p99", -1, "ms"),
    ("tpot_p50_s", "TPOT p50", -1, "ms"),
    ("requests_per_s", "requests/s", +1, "rate"),
    ("rebuilt_from_eviction_blocks", "rebuilt-from-eviction blocks", -1, "int"),
    ("shared_anchor_eviction_ratio", "shared-anchor eviction ratio", -1, "pct"),
    ("wasted_prefill_tokens", "wasted prefill tokens", -1, "int"),
    ("client_cached_tokens", "cached tokens (client, usage)", +1, "int"),
    ("collector_hit_tokens", "hit tokens (collector)", +1, "int"),
]
#: Verdicts that do not call a difference.
NO_CALL = frozenset({"no difference", "n/a", "no spread (1 repetition)"})
CONTEXT: list[tuple[str, str, int, str]] = [
    ("e2e_p50_s", "E2E p50", -1, "ms"),
    ("e2e_p99_s", "E2E p99", -1, "ms"),
    ("evicted_blocks", "evicted blocks", 0, "int"),
    ("client_hit_rate", "cached / prompt tokens (client)", +1, "pct"),
    ("output_tokens_per_s", "output tokens/s", +1, "rate"),
    ("admissions", "admissions (collector)", 0, "int"),
    ("requests_failed", "failed requests", -1, "int"),
]


def run_metrics(bench: dict[str, Any], coll: dict[str, Any]) -> dict[str, Any]:
    """The numbers of one run: the client's summary joined with the collector's run summary."""
    s, c = bench["summary"], coll["summary"]
    return {
        "prefix_hit_rate": c["prefix_hit_rate"],
        "ttft_p50_s": s["ttft_p50_s"],
        "ttft_p99_s": s["ttft_p99_s"],
        "tpot_p50_s": s["tpot_p50_s"],
        "requests_per_s": s["requests_per_s"],
        "rebuilt_from_eviction_blocks": c["rebuilt_from_eviction_blocks"],
        "shared_anchor_eviction_ratio": c["shared_anchor_eviction_ratio"],
        "wasted_prefill_tokens": c["wasted_prefill_tokens"],
        "client_cached_tokens": s["cached_tokens"],
        "collector_hit_tokens": c["prefix_hit_tokens"],
        "e2e_p50_s": s["e2e_p50_s"],
        "e2e_p99_s": s["e2e_p99_s"],
        "evicted_blocks": c["evicted_blocks"],
        "client_hit_rate": s["client_hit_rate"],
        "output_tokens_per_s": s["output_tokens_per_s"],
        "admissions": c["requests"],
        "requests_failed": s["requests_failed"],
    }


def verdict(base: dict[str, Any], other: dict[str, Any], direction: int) -> dict[str, Any]:
    """``other`` against ``base`` (each a :func:`~kvfabric.bench.stats.spread`): see the module docstring."""
    if base["median"] is None or other["median"] is None:
        return {"call": "n/a", "delta": None, "relative": None}
    delta = other["median"] - base["median"]
    relative = delta / base["median"] if base["median"] else None
    if len(base.get("values", ())) < 2 or len(other.get("values", ())) < 2:
        return {"call": "no spread (1 repetition)", "delta": delta, "relative": relative}
    overlap = other["min"] <= base["max"] and base["min"] <= other["max"]
    if overlap or abs(delta) <= max(base["spread"], other["spread"]):
        call = "no difference"
    elif direction == 0:
        call = "higher" if delta > 0 else "lower"
    else:
        call = "better" if delta * direction > 0 else "worse"
    return {"call": call, "delta": delta, "relative": relative}


def family_kind(family: str | None) -> str:
    """Group family ids for the report: ``persona-3`` -> ``persona``; prefix digests (no hint) -> ``(unnamed)``."""
    if family is None or family == "":
        return "(none)"
    if re.fullmatch(r"[0-9a-f]{8,}", family):
        return "(unnamed)"
    return re.sub(r"[-_.]?\d+$", "", family) or family


def build(out: Path) -> dict[str, Any]:
    """Everything the report shows, from the files of an ``ab`` output directory."""
    plan = json.loads((out / "plan.json").read_text())
    policies: list[str] = plan["policies"]
    base = policies[0]
    runs: list[dict[str, Any]] = []
    for arm in plan["arms"]:
        bench = json.loads((out / "runs" / f"{arm['run_id']}.bench.json").read_text())
        coll = json.loads((out / "runs" / f"{arm['run_id']}.collector.json").read_text())
        events = coll.get("events") or {}
        join = request_join(bench["requests"], events.get("lookups", []))
        summary = coll["summary"]
        runs.append({
            "run_id": arm["run_id"], "policy": arm["policy"], "repetition": arm["repetition"],
            "ready_s": arm.get("ready_s"), "metrics": run_metrics(bench, coll), "join": join,
            "requests_ok": bench["summary"]["requests_ok"], "wall_s": bench["summary"]["wall_s"],
            "families": coll["families"], "rebuilt_s": events.get("rebuilt_s", []),
            "evicted_shared": events.get("evicted_shared", summary["shared_anchor_evictions"]),
            "evicted_private": events.get("evicted_private",
                                          summary["evicted_blocks"] - summary["shared_anchor_evictions"]),
            "ttfts": [r["ttft_s"] for r in bench["requests"] if r.get("ok") and r.get("ttft_s") is not None],
            "sink_dropped_events": coll["summary"].get("sink_dropped_events", 0),
            "sequence_gaps": coll["summary"].get("sequence_gaps", 0),
            "by_traffic": bench.get("by_traffic", {}),
            "cpu_s": _cpu_by_role(arm.get("processes") or []),
        })
    by_policy: dict[str, dict[str, Any]] = {}
    for p in policies:
        mine = [r for r in runs if r["policy"] == p]
        by_policy[p] = {key: {**spread([r["metrics"][key] for r in mine]), "values": [r["metrics"][key] for r in mine]}
                        for key, *_ in HEADLINE + CONTEXT}
    verdicts = {
        p: {key: verdict(by_policy[base][key], by_policy[p][key], d) for key, _, d, _ in HEADLINE + CONTEXT}
        for p in policies[1:]
    }
    kinds = _kinds(runs, policies)
    return {"plan": plan, "baseline": base, "policies": policies, "runs": runs, "by_policy": by_policy,
            "verdicts": verdicts, "kinds": kinds, "traffic": _traffic(runs, policies),
            "agreement": _agreement(runs)}


def _cpu_by_role(processes: list[dict[str, Any]]) -> dict[str, float]:
    """CPU seconds of the server's processes when its run ended: the server itself, its EngineCore, the rest."""
    out = {"server": 0.0, "engine_core": 0.0, "other": 0.0}
    for i, p in enumerate(processes):
        role = "server" if i == 0 else "engine_core" if "EngineCor" in str(p.get("comm")) else "other"
        out[role] += float(p.get("cpu_s") or 0.0)
    return out


def _traffic(runs: list[dict[str, Any]], policies: list[str]) -> dict[str, dict[str, dict[str, float | None]]]:
    """Per traffic component and policy: medians over repetitions of the client's numbers."""
    names = list(dict.fromkeys(n for r in runs for n in r["by_traffic"]))
    fields = ("requests_ok", "ttft_p50_s", "ttft_p99_s", "e2e_p50_s", "client_hit_rate")
    return {
        n: {p: {f: median([r["by_traffic"][n][f] for r in runs if r["policy"] == p and n in r["by_traffic"]
                           and r["by_traffic"][n][f] is not None]) for f in fields} for p in policies}
        for n in names
    }


def _kinds(runs: list[dict[str, Any]], policies: list[str]) -> dict[str, dict[str, dict[str, float | None]]]:
    """Per family kind and policy: medians over repetitions of the family analytics, summed within a run."""
    fields = ("requests", "prompt_tokens", "prefix_hit_tokens", "evicted_blocks", "shared_anchor_evictions",
              "rebuilt_blocks", "wasted_prefill_tokens")
    per_run: dict[str, dict[str, dict[str, float]]] = {}
    for r in runs:
        acc: dict[str, dict[str, float]] = defaultdict(lambda: dict.fromkeys(fields, 0.0))
        for f in r["families"]:
            k = family_kind(f.get("family"))
            for name in fields:
                acc[k][name] += float(f.get(name) or 0)
        per_run[r["run_id"]] = acc
    all_kinds = sorted({k for acc in per_run.values() for k in acc})
    out: dict[str, dict[str, dict[str, float | None]]] = {}
    for k in all_kinds:
        out[k] = {}
        for p in policies:
            mine = [per_run[r["run_id"]].get(k) for r in runs if r["policy"] == p]
            row: dict[str, float | None] = {
                name: median([m[name] if m else 0.0 for m in mine]) for name in fields
            }
            pt, ht = row["prompt_tokens"], row["prefix_hit_tokens"]
            row["prefix_hit_rate"] = (ht or 0) / pt if pt else None
            out[k][p] = row
    return out


def _agreement(runs: list[dict[str, Any]]) -> dict[str, Any]:
    client = sum(int(r["metrics"]["client_cached_tokens"] or 0) for r in runs)
    collector = sum(int(r["metrics"]["collector_hit_tokens"] or 0) for r in runs)
    j: dict[str, int] = defaultdict(int)
    for r in runs:
        for k, v in r["join"].items():
            j[k] += int(v)
    per_run = []
    for r in runs:
        cl, co = r["metrics"]["client_cached_tokens"], r["metrics"]["collector_hit_tokens"]
        per_run.append({"run_id": r["run_id"], "client_cached_tokens": cl, "collector_hit_tokens": co,
                        "relative_difference": (co - cl) / cl if cl else None,
                        "readmissions": r["join"]["readmissions"]})
    return {
        "client_cached_tokens": client,
        "collector_hit_tokens": collector,
        "relative_difference": (collector - client) / client if client else None,
        "max_abs_relative_difference_per_run": max(
            (abs(x["relative_difference"]) for x in per_run if x["relative_difference"] is not None), default=None),
        "join": dict(j),
        "per_run": per_run,
    }


def json_line(result: dict[str, Any]) -> dict[str, Any]:
    """The ``--format json`` object: per policy, median / min / max / spread of the headline metrics."""
    plan = result["plan"]
    return {
        "scenario": plan["scenario"]["name"],
        "repeat": plan["repeat"],
        "baseline": result["baseline"],
        "policies": {
            p: {key: {k: v for k, v in result["by_policy"][p][key].items() if k != "values"} for key, *_ in HEADLINE}
            for p in result["policies"]
        },
        "verdicts": {p: {key: v["call"] for key, v in vs.items() if key in dict((h[0], 1) for h in HEADLINE)}
                     for p, vs in result["verdicts"].items()},
        "agreement": {k: result["agreement"][k] for k in ("client_cached_tokens", "collector_hit_tokens",
                                                          "relative_difference")},
    }


# ------------------------------------------------------------------------------------------------ rendering


def fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "pct":
        return f"{100 * value:.2f} %"
    if unit == "ms":
        return f"{1000 * value:.1f} ms"
    if unit == "rate":
        return f"{value:.2f}"
    return f"{value:,.0f}"


def _cell(s: dict[str, Any], unit: str) -> str:
    if s["median"] is None:
        return "-"
    if s["spread"] == 0:
        return fmt(s["median"], unit)
    return f"{fmt(s['median'], unit)} ({fmt(s['min'], unit)} - {fmt(s['max'], unit)})"


def _call(v: dict[str, Any], unit: str) -> str:
    if v["call"] in NO_CALL:
        return v["call"]
    rel = f", {100 * v['relative']:+.1f} %" if v["relative"] is not None else ""
    delta = v["delta"]
    if unit == "pct":
        d = f"{100 * delta:+.2f} points"
    elif unit == "ms":
        d = f"{1000 * delta:+.1f} ms"
    elif unit == "rate":
        d = f"{delta:+.2f}"
    else:
        d = f"{delta:+,.0f}"
    return f"**{v['call']}** ({d}{rel})"


def print_table(result: dict[str, Any]) -> None:
    policies = result["policies"]
    width = max(len(label) for _, label, _, _ in HEADLINE)
    print(f"\n{'':<{width}}  " + "  ".join(f"{p:>28}" for p in policies))
    for key, label, _, unit in HEADLINE:
        cells = [_cell(result["by_policy"][p][key], unit) for p in policies]
        print(f"{label:<{width}}  " + "  ".join(f"{c:>28}" for c in cells))
    for p, vs in result["verdicts"].items():
        called = [f"{label}: {vs[key]['call']}" for key, label, _, _ in HEADLINE if vs[key]["call"] not in NO_CALL]
        if any(v["call"] == "no spread (1 repetition)" for v in vs.values()):
            verdict_text = "one repetition: no spread to judge a difference against (use --repeat 3)"
        else:
            verdict_text = "; ".join(called) if called else "no difference beyond noise"
        print(f"\n{p} vs {result['baseline']}: {verdict_text}")
    a = result["agreement"]
    if a["relative_difference"] is not None:
        print(f"cached tokens: client {a['client_cached_tokens']:,} vs collector {a['collector_hit_tokens']:,} "
              f"({100 * a['relative_difference']:+.3f} %)")


def _gain_text(result: dict[str, Any]) -> list[str]:
    """Sentences saying where each policy's difference from the baseline comes from (by family kind)."""
    base = result["baseline"]
    lines: list[str] = []
    bp = result["by_policy"]
    for p in result["policies"][1:]:
        d_rebuilt = (bp[p]["rebuilt_from_eviction_blocks"]["median"] or 0) - (
            bp[base]["rebuilt_from_eviction_blocks"]["median"] or 0)
        parts = []
        contrib = []
        for k, rows in result["kinds"].items():
            dk = (rows[p]["rebuilt_blocks"] or 0) - (rows[base]["rebuilt_blocks"] or 0)
            if dk:
                contrib.append((abs(dk), k, dk))
        contrib.sort(reverse=True)
        for _, k, dk in contrib[:4]:
            parts.append(f"`{k}` families {dk:+,.0f}")
        sa_b = bp[base]["shared_anchor_eviction_ratio"]["median"]
        sa_p = bp[p]["shared_anchor_eviction_ratio"]["median"]
        hr_b = bp[base]["prefix_hit_rate"]["median"]
        hr_p = bp[p]["prefix_hit_rate"]["median"]
        text = (f"- **{p}** rebuilt {d_rebuilt:+,.0f} blocks against {base} (medians)"
                + (f": {'; '.join(parts)}." if parts else "."))
        if sa_b is not None and sa_p is not None:
            text += (f" Shared anchors were {100 * sa_b:.1f} % of {base}'s evictions and {100 * sa_p:.1f} % of "
                     f"{p}'s")
            text += (": it kept shared trunks and evicted private tails instead." if sa_p < sa_b else ".")
        if hr_b is not None and hr_p is not None:
            text += f" Prefix hit rate {100 * hr_b:.2f} % -> {100 * hr_p:.2f} %."
        lines.append(text)
    return lines


def render_markdown(result: dict[str, Any], plots: dict[str, str]) -> str:
    plan = result["plan"]
    sc = plan["scenario"]
    srv = sc["server"]
    policies = result["policies"]
    base = result["baseline"]
    w: list[str] = []
    w.append(f"# A/B report: `{sc['name']}`")
    w.append("")
    if sc.get("description"):
        w.append(sc["description"])
        w.append("")
    if sc.get("shows"):
        w.append(f"**Meant to show:** {sc['shows']}")
        w.append("")
    w.append(f"**Capacity:** {srv['kv_blocks']:,} KV blocks of {srv['block_size']} tokens"
             + (f". {srv['capacity']}" if srv.get("capacity") else "."))
    w.append("")
    server = ("`kvfabric sim-serve` (vLLM's real OpenAI server, engine, scheduler and KV cache manager on CPU; the "
              f"forward pass modelled from H200 measurements of the `{srv['model']}` shape, latency scale "
              f"{srv['latency_scale']:g})") if plan["server"] == "sim-serve" else f"`{plan['serve_cmd']}`"
    ahead = plan.get("prestart") or 0
    w.append(f"Setup: {len(policies)} policies x {plan['repeat']} repetitions, a fresh server per run: {server}; "
             f"one collector; seed {plan['seed']}; the order of arms alternates between repetitions"
             + (f"; the next {ahead} arm(s)' servers started up while each run ran (`--prestart {ahead}`)" if ahead
                else "")
             + f". Machine: {plan['machine']}. Total time {plan.get('wall_s', 0) / 60:.1f} min.")
    w.append("")
    w.append(f"Command: `{plan['command']}`")
    w.append("")
    w.append("## Results")
    w.append("")
    w.append(f"Medians over repetitions, with the range (min - max) when the runs differ. Baseline: `{base}`. "
             "A difference is called only when the arms' ranges do not overlap and the medians differ by more than "
             "the wider range; anything else is reported as no difference.")
    w.append("")
    head = "| metric | " + " | ".join(f"`{p}`" for p in policies) + " | " + " | ".join(
        f"`{p}` vs `{base}`" for p in policies[1:]) + " |"
    w.append(head)
    w.append("|" + "---|" * (1 + len(policies) + len(policies) - 1))
    for key, label, _, unit in HEADLINE + CONTEXT:
        cells = [_cell(result["by_policy"][p][key], unit) for p in policies]
        calls = [_call(result["verdicts"][p][key], unit) for p in policies[1:]]
        w.append(f"| {label} | " + " | ".join(cells) + " | " + " | ".join(calls) + " |")
    w.append("")
    w.append("## Where the difference comes from")
    w.append("")
    w.extend(_gain_text(result) or ["- one policy only: nothing to compare."])
    w.append("")
    if len(result["traffic"]) > 1:
        w.append("By traffic component (client, medians over repetitions):")
        w.append("")
        w.append("| traffic | policy | requests | cached / prompt tokens | TTFT p50 | TTFT p99 | E2E p50 |")
        w.append("|---|---|---|---|---|---|---|")
        for name, rows in result["traffic"].items():
            for p in policies:
                r = rows[p]
                w.append(f"| `{name}` | `{p}` | {fmt(r['requests_ok'], 'int')} | {fmt(r['client_hit_rate'], 'pct')} | "
                         f"{fmt(r['ttft_p50_s'], 'ms')} | {fmt(r['ttft_p99_s'], 'ms')} | {fmt(r['e2e_p50_s'], 'ms')} |")
        w.append("")
    w.append("By family kind (collector, medians over repetitions):")
    w.append("")
    w.append("| family kind | policy | requests | prompt tokens | hit rate | evicted | shared anchors evicted | "
             "rebuilt | wasted prefill tokens |")
    w.append("|---|---|---|---|---|---|---|---|---|")
    for k, rows in result["kinds"].items():
        for p in policies:
            r = rows[p]
            w.append(f"| `{k}` | `{p}` | {fmt(r['requests'], 'int')} | {fmt(r['prompt_tokens'], 'int')} | "
                     f"{fmt(r['prefix_hit_rate'], 'pct')} | {fmt(r['evicted_blocks'], 'int')} | "
                     f"{fmt(r['shared_anchor_evictions'], 'int')} | {fmt(r['rebuilt_blocks'], 'int')} | "
                     f"{fmt(r['wasted_prefill_tokens'], 'int')} |")
    w.append("")
    if plots:
        w.append("## Plots")
        w.append("")
        for title, rel in plots.items():
            w.append(f"![{title}]({rel})")
            w.append("")
    else:
        w.append("(No plots: matplotlib is not installed; `pip install kvfabric[plots]`.)")
        w.append("")
    a = result["agreement"]
    j = a["join"]
    w.append("## Cached tokens: client vs collector")
    w.append("")
    if a["relative_difference"] is None and not a["collector_hit_tokens"]:
        w.append("No prefix-cache hits in these runs: the server reported no cached tokens to the client and the "
                 "collector counted no hit tokens (nothing to compare).")
    elif a["relative_difference"] is None:
        w.append(f"The server reported no cached tokens to the client while the collector counted "
                 f"{a['collector_hit_tokens']:,} hit tokens (vLLM reports them with "
                 "`--enable-prompt-tokens-details`).")
    else:
        w.append(
            f"Over all runs the server told the client {a['client_cached_tokens']:,} cached prompt tokens "
            f"(`usage.prompt_tokens_details.cached_tokens`) and the collector counted {a['collector_hit_tokens']:,} "
            f"hit tokens ({100 * a['relative_difference']:+.3f} %; at most "
            f"{100 * (a['max_abs_relative_difference_per_run'] or 0):.3f} % in one run). Request by request: "
            f"{j.get('requests_matched', 0):,} client requests matched their `prefix_lookup` rows through the "
            f"request id, {j.get('requests_equal', 0):,} with exactly the same number at the first admission "
            f"({j.get('client_cached_tokens_matched', 0):,} vs {j.get('collector_first_admission_hit_tokens', 0):,}"
            " tokens)."
        )
        w.append("")
        w.append(
            "Why they are not always identical: the collector counts every admission (`prefix_lookup`), and a request "
            f"that vLLM preempted is admitted again with its new hit ({j.get('readmissions', 0):,} re-admissions "
            "here), while vLLM reports to the client the cached tokens of the first admission only; a request that "
            "failed or was cut at the client side has a collector row but no client usage "
            f"({j.get('lookups_without_client_request', 0):,} such rows), and one whose events were lost would "
            "have the opposite (the collector counts lost events: "
            f"{sum(r['sink_dropped_events'] for r in result['runs']):,} dropped, "
            f"{sum(r['sequence_gaps'] for r in result['runs']):,} sequence gaps)."
        )
    w.append("")
    w.append("## Runs")
    w.append("")
    w.append("| run | policy | server ready (s) | requests | wall (s) | hit rate | rebuilt | TTFT p50 | "
             "CPU s: server / EngineCore |")
    w.append("|---|---|---|---|---|---|---|---|---|")
    for r in result["runs"]:
        m = r["metrics"]
        w.append(f"| `{r['run_id']}` | `{r['policy']}` | {r['ready_s'] or 0:.1f} | {r['requests_ok']:,} "
                 f"| {r['wall_s']:.1f} | {fmt(m['prefix_hit_rate'], 'pct')} | "
                 f"{fmt(m['rebuilt_from_eviction_blocks'], 'int')} | "
                 f"{fmt(m['ttft_p50_s'], 'ms')} | {r['cpu_s']['server']:.1f} / {r['cpu_s']['engine_core']:.1f} |")
    w.append("")
    return "\n".join(w)


def write_report(out: Path, result: dict[str, Any]) -> None:
    """``ab.json``, ``plots/*.png`` (when matplotlib is installed) and ``report.md`` in ``out``."""
    try:
        from kvfabric.bench.plots import write_plots  # (imports matplotlib, which is optional)

        plots = write_plots(out / "plots", result)
    except ImportError:
        plots = {}
    slim = {k: v for k, v in result.items() if k != "runs"}
    slim["runs"] = [{k: v for k, v in r.items() if k not in ("ttfts", "rebuilt_s", "families")} for r in result["runs"]]
    (out / "ab.json").write_text(json.dumps(slim, indent=1) + "\n")
    (out / "report.md").write_text(render_markdown(result, plots))
