"""The A/B report: per-policy medians and spreads, verdicts, where the gain comes from, and the plots.

Input: an ``kvfabric ab`` output directory (``plan.json`` + ``runs/<run>.bench.json`` + ``runs/<run>.collector.json``).
Output: ``ab.json`` (everything computed here), ``report.md`` and ``plots/*.png``.

The rule for calling a difference (:func:`verdict`): with the baseline (the first policy) and another arm
summarised over their repetitions by median and range (min..max), the difference counts only if the two ranges do
not overlap *and* the medians differ by more than the wider of the two ranges. Otherwise the report says "no
difference": a difference within the arms' spread is noise. The rule applies to every metric, overall and per
traffic component (the scenario's ``[[traffic]]`` names), and under ``--capacities`` per capacity.

Client metrics are computed here from the run's request records (:func:`client_metrics`): TTFT p50/p90/p99, E2E
p50/p90/p99, TPOT p50, requests/s and goodput (requests/s whose TTFT is at most the TTFT SLO: the plan's
``ttft_slo_ms``, from the scenario or ``--ttft-slo-ms``; None when no SLO is stated), all over the run's wall time.
With a capacity sweep, the sections that are not per capacity (family kinds, plots of one capacity) show the
*primary* capacity: the scenario's own ``kv_blocks`` when it was swept, else the smallest.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

from kvfabric.bench.analytics import request_join
from kvfabric.bench.kv_saved import kv_saved
from kvfabric.bench.servers import split_arm
from kvfabric.bench.stats import median, percentile, primary_runs, spread

__all__ = ["COMPONENT", "HEADLINE", "build", "client_metrics", "json_line", "print_table", "verdict",
           "write_report"]

# (key, label, direction: +1 higher is better, -1 lower is better, 0 neither; unit)
HEADLINE: list[tuple[str, str, int, str]] = [
    ("prefix_hit_rate", "prefix hit rate (collector)", +1, "pct"),
    ("ttft_p50_s", "TTFT p50", -1, "ms"),
    ("ttft_p90_s", "TTFT p90", -1, "ms"),
    ("ttft_p99_s", "TTFT p99", -1, "ms"),
    ("e2e_p50_s", "E2E p50", -1, "ms"),
    ("e2e_p90_s", "E2E p90", -1, "ms"),
    ("tpot_p50_s", "TPOT p50", -1, "ms"),
    ("requests_per_s", "requests/s", +1, "rate"),
    ("goodput_per_s", "goodput (requests/s within the TTFT SLO)", +1, "rate"),
    ("rebuilt_from_eviction_blocks", "rebuilt-from-eviction blocks", -1, "int"),
    ("shared_anchor_eviction_ratio", "shared-anchor eviction ratio", -1, "pct"),
    ("wasted_prefill_tokens", "wasted prefill tokens", -1, "int"),
    ("client_cached_tokens", "cached tokens (client, usage)", +1, "int"),
    ("collector_hit_tokens", "hit tokens (collector)", +1, "int"),
]
#: Verdicts that do not call a difference.
NO_CALL = frozenset({"no difference", "n/a", "no spread (1 repetition)"})
CONTEXT: list[tuple[str, str, int, str]] = [
    ("e2e_p99_s", "E2E p99", -1, "ms"),
    ("evicted_blocks", "evicted blocks", 0, "int"),
    ("client_hit_rate", "cached / prompt tokens (client)", +1, "pct"),
    ("output_tokens_per_s", "output tokens/s", +1, "rate"),
    ("admissions", "admissions (collector)", 0, "int"),
    ("requests_failed", "failed requests", -1, "int"),
]


#: Per traffic component (client numbers only: the collector does not know the components).
COMPONENT: list[tuple[str, str, int, str]] = [
    ("ttft_p50_s", "TTFT p50", -1, "ms"),
    ("ttft_p90_s", "TTFT p90", -1, "ms"),
    ("ttft_p99_s", "TTFT p99", -1, "ms"),
    ("e2e_p50_s", "E2E p50", -1, "ms"),
    ("e2e_p90_s", "E2E p90", -1, "ms"),
    ("tpot_p50_s", "TPOT p50", -1, "ms"),
    ("requests_per_s", "requests/s", +1, "rate"),
    ("goodput_per_s", "goodput", +1, "rate"),
    ("client_hit_rate", "cached / prompt tokens", +1, "pct"),
    ("requests_ok", "requests", 0, "int"),
]


def client_metrics(requests: list[dict[str, Any]], wall_s: float, slo_s: float | None) -> dict[str, Any]:
    """The client's numbers of a set of request records (one run, or one traffic component of it), rates over the
    run's ``wall_s``. ``goodput_per_s`` counts the successful requests with ``ttft_s <= slo_s`` (None without an
    SLO); a failed request never counts."""
    ok = [r for r in requests if r.get("ok")]
    ttft = [r["ttft_s"] for r in ok if r.get("ttft_s") is not None]
    e2e = [r["e2e_s"] for r in ok if r.get("e2e_s") is not None]
    tpot = [r["tpot_s"] for r in ok if r.get("tpot_s") is not None]
    prompt = sum(r.get("prompt_tokens") or 0 for r in ok)
    reported = [r for r in ok if r.get("cached_tokens") is not None]

    def rate(n: int) -> float | None:
        return n / wall_s if wall_s > 0 else None

    return {
        "requests_ok": len(ok),
        "ttft_p50_s": percentile(ttft, 0.5), "ttft_p90_s": percentile(ttft, 0.9), "ttft_p99_s": percentile(ttft, 0.99),
        "e2e_p50_s": percentile(e2e, 0.5), "e2e_p90_s": percentile(e2e, 0.9), "e2e_p99_s": percentile(e2e, 0.99),
        "tpot_p50_s": percentile(tpot, 0.5),
        "requests_per_s": rate(len(ok)),
        "goodput_per_s": None if slo_s is None else rate(sum(1 for t in ttft if t <= slo_s)),
        "client_hit_rate": (sum(r["cached_tokens"] for r in reported) / prompt) if prompt and reported else None,
    }


def run_metrics(bench: dict[str, Any], coll: dict[str, Any], slo_s: float | None = None) -> dict[str, Any]:
    """The numbers of one run: the client's (:func:`client_metrics` of its records) joined with the collector's run
    summary."""
    s, c = bench["summary"], coll["summary"]
    m = client_metrics(bench["requests"], s["wall_s"], slo_s)
    return {
        "prefix_hit_rate": c["prefix_hit_rate"],
        **{k: m[k] for k in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "e2e_p50_s", "e2e_p90_s", "e2e_p99_s",
                             "tpot_p50_s", "requests_per_s", "goodput_per_s", "client_hit_rate")},
        "rebuilt_from_eviction_blocks": c["rebuilt_from_eviction_blocks"],
        "shared_anchor_eviction_ratio": c["shared_anchor_eviction_ratio"],
        "wasted_prefill_tokens": c["wasted_prefill_tokens"],
        "client_cached_tokens": s["cached_tokens"],
        "collector_hit_tokens": c["prefix_hit_tokens"],
        "evicted_blocks": c["evicted_blocks"],
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


def _spreads(runs: list[dict[str, Any]], policies: list[str], keys: list[str],
             get: Any) -> dict[str, dict[str, dict[str, Any]]]:
    """Per policy and key: :func:`spread` of ``get(run, key)`` over the policy's runs, with the values."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for p in policies:
        mine = [r for r in runs if r["policy"] == p]
        out[p] = {}
        for key in keys:
            values = [get(r, key) for r in mine]
            out[p][key] = {**spread(values), "values": values}
    return out


def _verdicts(by_policy: dict[str, dict[str, dict[str, Any]]], policies: list[str],
              metrics: list[tuple[str, str, int, str]]) -> dict[str, dict[str, dict[str, Any]]]:
    base = policies[0]
    return {p: {key: verdict(by_policy[base][key], by_policy[p][key], d) for key, _, d, _ in metrics}
            for p in policies[1:]}


def _summarise(runs: list[dict[str, Any]], policies: list[str]) -> dict[str, Any]:
    """Medians, ranges and verdicts of a set of runs (one capacity): overall and per traffic component."""
    metrics = HEADLINE + CONTEXT
    by_policy = _spreads(runs, policies, [k for k, *_ in metrics], lambda r, k: r["metrics"][k])
    names = list(dict.fromkeys(n for r in runs for n in r["components"]))
    traffic = {}
    for n in names:
        bp = _spreads(runs, policies, [k for k, *_ in COMPONENT],
                      lambda r, k, n=n: r["components"][n][k] if n in r["components"] else None)
        traffic[n] = {"by_policy": bp, "verdicts": _verdicts(bp, policies, COMPONENT)}
    return {"by_policy": by_policy, "verdicts": _verdicts(by_policy, policies, metrics), "traffic": traffic,
            "kinds": _kinds(runs, policies)}


def _sweep(result: dict[str, Any], capacities: list[int]) -> dict[str, Any]:
    """Per capacity: the summaries; and KV saved at equal hit rate for every policy and capacity."""
    policies = result["policies"]
    per_capacity = {c: _summarise([r for r in result["runs"] if r["capacity"] == c], policies) for c in capacities}
    lru = {c: per_capacity[c]["by_policy"]["lru"]["prefix_hit_rate"]["median"] for c in capacities}
    saved = [kv_saved(lru, p, c, per_capacity[c]["by_policy"][p]["prefix_hit_rate"]["median"]).as_dict()
             for c in capacities for p in policies]
    return {"capacities": capacities, "per_capacity": {str(c): v for c, v in per_capacity.items()},
            "lru_hit_rate": {str(c): h for c, h in lru.items()}, "kv_saved": saved}


def _sittings_text(plan: dict[str, Any], policies: list[str]) -> list[str]:
    """The report's lines on sittings (an A/B continued with ``--resume``) and on arms not run (stopped early)."""
    lines: list[str] = []
    sittings = plan.get("sittings") or []
    if len(sittings) > 1:
        each = "; ".join(f"{s['started_at']} on {s['machine']}, {len(s['arms'])} arm(s) in {s['wall_s'] / 60:.1f} min"
                         + (f", `{s['serve_cmd']}`" if s.get("serve_cmd") and s["serve_cmd"] != plan.get("serve_cmd")
                            else "")
                         for s in sittings)
        lines += [f"Ran in {len(sittings)} sittings (`kvfabric ab --resume`), the arms in the planned order: {each}.",
                  ""]
    caps = plan.get("capacities") or [None]
    expected = len(policies) * len(caps) * int(plan["repeat"])
    if len(plan["arms"]) < expected:
        per = ", ".join(f"`{p}` {sum(a['policy'] == p for a in plan['arms'])}" for p in policies)
        lines += [f"**Incomplete:** {len(plan['arms'])} of {expected} arms ran (runs per policy: {per}); the "
                  "numbers below are over the runs that exist. `kvfabric ab --resume --out DIR` runs the rest.", ""]
    return lines


def build(out: Path, ttft_slo_ms: float | None = None) -> dict[str, Any]:
    """Everything the report shows, from the files of an ``ab`` output directory. ``ttft_slo_ms`` overrides the
    plan's TTFT SLO (goodput)."""
    plan = json.loads((out / "plan.json").read_text())
    policies: list[str] = plan["policies"]
    base = policies[0]
    slo_ms = ttft_slo_ms if ttft_slo_ms is not None else plan.get("ttft_slo_ms")
    slo_from = "--ttft-slo-ms" if ttft_slo_ms is not None else plan.get("ttft_slo_from")
    slo_s = None if slo_ms is None else slo_ms / 1000.0
    runs: list[dict[str, Any]] = []
    for arm in plan["arms"]:
        bench = json.loads((out / "runs" / f"{arm['run_id']}.bench.json").read_text())
        coll = json.loads((out / "runs" / f"{arm['run_id']}.collector.json").read_text())
        events = coll.get("events") or {}
        join = request_join(bench["requests"], events.get("lookups", []))
        summary = coll["summary"]
        wall = bench["summary"]["wall_s"]
        components: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for r in bench["requests"]:
            components[r["component"]].append(r)
        runs.append({
            "run_id": arm["run_id"], "policy": arm["policy"], "repetition": arm["repetition"],
            "capacity": arm.get("capacity"), "kv_blocks": arm.get("kv_blocks"),
            "ready_s": arm.get("ready_s"), "metrics": run_metrics(bench, coll, slo_s), "join": join,
            "requests_ok": bench["summary"]["requests_ok"], "wall_s": wall,
            "warmup_in_collector": bool(coll.get("warmup_included")),
            "families": coll["families"], "rebuilt_s": events.get("rebuilt_s", []),
            "evicted_shared": events.get("evicted_shared", summary["shared_anchor_evictions"]),
            "evicted_private": events.get("evicted_private",
                                          summary["evicted_blocks"] - summary["shared_anchor_evictions"]),
            "ttfts": [r["ttft_s"] for r in bench["requests"] if r.get("ok") and r.get("ttft_s") is not None],
            "ttfts_by_component": {n: [r["ttft_s"] for r in rs if r.get("ok") and r.get("ttft_s") is not None]
                                   for n, rs in components.items()},
            "components": {n: client_metrics(rs, wall, slo_s) for n, rs in components.items()},
            "sink_dropped_events": coll["summary"].get("sink_dropped_events", 0),
            "sequence_gaps": coll["summary"].get("sequence_gaps", 0),
            "cpu_s": _cpu_by_role(arm.get("processes") or []),
            **({"hold": arm["hold"]} if "hold" in arm else {}),  # (absent: an A/B from before it was kept)
        })
    capacities: list[int] | None = plan.get("capacities")
    primary = None
    if capacities:
        own = plan["scenario"]["server"]["kv_blocks"]
        primary = own if own in capacities else min(capacities)
    result: dict[str, Any] = {
        "plan": plan, "baseline": base, "policies": policies, "runs": runs, "capacity": primary,
        "ttft_slo_ms": slo_ms, "ttft_slo_from": slo_from, "agreement": _agreement(runs),
    }
    result.update(_summarise(primary_runs(result), policies))
    result["sweep"] = _sweep(result, capacities) if capacities else None
    return result


def _cpu_by_role(processes: list[dict[str, Any]]) -> dict[str, float]:
    """CPU seconds of the server's processes when its run ended: the server itself, its EngineCore, the rest."""
    out = {"server": 0.0, "engine_core": 0.0, "other": 0.0}
    for i, p in enumerate(processes):
        role = "server" if i == 0 else "engine_core" if "EngineCor" in str(p.get("comm")) else "other"
        out[role] += float(p.get("cpu_s") or 0.0)
    return out


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


def _no_values(s: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in s.items() if k != "values"}


def json_line(result: dict[str, Any]) -> dict[str, Any]:
    """The ``--format json`` object: per policy, median / min / max / spread of the headline metrics (under a sweep,
    of the primary capacity; ``sweep`` then gives every capacity and the KV saved)."""
    plan = result["plan"]
    headline = {h[0] for h in HEADLINE}
    line: dict[str, Any] = {
        "scenario": plan["scenario"]["name"],
        "repeat": plan["repeat"],
        "baseline": result["baseline"],
        "ttft_slo_ms": result["ttft_slo_ms"],
        "policies": {
            p: {key: _no_values(result["by_policy"][p][key]) for key, *_ in HEADLINE} for p in result["policies"]
        },
        "verdicts": {p: {key: v["call"] for key, v in vs.items() if key in headline}
                     for p, vs in result["verdicts"].items()},
        "components": {
            n: {p: {key: _no_values(t["by_policy"][p][key]) for key, *_ in COMPONENT} for p in result["policies"]}
            for n, t in result["traffic"].items()
        },
        "agreement": {k: result["agreement"][k] for k in ("client_cached_tokens", "collector_hit_tokens",
                                                          "relative_difference")},
    }
    sw = result.get("sweep")
    if sw:
        line["capacity"] = result["capacity"]
        line["sweep"] = {
            "capacities": sw["capacities"],
            "policies": {c: {p: {key: _no_values(v["by_policy"][p][key]) for key in SWEEP_KEYS}
                             for p in result["policies"]} for c, v in sw["per_capacity"].items()},
            "kv_saved": sw["kv_saved"],
        }
    return line


#: The metrics of the sweep table (and of ``--format json``'s ``sweep``).
SWEEP_KEYS = ("prefix_hit_rate", "ttft_p50_s", "ttft_p90_s", "requests_per_s", "goodput_per_s")


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


def saved_text(k: dict[str, Any]) -> str:
    """One KV-saved entry (:func:`kvfabric.bench.kv_saved.kv_saved`) in words."""
    if k["saved"] is None:
        return "-"
    pct = f"{100 * k['saved']:.1f} %"
    if k["bound"] == "at_least":
        return f">= {pct} (above lru's best in the sweep: lru needs > {k['lru_capacity']:,.0f} blocks)"
    if k["bound"] == "at_most":
        return f"<= {pct} (below lru's worst in the sweep: lru needs < {k['lru_capacity']:,.0f} blocks)"
    return f"{pct} (lru needs {k['lru_capacity']:,.0f} blocks)"


def print_table(result: dict[str, Any]) -> None:
    policies = result["policies"]
    width = max(len(label) for _, label, _, _ in HEADLINE)
    if result.get("capacity") is not None:
        print(f"\n(capacity {result['capacity']:,} blocks; every capacity below)")
    print(f"\n{'':<{width}}  " + "  ".join(f"{p:>28}" for p in policies))
    for key, label, _, unit in HEADLINE:
        if key == "goodput_per_s" and result["ttft_slo_ms"] is None:
            continue
        cells = [_cell(result["by_policy"][p][key], unit) for p in policies]
        print(f"{label:<{width}}  " + "  ".join(f"{c:>28}" for c in cells))
    for p, vs in result["verdicts"].items():
        called = [f"{label}: {vs[key]['call']}" for key, label, _, _ in HEADLINE if vs[key]["call"] not in NO_CALL]
        if all(v["call"] == "n/a" for v in vs.values()):
            verdict_text = "no runs yet: nothing to compare"
        elif any(v["call"] == "no spread (1 repetition)" for v in vs.values()):
            verdict_text = "one repetition: no spread to judge a difference against (use --repeat 3)"
        else:
            verdict_text = "; ".join(called) if called else "no difference beyond noise"
        print(f"\n{p} vs {result['baseline']}: {verdict_text}")
    if result["ttft_slo_ms"] is None:
        print("goodput: omitted (no TTFT SLO: scenario key ttft_slo_ms or --ttft-slo-ms)")
    sw = result.get("sweep")
    if sw:
        print("\nKV pool sweep: prefix hit rate / TTFT p50 (medians); KV saved at equal hit rate against lru")
        saved = {(k["capacity"], k["policy"]): k for k in sw["kv_saved"]}
        for c in sw["capacities"]:
            bp = sw["per_capacity"][str(c)]["by_policy"]
            for p in policies:
                print(f"  {c:>8,} blocks  {p:<20} {fmt(bp[p]['prefix_hit_rate']['median'], 'pct'):>9}  "
                      f"{fmt(bp[p]['ttft_p50_s']['median'], 'ms'):>10}  KV saved {saved_text(saved[(c, p)])}")
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


def hold_text(result: dict[str, Any]) -> list[str]:
    """What cache-aware scheduling held in each ``POLICY+hold`` arm's runs (from the servers' logs); nothing when
    no arm has the hold."""
    held = [p for p in result["policies"] if split_arm(p)[1]]
    if not held:
        return []

    def runs_text(policy: str) -> str:
        cells = [("not recorded" if "hold" not in r else "no line in the server log" if r["hold"] is None else
                  f"{r['hold']['requests']:,} ({r['hold']['steps']:,} steps)")
                 for r in result["runs"] if r["policy"] == policy]
        return f"`{policy}` " + (", ".join(cells) if cells else "no runs")

    return ["Cache-aware scheduling (`POLICY+hold` arms): requests held per run, from each server's log: "
            + "; ".join(runs_text(p) for p in held) + ".", ""]


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
    order = ("arms interleaved: every repetition runs every arm once, in the same order (ABAB)"
             if plan.get("order") else "the order of arms alternates between repetitions")
    caps = plan.get("capacities")
    arms_text = (f"{len(policies)} policies x {len(caps)} capacities x {plan['repeat']} repetitions" if caps
                 else f"{len(policies)} policies x {plan['repeat']} repetitions")
    w.append(f"Setup: {arms_text}, a fresh server per run: {server}; one collector; seed {plan['seed']}; {order}. "
             f"Machine: {plan['machine']}. Total time {plan.get('wall_s', 0) / 60:.1f} min.")
    w.append("")
    w.extend(_sittings_text(plan, policies))
    if ahead:
        w.append(f"**The arms were not isolated:** the next {ahead} arm(s)' servers started up (and, on a GPU, "
                 f"loaded and compiled) while each run was measured (`--prestart {ahead}`); their start-ups competed "
                 "with the measured arm. For isolated arms run with `--prestart 0` (the default).")
    else:
        w.append("Arms isolated: one server at a time; no other server started while an arm was measured.")
    w.append("")
    warm = plan.get("warmup")
    if warm is None:
        w.append("No warm-up: these runs predate it; the first requests of each run include any first-request cost.")
    elif warm.get("requests"):
        w.append(f"Warm-up: {warm['requests']} request(s) of {warm['prompt_tokens']} tokens (a prompt set of their "
                 "own) after each server start, excluded from every number: they are not in the client results, "
                 "and the collector's events before the measurement's start (and the later evictions of the "
                 "warm-up's blocks) were moved to the run id `<run>~warmup` before the analytics were computed.")
        if warm.get("leaves_cached_blocks"):
            w.append("")
            w.append(f"**Caveat:** warm-up prompts of {warm['prompt_tokens']} tokens fill blocks, which stay cached "
                     "into the measurement until evicted; policies keep such cold blocks differently (their "
                     "evictions are under `<run>~warmup`). The default warm-up (shorter than one block) leaves none.")
        else:
            w.append("")
            w.append("The warm-up's prompt and answer stay inside one partial block, which vLLM never caches: "
                     "nothing of it is in the pool when the measurement starts.")
        if any(r["warmup_in_collector"] for r in result["runs"]):
            w.append("")
            w.append("**Caveat:** the collector's numbers of some runs still include their warm-up (a run cut "
                     "short whose `collector.duckdb` was gone before `--report-only`).")
    else:
        w.append("No warm-up (`--warmup 0`).")
    w.append("")
    w.extend(hold_text(result))
    slo = result["ttft_slo_ms"]
    if slo is None:
        w.append("Goodput: omitted, no TTFT SLO stated (scenario key `ttft_slo_ms` or `--ttft-slo-ms`).")
    else:
        src = "`--ttft-slo-ms`" if result.get("ttft_slo_from") == "--ttft-slo-ms" else "the scenario's `ttft_slo_ms`"
        w.append(f"Goodput: requests/s whose TTFT is at most {slo:g} ms ({src}), over the run's wall time.")
    w.append("")
    w.append(f"Command: `{plan['command']}`")
    w.append("")
    if result.get("sweep"):
        w.extend(_sweep_markdown(result))
    w.append("## Results" + (f" at {result['capacity']:,} blocks" if result.get("capacity") is not None else ""))
    w.append("")
    w.append(f"Medians over repetitions, with the range (min - max) when the runs differ. Baseline: `{base}`. "
             "A difference is called only when the arms' ranges do not overlap and the medians differ by more than "
             "the wider range; anything else is reported as no difference.")
    w.append("")
    w.extend(_results_table(result["by_policy"], result["verdicts"], policies, HEADLINE + CONTEXT, slo))
    w.append("")
    w.append("## Where the difference comes from")
    w.append("")
    w.extend(_gain_text(result) or ["- one policy only: nothing to compare."])
    w.append("")
    if result["traffic"]:
        w.append("## By traffic component")
        w.append("")
        w.append("Client numbers of each `[[traffic]]` component (rates over the run's wall time), medians over "
                 "repetitions with the range, and the same rule for calling a difference.")
        w.append("")
        for name, t in result["traffic"].items():
            w.append(f"**`{name}`**")
            w.append("")
            w.extend(_results_table(t["by_policy"], t["verdicts"], policies, COMPONENT, slo))
            w.append("")
    w.append("By family kind (collector, medians over repetitions"
             + (f", at {result['capacity']:,} blocks):" if result.get("capacity") is not None else "):"))
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
    w.append("| run | policy | KV blocks | server ready (s) | requests | wall (s) | hit rate | rebuilt | TTFT p50 | "
             "CPU s: server / EngineCore |")
    w.append("|---|---|---|---|---|---|---|---|---|---|")
    for r in result["runs"]:
        m = r["metrics"]
        kv = r.get("kv_blocks") or srv["kv_blocks"]
        w.append(f"| `{r['run_id']}` | `{r['policy']}` | {kv:,} | {r['ready_s'] or 0:.1f} | {r['requests_ok']:,} "
                 f"| {r['wall_s']:.1f} | {fmt(m['prefix_hit_rate'], 'pct')} | "
                 f"{fmt(m['rebuilt_from_eviction_blocks'], 'int')} | "
                 f"{fmt(m['ttft_p50_s'], 'ms')} | {r['cpu_s']['server']:.1f} / {r['cpu_s']['engine_core']:.1f} |")
    w.append("")
    return "\n".join(w)


def _results_table(by_policy: dict[str, Any], verdicts: dict[str, Any], policies: list[str],
                   metrics: list[tuple[str, str, int, str]], slo_ms: float | None) -> list[str]:
    """A Markdown table: one row per metric, a column per policy, then one per verdict against the baseline
    (goodput's row left out without an SLO)."""
    base = policies[0]
    w = ["| metric | " + " | ".join(f"`{p}`" for p in policies) + " | "
         + " | ".join(f"`{p}` vs `{base}`" for p in policies[1:]) + " |",
         "|" + "---|" * (2 * len(policies))]
    for key, label, _, unit in metrics:
        if key == "goodput_per_s" and slo_ms is None:
            continue
        cells = [_cell(by_policy[p][key], unit) for p in policies]
        calls = [_call(verdicts[p][key], unit) for p in policies[1:]]
        w.append(f"| {label} | " + " | ".join(cells) + " | " + " | ".join(calls) + " |")
    return w


def _sweep_markdown(result: dict[str, Any]) -> list[str]:
    """The ``--capacities`` section: per capacity and policy hit rate, TTFT, goodput and the KV saved."""
    sw = result["sweep"]
    policies = result["policies"]
    slo = result["ttft_slo_ms"]
    saved = {(k["capacity"], k["policy"]): k for k in sw["kv_saved"]}
    w = ["## KV pool sweep: KV saved at equal hit rate", ""]
    w.append("For each policy at capacity c with median prefix hit rate h (collector): c', the capacity at which "
             "lru reaches h (lru's median hit rate over the swept capacities, made non-decreasing, read "
             "piecewise-linearly), and KV saved = 1 - c / c'. Above lru's best hit rate in the sweep only a lower "
             "bound is known (lru needs more than the largest capacity); below lru's worst, an upper bound. "
             "Medians over repetitions with the range.")
    w.append("")
    cols = ["prefix hit rate", "TTFT p50", "TTFT p90"] + (["goodput"] if slo is not None else [])
    w.append("| KV blocks | policy | " + " | ".join(cols) + " | KV saved at equal hit rate |")
    w.append("|" + "---|" * (3 + len(cols)))
    for c in sw["capacities"]:
        bp = sw["per_capacity"][str(c)]["by_policy"]
        for p in policies:
            cells = [_cell(bp[p]["prefix_hit_rate"], "pct"), _cell(bp[p]["ttft_p50_s"], "ms"),
                     _cell(bp[p]["ttft_p90_s"], "ms")]
            if slo is not None:
                cells.append(_cell(bp[p]["goodput_per_s"], "rate"))
            w.append(f"| {c:,} | `{p}` | " + " | ".join(cells) + f" | {saved_text(saved[(c, p)])} |")
    w.append("")
    for c in sw["capacities"]:
        if c == result["capacity"]:
            continue
        v = sw["per_capacity"][str(c)]
        w.append(f"<details><summary>Results at {c:,} blocks</summary>")
        w.append("")
        w.extend(_results_table(v["by_policy"], v["verdicts"], policies, HEADLINE + CONTEXT, slo))
        w.append("")
        w.append("</details>")
        w.append("")
    return w


def write_report(out: Path, result: dict[str, Any]) -> None:
    """``ab.json``, ``plots/*.png`` (when matplotlib is installed) and ``report.md`` in ``out``."""
    try:
        from kvfabric.bench.plots import write_plots  # (imports matplotlib, which is optional)

        plots = write_plots(out / "plots", result)
    except ImportError:
        plots = {}
    slim = {k: v for k, v in result.items() if k != "runs"}
    heavy = ("ttfts", "ttfts_by_component", "rebuilt_s", "families")
    slim["runs"] = [{k: v for k, v in r.items() if k not in heavy} for r in result["runs"]]
    (out / "ab.json").write_text(json.dumps(slim, indent=1) + "\n")
    (out / "report.md").write_text(render_markdown(result, plots))
