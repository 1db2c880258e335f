"""``python -m kvfabric.bench.serving_results``: docs/serving-results.md, rendered from the committed A/B results.

Inputs (each folder is one ``kvfabric ab --out`` directory, as the command wrote it; its ``ab.json`` is read, and
where the folder keeps them, the client's per-request records under ``runs/`` for the missed-reuse section):

* ``benchmarks/results/gpu/serving/<name>/``: runs on a GPU (``benchmarks/gpu/ab_h200.sh``), each folder with the
  ``environment.txt`` of its sittings (the card is read from it);
* ``benchmarks/results/serving/cpu_ab/<name>/``: the same A/B on CPU, ``kvfabric sim-serve`` with the H200 latency
  model (``kvfabric/sim/latency.py``);
* ``benchmarks/results/serving/cpu_sweep/<name>/``: ``kvfabric ab --capacities`` on CPU (KV saved at equal hit
  rate);
* ``benchmarks/results/serving/cpu_screen/<name>/``: one run per policy without latency (which victims each
  policy picks).

Invariants: the page is a pure function of those files (same files, same bytes: ``--check`` compares); every
number on it is read from them; a table is written only with rows (a source folder without an ``ab.json``, or an
``ab.json`` without runs, is an error, not an empty table); a difference is called only where the A/B's own rule
(:func:`kvfabric.bench.report.verdict`) calls it, otherwise it reads "none".
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvfabric.argtypes import HelpFormatter
from kvfabric.bench.missed_reuse import missed_reuse_of_folder
from kvfabric.bench.report import COMPONENT, HEADLINE, NO_CALL, fmt, hold_text, verdict
from kvfabric.bench.servers import split_arm

ROOT = Path(__file__).resolve().parents[2]
RESULTS = Path("benchmarks/results")
PAGE = Path("docs/serving-results.md")

GPU = RESULTS / "gpu" / "serving"
CPU_AB = RESULTS / "serving" / "cpu_ab"
CPU_SWEEP = RESULTS / "serving" / "cpu_sweep"
CPU_SCREEN = RESULTS / "serving" / "cpu_screen"

#: The headline rows the page shows (a subset of the report's, same keys and units).
PAGE_METRICS = ("prefix_hit_rate", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "e2e_p50_s", "tpot_p50_s",
                "requests_per_s", "goodput_per_s", "rebuilt_from_eviction_blocks", "wasted_prefill_tokens")
COMPONENT_METRICS = ("ttft_p50_s", "ttft_p90_s", "e2e_p50_s", "requests_per_s", "goodput_per_s")

#: Revisit-heavy long-context scenarios (the issue's TTFT and throughput targets apply to these).
LONG_CONTEXT = ("rag_document_revisit", "long_conversation_return", "agent_tool_loop", "trace_mooncake_arrivals")
PEERS = ("lfu", "slru", "fifo", "tlru")


class ResultsError(ValueError):
    """A results folder the page needs is missing or holds no rows."""


@dataclass(frozen=True)
class Result:
    """One ``kvfabric ab`` output directory: its ``ab.json`` and where it lies (relative to the repository)."""

    path: Path
    data: dict[str, Any]
    root: Path = ROOT

    def has_plot(self, name: str) -> bool:
        return (self.root / self.path / "plots" / name).is_file()

    @property
    def scenario(self) -> str:
        return str(self.data["plan"]["scenario"]["name"])

    @property
    def policies(self) -> list[str]:
        return list(self.data["policies"])

    @property
    def cards(self) -> list[str]:
        """The GPU(s) its sittings ran on, from the folder's ``environment.txt`` (nvidia-smi's name column)."""
        env = self.root / self.path / "environment.txt"
        if not env.is_file():
            return []
        names = [line.split(",")[0].strip() for line in env.read_text().splitlines() if line.startswith("NVIDIA")]
        return list(dict.fromkeys(names))

    @property
    def runs_per_policy(self) -> list[int]:
        """How many runs each policy got, in :attr:`policies`' order (unequal in an A/B cut short)."""
        return [sum(run["policy"] == p for run in self.data["runs"]) for p in self.policies]

    @property
    def planned_arms(self) -> int:
        plan = self.data["plan"]
        return len(self.policies) * len(plan.get("capacities") or [None]) * int(plan["repeat"])

    @property
    def complete(self) -> bool:
        return len(self.data["runs"]) >= self.planned_arms

    def median(self, policy: str, key: str) -> float | None:
        entry = self.data["by_policy"].get(policy, {}).get(key)
        return None if entry is None else entry.get("median")


def load(folder: Path, root: Path = ROOT) -> list[Result]:
    """Every ``ab.json`` directly under ``folder`` (one per sub-folder), sorted by name; none when it is absent."""
    base = root / folder
    if not base.is_dir():
        return []
    out = []
    for sub in sorted(p for p in base.iterdir() if p.is_dir()):
        f = sub / "ab.json"
        if not f.is_file():
            raise ResultsError(f"{sub.relative_to(root)}: no ab.json (a results folder must hold what ab wrote)")
        data = json.loads(f.read_text())
        if not data.get("runs"):
            raise ResultsError(f"{f.relative_to(root)}: no runs")
        out.append(Result(sub.relative_to(root), data, root))
    return out


# -- rendering ----------------------------------------------------------------------------------------------------
_UNITS = {k: u for k, _, _, u in HEADLINE} | {k: u for k, _, _, u in COMPONENT} | {"e2e_p50_s": "ms"}
_LABELS = {k: label for k, label, _, _ in HEADLINE} | {"goodput_per_s": "goodput (requests/s within the SLO)"}


def _table(header: list[str], rows: Iterable[list[str]]) -> list[str]:
    rows = list(rows)
    if not rows:
        raise ResultsError(f"a table ({' | '.join(header)}) would have no rows")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines


def _cell(entry: dict[str, Any] | None, unit: str) -> str:
    """Median, and the range when the runs differ."""
    if entry is None or entry.get("median") is None:
        return "n/a"
    text = fmt(entry["median"], unit)
    if entry.get("min") is not None and entry.get("max") is not None and entry["min"] != entry["max"]:
        text += f" ({fmt(entry['min'], unit)} - {fmt(entry['max'], unit)})"
    return text


def verdict_text(v: dict[str, Any] | None) -> str:
    """The A/B's verdict as the page says it: the relative change where a difference is called, else "none"."""
    if v is None:
        return "n/a"
    if v["call"] in NO_CALL or v.get("relative") is None:
        return "none" if v["call"] == "no difference" else v["call"]
    return f"{v['call']}: {v['relative'] * 100:+.1f} %"


def _ab_section(r: Result, title: str) -> list[str]:
    d = r.data
    plan = d["plan"]
    base = d["baseline"]
    others = [p for p in r.policies if p != base]
    got = r.runs_per_policy
    # (An A/B cut short gives its policies different counts: each is named with its own.)
    reps = (f"{got[0]} repetitions of {', '.join(f'`{p}`' for p in r.policies)}" if len(set(got)) == 1 else
            "repetitions: " + ", ".join(f"`{p}` {n}" for p, n in zip(r.policies, got, strict=True)))
    iso = plan.get("isolated")
    slo = d.get("ttft_slo_ms")
    out = [f"### {title}: `{r.scenario}`", ""]
    n = len(d["runs"])
    out.append(f"{n} run{'' if n == 1 else 's'} ({reps}"
               f"{', interleaved' if plan.get('order') else ''}"
               f"{', isolated arms' if iso else ', arms not isolated' if iso is False else ''}), "
               f"KV pool {plan['arms'][0].get('kv_blocks') or plan['scenario']['server']['kv_blocks']:,} blocks"
               + (f", TTFT SLO {slo:g} ms" if slo else "") + f". Source: [`{r.path}/`](../{r.path}/report.md).")
    out.append("")
    if not r.complete:
        out += [f"**Incomplete:** {len(d['runs'])} of {r.planned_arms} planned arms ran ({plan['repeat']} "
                "repetitions per policy were planned); the medians and ranges are over the runs that exist.", ""]
    sittings = plan.get("sittings") or []
    if len(sittings) > 1:
        out += [f"Ran in {len(sittings)} sittings (`kvfabric ab --resume`).", ""]
    out += hold_text(d)
    if any(run.get("warmup_in_collector") for run in d["runs"]):
        out += ["The collector's numbers (hit rate, rebuilt, wasted prefill) include the warm-up of 8 requests "
                "shorter than one block (its collector file was gone before the warm-up could be split off); the "
                "client's numbers (TTFT, E2E, requests/s) exclude it.", ""]
    header = ["metric", *[f"`{p}`" for p in r.policies], *[f"`{p}` vs `{base}`" for p in others]]
    rows = []
    for key in PAGE_METRICS:
        if key not in d["by_policy"][base]:
            continue
        unit = _UNITS.get(key, "")
        rows.append([_LABELS.get(key, key), *[_cell(d["by_policy"][p].get(key), unit) for p in r.policies],
                     *[verdict_text(d["verdicts"][p].get(key)) for p in others]])
    out += _table(header, rows)
    traffic = d.get("traffic") or {}
    if traffic:
        out += ["", "By traffic component (client):", ""]
        rows = []
        for name, t in traffic.items():
            for key in COMPONENT_METRICS:
                if key not in t["by_policy"][base]:
                    continue
                unit = _UNITS.get(key, "")
                rows.append([f"{name}: {_LABELS.get(key, key)}",
                             *[_cell(t["by_policy"][p].get(key), unit) for p in r.policies],
                             *[verdict_text(t["verdicts"][p].get(key)) for p in others]])
        out += _table(["component: metric", *header[1:]], rows)
    plots = [p for p in ("ttft_cdf_by_component.png", "ttft_cdf.png", "hit_rate.png")
             if r.has_plot(p)]
    if plots:
        out += ["", " ".join(f"![{p}](../{r.path}/plots/{p})" for p in plots[:2])]
    out.append("")
    return out


def _sweep_section(r: Result) -> list[str]:
    sw = r.data.get("sweep")
    if not sw:
        raise ResultsError(f"{r.path}: a sweep folder whose ab.json has no sweep")
    out = [f"### `{r.scenario}`: capacities {', '.join(f'{c:,}' for c in sw['capacities'])} blocks", "",
           f"Source: [`{r.path}/`](../{r.path}/report.md).", ""]
    rows = []
    for k in sw["kv_saved"]:
        saved = k.get("saved")
        text = "n/a" if saved is None else f"{saved * 100:.0f} %"
        if k.get("bound") == "lower":
            text = ">= " + text
        elif k.get("bound") == "upper":
            text = "<= " + text
        lru_c = k.get("lru_capacity")
        rows.append([f"{k['capacity']:,}", f"`{k['policy']}`", fmt(k.get("hit_rate"), "pct"),
                     "n/a" if lru_c is None else f"{lru_c:,.0f}", text])
    out += _table(["capacity (blocks)", "policy", "prefix hit rate", "LRU needs (blocks)", "KV saved"], rows)
    for p in ("hit_rate_vs_capacity.png", "ttft_vs_capacity.png"):
        if r.has_plot(p):
            out += ["", f"![{p}](../{r.path}/plots/{p})"]
    out.append("")
    return out


def _screen_section(results: list[Result]) -> list[str]:
    policies = list(dict.fromkeys(p for r in results for p in r.policies))
    rows = [[f"`{r.scenario}`", *[fmt(r.median(p, "prefix_hit_rate"), "pct") if p in r.policies else "-"
                                   for p in policies]] for r in results]
    return [*_table(["scenario", *[f"`{p}`" for p in policies]], rows), ""]


def _change(r: Result, policy: str, key: str) -> str:
    base, other = r.median("lru", key), r.median(policy, key)
    if base is None or other is None or base == 0:
        return "n/a"
    return f"{(other / base - 1) * 100:+.0f} %"


def _agreement_section(gpu: list[Result], cpu: list[Result]) -> list[str]:
    """GPU against the CPU latency model, scenario by scenario and policy by policy where both ran: LRU's medians
    and each policy's change against LRU, side by side (the shape the CPU model must reproduce)."""
    out: list[str] = []
    for c in cpu:
        # Only GPU A/Bs that ran every planned arm: a comparison of shapes needs the spread of complete arms (an
        # A/B cut short, possibly one run of a policy, shows in its own section, marked incomplete).
        same = [g for g in gpu if g.scenario == c.scenario and g.complete and "lru" in g.policies
                and "lru" in c.policies]
        if not same:
            continue
        g = max(same, key=lambda r: len(r.data["runs"]))
        both = [p for p in g.policies if p != "lru" and p in c.policies]
        if not both:
            continue
        card = " + ".join(g.cards) or "GPU"
        out += [f"### `{c.scenario}`: {card} ([`{g.path}/`](../{g.path}/report.md)) against CPU "
                f"([`{c.path}/`](../{c.path}/report.md))", ""]
        rows = []
        for key in ("prefix_hit_rate", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "e2e_p50_s", "requests_per_s"):
            unit = _UNITS.get(key, "")
            row = [_LABELS.get(key, key), fmt(g.median("lru", key), unit), fmt(c.median("lru", key), unit)]
            for p in both:
                row += [_change(g, p, key), _change(c, p, key)]
            rows.append(row)
        header = ["metric", f"`lru` on {card}", "`lru` on CPU"]
        for p in both:
            header += [f"`{p}` vs `lru` on {card}", f"`{p}` vs `lru` on CPU"]
        out += _table(header, rows)
        out.append("")
    return out


def _missed_reuse_section(r: Result) -> list[str]:
    """Which requests the A/B's policies change (:mod:`kvfabric.bench.missed_reuse`), and what that means for TTFT
    p50: empty when the folder keeps no per-request files, when LRU is not in it, or when no policy misses reuse."""
    best = _best(r)
    if best is None or "lru" not in r.policies:
        return []
    stats = missed_reuse_of_folder(r.root / r.path, r.data)
    if not stats or not any(m.missed for m in stats):
        return []
    by = {m.policy: m for m in stats}
    card = " + ".join(r.cards) or "GPU"
    out = [f"### `{r.scenario}` on {card} ([`{r.path}/`](../{r.path}/report.md))", ""]
    rows = [[f"`{m.policy}`", f"{m.requests:,}", f"{m.missed:,} ({m.share * 100:.1f} %)",
             fmt(m.missed_tokens_p50, ""), fmt(m.ttft_p50_missed_s, "ms"), fmt(m.ttft_p50_rest_s, "ms"),
             fmt(m.ttft_p50_s, "ms")] for m in stats]
    out += _table(["policy", "requests", "missed reuse", "tokens recomputed (median)", "TTFT p50: missed reuse",
                   "TTFT p50: the rest", "TTFT p50: all"], rows)
    lru, top = by["lru"], by[best]
    text = (f"Under `lru` {lru.share * 100:.1f} % of the requests missed reuse (a median "
            f"{fmt(lru.missed_tokens_p50, '')} tokens recomputed each), under `{best}` {top.share * 100:.1f} %.")
    if max(lru.share, top.share) < 0.5:
        text += (" Fewer than half of the requests miss reuse under either policy, so the median request is one "
                 "whose own prefill the policy does not change: the policy moves the tail, where the requests that "
                 f"miss reuse are (their TTFT p50 {fmt(lru.ttft_p50_missed_s, 'ms')} under `lru`), and TTFT p50 is "
                 "the TTFT of requests it leaves alone (the rest: "
                 f"{fmt(lru.ttft_p50_rest_s, 'ms')} under `lru`, {fmt(top.ttft_p50_rest_s, 'ms')} under `{best}`). "
                 "A 20 % lower TTFT p50 needs traffic where LRU makes more than half of the requests recompute, or "
                 "a shorter wait for the requests that recompute nothing.")
    else:
        text += (" At least half of the requests miss reuse under one policy, so its choice reaches the median "
                 "request.")
    return [*out, "", text, ""]


def _missed_reuse_part(gpu: list[Result]) -> list[str]:
    sections = [line for r in gpu if r.complete and r.scenario in LONG_CONTEXT for line in _missed_reuse_section(r)]
    if not sections:
        return []
    return ["## Why TTFT p50 moves less than the tail", "",
            "A scenario's requests are the same in every run, so each can be compared with itself. A request "
            "**missed reuse** when it prefilled at least one block more than in the run, of any policy, where it "
            "prefilled least: context one run kept cached and this run recomputed (`kvfabric/bench/missed_reuse.py`;"
            " the client's per-request records under each folder's `runs/`, pooled over a policy's runs). Complete "
            "A/Bs of the long-context scenarios:", "", *sections]


# -- targets ------------------------------------------------------------------------------------------------------
# What the targets judge a configuration by, with the direction that is better (-1: lower).
_TARGET_CALLS: tuple[tuple[str, int], ...] = (("ttft_p50_s", -1), ("ttft_p90_s", -1), ("requests_per_s", 1))


def _calls(r: Result, base: str, other: str) -> tuple[int, int]:
    """How many of :data:`_TARGET_CALLS` the A/B calls better and worse for ``other`` against ``base``."""
    by = r.data["by_policy"]
    calls = [verdict(by[base][k], by[other][k], d)["call"] for k, d in _TARGET_CALLS
             if by[base].get(k) and by[other].get(k)]
    return calls.count("better"), calls.count("worse")


def _best(r: Result) -> str | None:
    """KVFabric's configuration (not LRU, not a peer's policy alone) the A/B calls better than LRU on the most of
    TTFT p50, TTFT p90 and requests/s (net of metrics called worse), the lowest median TTFT p50 among equals: the
    run's candidate for "best configuration". A lower median the A/B does not call a difference is noise, so it
    decides only between configurations the calls cannot tell apart. ``POLICY+hold`` wins over its own ``POLICY``
    only where the A/B calls it better than ``POLICY`` on one of those metrics and worse on none; otherwise the two
    are the same in effect and the simpler one (hold off) stands."""
    cands = [p for p in r.policies if p != "lru" and p not in PEERS and r.median(p, "ttft_p50_s") is not None]
    if not cands:
        return None

    def rank(p: str) -> tuple[int, float]:
        better, worse = _calls(r, "lru", p) if "lru" in r.policies else (0, 0)
        return -(better - worse), r.median(p, "ttft_p50_s")  # type: ignore[return-value]

    top = min(cands, key=rank)
    plain, held = split_arm(top)
    if held and plain in cands:
        better, worse = _calls(r, plain, top)
        if not better or worse:
            return plain
    return top


def _rel(v: dict[str, Any] | None) -> float | None:
    return None if v is None else v.get("relative")


def _against_peer(r: Result, best: str, peer: str) -> tuple[str, bool]:
    """``best`` against ``peer`` on TTFT p50 and p90 by the A/B's own rule (ranges apart and the medians further
    apart than the wider range): the text, and whether ``best`` is ahead (better on one, worse on neither)."""
    calls = {key: verdict(r.data["by_policy"][peer][key], r.data["by_policy"][best][key], -1)
             for key in ("ttft_p50_s", "ttft_p90_s")}
    text = ", ".join(f"{_LABELS[k].removeprefix('TTFT ')} {verdict_text(c)}" for k, c in calls.items())
    ahead = any(c["call"] == "better" for c in calls.values()) and all(c["call"] != "worse" for c in calls.values())
    return f"vs `{peer}`: {text}", ahead


def _within_one_percent(r: Result, best: str, v: dict[str, Any]) -> tuple[str, str]:
    """The "within 1 % of LRU" target: not met where the A/B calls a difference over 1 %; met where every median is
    within 1 %; otherwise undecided: no difference is called, but the runs' spread is too wide to resolve 1 %."""
    keys = [k for k in PAGE_METRICS if (k.endswith("_s") or "per_s" in k) and v.get(k) is not None]
    called = [(abs(_rel(v[k]) or 0.0), k) for k in keys if v[k].get("call") in ("better", "worse")]
    worst = max((abs(_rel(v[k]) or 0.0), k) for k in keys)
    if called and max(called)[0] > 0.01:
        c = max(called)
        return f"{_LABELS.get(c[1], c[1])}: {verdict_text(v[c[1]])}", "not met"
    if worst[0] <= 0.01:
        return f"largest change {worst[0] * 100:.1f} % ({_LABELS.get(worst[1], worst[1])})", "met"
    if any(str(v[k].get("call", "")).startswith("no spread") for k in keys):
        return (f"medians up to {worst[0] * 100:.1f} % apart ({_LABELS.get(worst[1], worst[1])}); one run of an arm: "
                "no spread to call a difference against", "undecided: too few runs")
    by = r.data["by_policy"]
    spread = max((by[p][k]["spread"] or 0.0) / by[p][k]["median"] for p in ("lru", best) for k in keys
                 if by[p].get(k) and by[p][k].get("median"))
    return (f"no difference called (the arms' ranges overlap); medians up to {worst[0] * 100:.1f} % apart "
            f"({_LABELS.get(worst[1], worst[1])}); an arm's runs spread up to {spread * 100:.1f} % of its median",
            "undecided: the spread is wider than 1 %")


def _met(met: bool, reps: int, yes: str = "met", no: str = "not met") -> str:
    """A target's verdict: one run of an arm has no spread, so nothing is called and the target is undecided."""
    return yes if met else "undecided: too few runs" if reps < 2 else no


def targets(gpu: list[Result], sweeps: list[Result], cpu: Iterable[Result] = ()) -> list[list[str]]:
    """One row per (target, scenario) the results can speak to: what was measured and whether it is met. GPU A/Bs
    first; the CPU A/Bs (latency model) are labelled so."""
    rows: list[list[str]] = []
    for r, card in [(r, " + ".join(r.cards) or "GPU") for r in gpu] + [(r, "CPU, latency model") for r in cpu]:
        if "lru" not in r.policies:
            continue
        best = _best(r)
        if best is None:
            continue
        v = r.data["verdicts"][best]
        runs = dict(zip(r.policies, r.runs_per_policy, strict=True))
        # The repetitions of the pair a row compares (a policy of the A/B not run yet does not lower them).
        reps = min(runs["lru"], runs[best])
        # The folder tells apart two A/Bs of one scenario on the same kind of machine.
        where = f"{card}, {reps} repetition{'s' if reps != 1 else ''}, `{r.path.name}/`"
        # A verdict from fewer repetitions than planned says so: the targets ask for the full A/B.
        planned = r.data["plan"]["repeat"]
        tag = ("" if r.complete else f" (incomplete: {reps} of {planned} repetitions)" if reps < planned
               else f" (incomplete A/B: {len(r.data['runs'])} of {r.planned_arms} arms; these ran all {planned})")
        if r.scenario in LONG_CONTEXT:
            for key in ("ttft_p50_s", "ttft_p90_s"):
                rel, call = _rel(v.get(key)), (v.get(key) or {}).get("call")
                met = call == "better" and rel is not None and rel <= -0.20
                rows.append([f"{_LABELS[key]} >= 20 % below LRU", f"`{r.scenario}` (`{best}`; {where})",
                             verdict_text(v.get(key)), _met(met, reps) + tag])
            thr = [(k, _rel(v.get(k)), (v.get(k) or {}).get("call")) for k in ("requests_per_s", "goodput_per_s")]
            met = any(c == "better" and x is not None and x >= 0.10 for _, x, c in thr)
            rows.append(["requests/s or goodput >= 10 % above LRU", f"`{r.scenario}` (`{best}`; {where})",
                         "; ".join(f"{k.removesuffix('_per_s')}: {verdict_text(v.get(k))}" for k, _, _ in thr),
                         _met(met, reps) + tag])
            # Only peers with runs: a peer the A/B has not reached yet is neither beaten nor ahead.
            peers = [p for p in r.policies if p in PEERS and r.median(p, "ttft_p50_s") is not None]
            if peers:
                against = [_against_peer(r, best, p) for p in peers]
                # "Every peer" is a claim about all of them: ahead of those run says which were not.
                absent = ", ".join(f"`{p}`" for p in PEERS if p not in peers)
                ahead = f"ahead of the peers run; not run: {absent}" if absent else "ahead"
                rows.append(["ahead of every peer policy (TTFT p50 and p90)", f"`{r.scenario}` (`{best}`; {where})",
                             "; ".join(text for text, _ in against),
                             _met(all(a for _, a in against), min(runs[p] for p in (best, *peers)),
                                  ahead, "not ahead") + tag])
        elif r.scenario == "ordinary_unique_cold":
            measured, call = _within_one_percent(r, best, v)
            rows.append(["within 1 % of LRU on every latency and throughput metric",
                         f"`{r.scenario}` (`{best}`; {where})", measured, call + tag])
    for r in sweeps:
        for k in r.data["sweep"]["kv_saved"]:
            if k["policy"] == "lru" or k.get("saved") is None:
                continue
            met = k["saved"] >= 0.25 and k.get("bound") != "upper"
            rows.append(["same hit rate as LRU with >= 25 % fewer KV blocks (CPU sweep)",
                         f"`{r.scenario}` (`{k['policy']}` at {k['capacity']:,})",
                         f"{'>= ' if k.get('bound') == 'lower' else ''}{k['saved'] * 100:.0f} % saved",
                         "met" if met else "not met"])
    return rows


# -- the page -----------------------------------------------------------------------------------------------------
def render(root: Path = ROOT) -> str:
    gpu, cpu_ab, sweeps, screen = (load(f, root) for f in (GPU, CPU_AB, CPU_SWEEP, CPU_SCREEN))
    if not (gpu or cpu_ab or sweeps or screen):
        raise ResultsError("no results at all under benchmarks/results/{gpu/serving,serving/*}")
    w = ["# Serving results: where the policies pay, measured", "",
         "Generated by `python -m kvfabric.bench.serving_results` from the results folders each section names; "
         "every number below is read from them. Each A/B is `kvfabric ab` (fresh server per arm, arms interleaved, "
         "warm-up excluded; docs/design.md §8.3). A difference is called only where the arms' ranges do not "
         "overlap and the medians differ by more than the wider range; otherwise it reads \"none\".", ""]
    w += ["## Targets", ""]
    rows = targets(gpu, sweeps, cpu_ab)
    if rows:
        w += _table(["target", "scenario (policy)", "measured", "verdict"], rows)
    else:
        w.append("No run yet speaks to the targets (they need H200 runs or a capacity sweep).")
    w.append("")
    if gpu:
        w += ["## On the GPU: vLLM 0.26.0, Llama-3-8B shape (dummy weights), compiled", "",
              "Each folder's `environment.txt` holds its machine, software and serve command, per sitting.", ""]
        for r in gpu:
            w += _ab_section(r, " + ".join(r.cards) or "GPU")
    if cpu_ab:
        w += ["## On CPU, with the H200 latency model", "",
              "`kvfabric sim-serve`: vLLM's real server, scheduler and KV cache manager on CPU, each step's forward "
              "pass timed by the model fitted to H200 measurements (`kvfabric/sim/latency.py`).", ""]
        for r in cpu_ab:
            held = any(split_arm(x)[1] for x in r.policies)
            w += _ab_section(r, "CPU, with cache-aware scheduling" if held else "CPU")
    w += _missed_reuse_part(gpu)
    agreement = _agreement_section(gpu, cpu_ab)
    if agreement:
        w += ["## GPU against the CPU model", "",
              "The same scenario and policies on a GPU and on CPU with the latency model: LRU's medians, and each "
              "policy's change of the median against LRU's (the ranges and the verdicts are in the sections "
              "above). The CPU model was fitted to H200 measurements; where the GPU's card is another, absolute "
              "times differ by the cards' speed as well as by the model's error.", ""]
        w += agreement
    if sweeps:
        w += ["## KV saved at equal hit rate (CPU, latency model)", "",
              "For each policy and pool: the pool LRU needs for the same prefix hit rate (LRU's median hit rate "
              "over the swept pools, made non-decreasing, read between them as straight lines), and the share of "
              "it saved; `>=` where the policy's hit rate is above LRU's best in the sweep.", ""]
        for r in sweeps:
            w += _sweep_section(r)
    if screen:
        w += ["## Screening: prefix hit rate per policy (CPU, no latency)", "",
              f"One run per policy, the forward pass taking no time ([`{CPU_SCREEN}/`](../{CPU_SCREEN}/README.md)): "
              "which victims each policy picks on each scenario's pool and traffic; no latency is measured.", ""]
        w += _screen_section(screen)
    return "\n".join(w).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvfabric.bench.serving_results", formatter_class=HelpFormatter,
                                 description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--out", default=str(ROOT / PAGE), help="the page to write")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 when the page differs")
    args = ap.parse_args(argv)
    try:
        text = render()
    except ResultsError as e:
        print(f"serving_results: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    if args.check:
        if not out.is_file() or out.read_text() != text:
            print(f"serving_results: {out} is not what the results render; run python -m "
                  "kvfabric.bench.serving_results", file=sys.stderr)
            return 1
        return 0
    out.write_text(text)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
