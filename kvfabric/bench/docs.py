"""``python -m kvfabric.bench.docs [--check] [--root DIR]``: every generated table, figure and plot of the docs, from
the committed results files, in one command.

What it renders:

* whole generated pages: ``docs/policy-results.md``'s generated part and its plots
  (:mod:`kvfabric.bench.policy_table`, from ``benchmarks/results/policy_sweep.json``), ``docs/serving-results.md``
  (:func:`kvfabric.bench.serving_results.render`, from the A/B results folders);
* generated blocks inside hand-written pages (``README.md``, ``README.zh-CN.md``, ``docs/*.md``), by name.

Block syntax (a contract: other writers place these markers; this module owns what is between them)::

    <!-- BEGIN GENERATED costs -->
    (anything: replaced by the renderer's output for ``costs``)
    <!-- END GENERATED costs -->

Each marker is a line of its own, exactly as above; the name is one of :data:`BLOCKS` (lower case, digits, ``-``).
A block may appear in several pages and several times in one page; blocks do not nest. The text between the
markers is replaced by the block's rendering, which ends with a newline; links in it are relative to the page
that holds it (so ``README.md`` and ``docs/fleet.md`` get the same numbers with different link prefixes). Block
names and what each shows: :data:`BLOCKS` (each renderer's docstring).

Invariants:

* every page is a pure function of the committed results files (same files, same bytes): ``--check`` re-renders
  into memory and exits 1 when any page or block differs from what is committed, writing nothing;
* every number in a block is read from a results file the block links to, and that file was written by the
  command the block names; a cited file that is missing is an error, as is any ``benchmarks/results/...`` path a
  page mentions that does not exist;
* a table is written only with rows and a plot only with data: a renderer that would emit an empty table or plot
  raises (:class:`DocsError` or :class:`~kvfabric.bench.table_rows.MissingRows`), and the command exits 2 with
  one line saying which file lacks what; so does a block name this module does not know, or a marker without its
  end;
* a ratio is printed with the precision its spread over runs supports (:func:`ratio_range`), with that spread, and
  "within noise" where the spread includes 1.0.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvfabric.argtypes import HelpFormatter
from kvfabric.bench import learned_table, policy_table, serving_results
from kvfabric.bench.report import fmt
from kvfabric.bench.table_rows import MissingRows, gap_closed, need, trace_name

ROOT = Path(__file__).resolve().parents[2]
RESULTS = "benchmarks/results"
POLICY_PAGE = "docs/policy-results.md"
POLICY_DATA = f"{RESULTS}/policy_sweep.json"
SERVING_PAGE = "docs/serving-results.md"
#: The hook-overhead runs the ``costs`` block publishes (each written by ``bench_hook_overhead.py --out``).
HOOK_RUNS = f"{RESULTS}/hook_overhead_repeats"
HOOK_RUN_GLOB = "fresh_clone_*.json"


class DocsError(ValueError):
    """A page cannot be rendered from the committed results: a cited file is missing, a table would be empty, a
    marker is malformed or names no known block."""


# --------------------------------------------------------------------------------------------- formatting


def decimals_for(spread: float) -> int:
    """Decimals a figure with this spread (max - min over runs) supports: the spread's first significant digit,
    1 to 3 (a spread of 0.03 -> 2 decimals, 0.004 -> 3, 0.2 -> 1; none measured -> 3)."""
    if spread <= 0:
        return 3
    return min(3, max(1, math.ceil(-math.log10(spread))))


def ratio_range(values: list[float]) -> tuple[str, bool]:
    """``"1.04-1.07x"`` (or ``"1.046x"`` when the runs agree to the printed precision) and whether the range
    includes 1.0 (the difference from the baseline is within noise)."""
    if not values:
        raise DocsError("a ratio with no run behind it")
    lo, hi = min(values), max(values)
    d = decimals_for(hi - lo)
    a, b = f"{lo:.{d}f}", f"{hi:.{d}f}"
    return (f"{a}x" if a == b else f"{a}-{b}x"), lo <= 1.0 <= hi


def _table(header: list[str], rows: list[list[str]], what: str) -> list[str]:
    if not rows:
        raise DocsError(f"{what}: the table would have no rows")
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


@dataclass(frozen=True)
class Context:
    """Where a block is rendered: the repository (or a copy of it) and the page, relative to it, that holds the
    block (links are relative to that page)."""

    root: Path
    page: str

    def rel(self, path: str) -> str:
        return os.path.relpath(path, os.path.dirname(self.page) or ".")

    def link(self, path: str) -> str:
        return f"[`{path}`]({self.rel(path)})"

    def load(self, path: str) -> Any:
        """A cited results file (JSON), or :class:`DocsError` naming it when it is missing or unreadable."""
        f = self.root / path
        if not f.is_file():
            raise DocsError(f"{self.page}: cites {path}, which does not exist")
        try:
            return json.loads(f.read_text())
        except json.JSONDecodeError as exc:
            raise DocsError(f"{path}: not JSON ({exc})") from exc


def _get(d: dict[str, Any], key: str, path: str) -> Any:
    if key not in d or d[key] is None:
        raise DocsError(f"{path}: no {key!r}")
    return d[key]


# --------------------------------------------------------------------------------------------- blocks


def hook_runs(ctx: Context) -> list[tuple[str, dict[str, Any]]]:
    """The published hook-overhead runs: ``benchmarks/results/hook_overhead_repeats/fresh_clone_*.json``, by name."""
    folder = ctx.root / HOOK_RUNS
    files = sorted(folder.glob(HOOK_RUN_GLOB)) if folder.is_dir() else []
    if not files:
        raise DocsError(f"{ctx.page}: cites {HOOK_RUNS}/{HOOK_RUN_GLOB}, and no such file exists")
    return [(f"{HOOK_RUNS}/{f.name}", ctx.load(f"{HOOK_RUNS}/{f.name}")) for f in files]


HOOK_MODES = (("off", "plugin loaded, no `KVFABRIC_*` set"), ("recording", "records made, then dropped"),
              ("streaming", "records streamed to a collector"),
              ("adaptive_aging", "streaming, with `adaptive_aging` steering"))


def block_costs(ctx: Context) -> str:
    """``costs``: the hook's cost on vLLM's real scheduler (each mode's ratio to plain over the published runs of
    ``bench_hook_overhead.py``, the range of every round, each run's own verdict on its target, and the noise
    floor "off" shows) and each eviction policy's cost on traffic without sharing (``bench_policy_overhead.py``)."""
    runs = hook_runs(ctx)
    # The runs' commands differ only in their output file's number: name it N.
    cmds = sorted({re.sub(r"_\d+\.md", "_N.md", _get(r.get("meta", {}), "command", p)) for p, r in runs})
    built = {k for _, r in runs for k, v in r["meta"].get("compiled", {}).items() if v}
    missing = sorted({k for _, r in runs for k in r["meta"].get("compiled", {})} - built)
    w = [f"Scheduler-thread CPU time inside vLLM's `schedule()` + `update_from_output()`, vLLM's real scheduler on "
         f"CPU, each mode against plain vLLM in the same run (lockstep rounds), over {len(runs)} runs of "
         + ", ".join(f"`{c}`" for c in cmds) + " (" + ", ".join(ctx.link(p) for p, _ in runs) + ")"
         + ("; the hook's compiled parts built" if not missing else f"; compiled parts NOT built: {', '.join(missing)}")
         + ":", ""]
    rows = []
    targets: dict[str, float] = runs[0][1]["meta"].get("targets", {})
    for mode, label in HOOK_MODES:
        per_run = [_get(r, f"{mode}_vs_plain", p) for p, r in runs]
        text, noise = ratio_range(per_run)
        lo = min(_get(r, f"{mode}_round_ratio_range", p)[0] for p, r in runs)
        hi = max(_get(r, f"{mode}_round_ratio_range", p)[1] for p, r in runs)
        rounds, _ = ratio_range([lo, hi])
        verdicts = [r.get(f"{mode}_target_verdict") for _, r in runs]
        target = targets.get(mode)
        verdict = "-" if target is None else f"<= {target:.3f}x: " + ", ".join(str(v) for v in verdicts)
        note = "within noise" if noise else ""
        if mode == "off":
            note = ("the noise floor: with no `KVFABRIC_*` set the plugin installs nothing, so this measures "
                    "identical code")
        rows.append([f"{mode} ({label})", text, rounds, verdict, note])
    w += _table(["mode", "vs plain, over runs (ratio of medians)", "every round", "target: each run's verdict", ""],
                rows, "costs (hook)")
    spreads = [_get(r, "plain_spread", p) for p, r in runs]
    plain = [_get(r, "plain_median_s", p) for p, r in runs]
    loads = [x for _, r in runs for x in r["meta"].get("load_average_1m", [])]
    cores = _cores(runs[0][1]["meta"].get("machine", ""))
    w += ["", f"Plain vLLM's median per run: {min(plain):.2f}-{max(plain):.2f} s of CPU; its round-to-round spread "
          f"{min(spreads):.0%}-{max(spreads):.0%} (the machine's speed from round to round, which the lockstep "
          "cancels out of each round's ratios). A verdict is *met* when every round of the run is at or under the "
          "target, *not met* when every one is over it, *undecided* otherwise."]
    per_op = [v for _, r in runs for k, v in r.items() if k.startswith("per_op_added_us_")]
    if per_op:
        w[-1] += (f" Per allocate-and-free of a 4-block request on pools of 10^4 to 10^6 blocks, the hook (recording) "
                  f"adds {min(per_op):.1f}-{max(per_op):.1f} µs over runs and pool sizes.")
    if loads and cores and max(loads) > cores:
        w[-1] += (f" The machine ({runs[0][1]['meta']['machine']}) was busy: its 1-minute load average (this "
                  f"benchmark's processes included) was {min(loads):.1f}-{max(loads):.1f} while the runs measured.")
    return "\n".join(w) + "\n\n" + block_policy_overhead(ctx)


def block_policy_overhead(ctx: Context) -> str:
    """``policy-overhead``: each eviction policy's scheduler time against LRU with the same recording, on traffic
    without sharing where every admission evicts (``bench_policy_overhead.py``): median ratio, every round's ratio,
    the 1 % target's verdict. Also the second half of ``costs``."""
    w: list[str] = []
    po_path = f"{RESULTS}/policy_overhead.json"
    po = ctx.load(po_path)
    configs = {(c["policy"], bool(c["events"])): c for c in _get(po, "configurations", po_path)}
    rows = []

    def cell(c: dict[str, Any] | None) -> str:
        if c is None:
            return "-"
        rr = c["round_ratios"]
        text, noise = ratio_range(rr)
        median = f"{c['vs_baseline']:.{decimals_for(max(rr) - min(rr))}f}x"
        return f"{median} (rounds {text}): {c['verdict']}" + (", within noise" if noise else "")

    for policy in dict.fromkeys(p for p, _ in configs):
        if policy == "lru":
            continue
        rows.append([f"`{policy}`", cell(configs.get((policy, False))), cell(configs.get((policy, True)))])
    w += [f"Eviction policies on traffic without sharing, where every admission evicts (`{po['command']}`, "
          f"{po['repeats']} interleaved rounds, {ctx.link(po_path)}): scheduler time against LRU's, median ratio, "
          f"every round's own ratio, and the verdict on the target of at most {po['target']:.2f}x.", ""]
    w += _table(["policy", "alone, vs vLLM's LRU", "with recording, vs LRU with recording"], rows, "costs (policies)")
    loads = po.get("load_average_1m") or []
    cores = _cores(po.get("machine", ""))
    if loads and cores and max(loads) > cores:
        w += ["", f"The machine ({po['machine']}) was busy: its 1-minute load average (this benchmark included) "
              f"was {min(loads):.1f}-{max(loads):.1f} while the rounds ran, hence the rounds' spread."]
    return "\n".join(w) + "\n"


def _cores(machine: str) -> int:
    """The core count a results file's ``machine`` line names (0 when it names none)."""
    m = re.search(r"(\d+) cores", machine)
    return int(m.group(1)) if m else 0


def block_disk(ctx: Context) -> str:
    """``disk``: bytes on disk per request and per event of the demo's run in a DuckDB file and in a lake
    (``bench_retention.py``), and whether disk and memory stayed flat once retention ran."""
    path = f"{RESULTS}/retention.json"
    d = ctx.load(path)
    rows = []
    for b in _get(d, "bytes", path):
        what = "DuckDB file" if b["backend"] == "file" else "DuckLake (PostgreSQL catalog, local data)"
        rows.append([what, f"{b['bytes_per_request']:,.0f}", f"{b['bytes_per_event']:.1f}",
                     f"{b['net_bytes_per_request']:,.0f}", f"{b['net_bytes_per_event']:.1f}",
                     f"{b['empty_store_bytes'] / 1e6:.1f} MB"])
    b0 = d["bytes"][0]
    w = [f"On disk after the demo's run ({b0['requests']:,} requests, {b0['events']:,} events; `{d['command']}`, "
         f"{ctx.link(path)}):", ""]
    w += _table(["store", "bytes per request", "per event", "net of the empty store, per request", "per event",
                 "empty store"], rows, "disk")
    soak = _get(d, "soak", path)
    args = d["args"]
    parts = []
    for s in soak:
        v = s["verdict"]
        parts.append(f"{s['backend']}: disk {'flat' if v['disk_flat'] else 'NOT flat'} "
                     f"({v['pre_retention_disk_slope_bytes_per_s'] / 1024:.1f} KiB/s before retention, "
                     f"{v['last_half_disk_slope_bytes_per_s'] / 1024:.2f} KiB/s in the last half), memory "
                     f"{'flat' if v['rss_flat'] else 'NOT flat'}")
    w += ["", f"With `--retain {args['retain']:g}s` under {args['rate']:,} events/s for {args['duration']:g} s: "
          + "; ".join(parts) + "."]
    return "\n".join(w) + "\n"


def block_ingest(ctx: Context) -> str:
    """``ingest``: the collector's ingest rate over its Unix socket into DuckDB, unpaced and paced, with CPU
    seconds per million rows and the commit lag (``bench_ingest.py``)."""
    path = f"{RESULTS}/ingest.json"
    d = ctx.load(path)

    def lag(v: float | None) -> str:
        return "-" if v is None else f"<= {v:g} s"

    rows = [[p["phase"], f"{p['rows_per_s'] / 1e6:.2f} M", f"{p['cpu_s_per_m']:.2f}", lag(p.get("lag_p50_le")),
             lag(p.get("lag_p99_le"))] for p in _get(d, "phases", path)]
    w = [f"Collector ingest ({d['senders']} sender processes and the collector on one machine, {d['machine']}; "
         f"`{d['command']}`, {ctx.link(path)}; all {d['rows_stored']:,} rows sent were stored, "
         f"{d['bytes_per_row_on_disk']:.1f} bytes a row on disk):", ""]
    w += _table(["phase", "rows/s", "collector CPU s per M rows", "lag p50", "lag p99"], rows, "ingest")
    loads = d.get("load_average_1m") or []
    cores = _cores(d["machine"])
    if loads and cores and max(loads) > cores:
        w += ["", f"The machine was busy (1-minute load average, this benchmark included, {min(loads):.1f}-"
              f"{max(loads):.1f} on {cores} cores): rows/s depends on what else ran; CPU seconds per million rows "
              "is the steadier figure."]
    return "\n".join(w) + "\n"


def block_kv_events(ctx: Context) -> str:
    """``kv-events``: one collector taking vLLM's real KV-event publisher (``bench_kv_events.py``): block
    events/s published and stored, batches lost, receive and commit lag."""
    path = f"{RESULTS}/kv_events.json"
    d = ctx.load(path)
    m = d.get("machine", {})
    rows = [[f"{_get(d, 'published_rate', path):,.0f}", f"{_get(d, 'stored_rows_per_s', path):,.0f}",
             f"{_get(d, 'lost_batches', path):,} of {d['published_batches']:,}",
             f"{d['receive_lag_p50_s'] * 1e3:.0f} / {d['receive_lag_p99_s'] * 1e3:.0f} ms",
             f"{d['commit_lag_p50_s'] * 1e3:.0f} / {d['commit_lag_p99_s'] * 1e3:.0f} ms",
             f"{d['collector_cpu_per_s']:.2f}", "yes" if d["rows_match_published"] else "NO"]]
    w = [f"vLLM's own publisher (vLLM {m.get('vllm', '?')}) at a target of {d['rate_target']:,} block events/s for "
         f"{d['seconds']:g} s into one collector on {m.get('cores', '?')} cores (`{d['command']}`, "
         f"{ctx.link(path)}):", ""]
    w += _table(["published block events/s", "stored rows/s", "batches lost", "receive lag p50 / p99",
                 "commit lag p50 / p99", "collector cores", "stored = published"], rows, "kv-events")
    return "\n".join(w) + "\n"


def block_fleet(ctx: Context) -> str:
    """``fleet``: collectors writing one lake (events/s committed by each number of collectors, per storage, with
    the range over repetitions, and conflicts) and queries on a lake and a DuckDB file of 1e8 rows
    (``bench_fleet.py``)."""
    path = f"{RESULTS}/fleet.json"
    d = ctx.load(path)
    summary = _get(d, "writer_summary", path)
    rows = []
    for backend, label in (("local", "local folder"), ("s3", "S3 (moto)")):
        by_n = summary.get(backend, {}).get("by_n", {})
        for n in sorted(by_n, key=int):
            e = by_n[n]["events_per_s"]
            c = by_n[n]["conflicts"]
            rows.append([label, n, f"{e['median'] / 1e6:.2f} M ({e['min'] / 1e6:.2f}-{e['max'] / 1e6:.2f})",
                         f"{c['max']:.0f}", str(by_n[n]["reps"])])
    m = d["machine"]
    w = [f"Collectors writing one DuckLake lake (PostgreSQL catalog), each with its own load generator, all on one "
         f"machine of {m['cores']} cores (`{d['command_writers'].strip()}`, {ctx.link(path)}); median (min-max) over "
         "repetitions:", ""]
    w += _table(["data", "collectors", "events/s committed", "conflicts (max)", "repetitions"], rows, "fleet writers")
    q = _get(d, "queries", path)
    qrows = []
    for key in sorted(k for k in q if k.startswith(("lake_", "file_"))):
        s = q[key]
        t = s["timings"]
        qrows.append([("lake" if s["kind"] == "lake" else "DuckDB file"), f"{s['rows']:,}",
                      f"{s['bytes_per_row']:.1f}"]
                     + [f"{t[n]['warm']['median']:.2f} ({t[n]['warm']['min']:.2f}-{t[n]['warm']['max']:.2f})"
                        for n in ("run_summary", "families", "evictions")])
    w += ["", f"Queries (warm, median (min-max) s; `{d['command_queries'].strip()}`):", ""]
    w += _table(["store", "rows", "bytes/row", "run_summary", "families", "evictions (first page)"], qrows,
                "fleet queries")
    return "\n".join(w) + "\n"


def block_policy(ctx: Context) -> str:
    """``policy``: ``adaptive_aging`` against LRU and the optimum, from ``policy_sweep.json``: the whole traces
    through vLLM's real scheduler (labelled so), and the fast mode's sweep (labelled so) as counts over its
    (trace, capacity) points."""
    d = ctx.load(POLICY_DATA)
    full = d.get("full_real") or []
    rows = []
    for r in sorted((r for r in full if r["policy"] == "adaptive_aging"), key=lambda r: (r["trace"], r["fraction"])):
        lru = need(full, "full_real", trace=r["trace"], fraction=r["fraction"], policy="lru")
        opt = need(full, "full_real", trace=r["trace"], fraction=r["fraction"], policy="optimal")
        c = gap_closed(r["prefix_hit_rate"], lru["prefix_hit_rate"], opt["prefix_hit_rate"])
        rows.append([trace_name(r["trace"]), f"{r['fraction']:.0%} ({r['num_blocks']:,} blocks)",
                     f"{lru['prefix_hit_rate'] * 100:.2f} %", f"{r['prefix_hit_rate'] * 100:.2f} %",
                     f"{opt['prefix_hit_rate'] * 100:.2f} %", "-" if c is None else f"{c:.0%}",
                     f"{lru['wasted_prefill_tokens'] / 1e6:.2f} M -> {r['wasted_prefill_tokens'] / 1e6:.2f} M"])
    w = [f"**Real scheduler** (`kvfabric replay`: vLLM's Scheduler, KVCacheManager and BlockPool on CPU, hook on; "
         f"whole traces; {ctx.link(POLICY_DATA)}, written by `python -m kvfabric.bench.policy_table`):", ""]
    w += _table(["trace", "capacity", "LRU", "adaptive_aging", "optimum", "gap closed", "wasted prefill tokens"],
                rows, "policy (real scheduler)")
    sweep = d.get("sweep") or []
    meta = d.get("meta") or {}
    if not sweep or not meta.get("traces") or not meta.get("fractions"):
        raise MissingRows(f"{POLICY_DATA}: the sweep, its traces or its capacities are empty: nothing to count")
    above = below = equal = 0
    closed: list[float] = []
    for tr in meta["traces"]:
        for f in meta["fractions"]:
            rs = {p: need(sweep, "sweep", trace=tr, fraction=f, policy=p, anchor=0)["prefix_hit_rate"] * 100
                  for p in ("lru", "adaptive_aging", "optimal")}
            diff = rs["adaptive_aging"] - rs["lru"]
            above += diff > 0.005
            below += diff < -0.005
            equal += abs(diff) <= 0.005
            c = gap_closed(rs["adaptive_aging"], rs["lru"], rs["optimal"])
            if c is not None and rs["optimal"] - rs["lru"] > 5:
                closed.append(c)
    n = above + below + equal
    w += ["", f"**Fast mode** (`kvfabric replay --fast`: the same policies without vLLM), {len(meta['traces'])} "
          f"traces x {len(meta['fractions'])} capacities ({meta['fractions'][0]:.0%}-{meta['fractions'][-1]:.0%} of "
          f"each trace's unique blocks): `adaptive_aging` above LRU at {above} of {n} points, equal (within 0.005 "
          f"point) at {equal}, below at {below}"
          + (f"; where the LRU-to-optimum gap exceeds 5 points it closes {min(closed):.0%}-{max(closed):.0%} of it "
             "(target 40 %)." if closed else ".")]
    return "\n".join(w) + "\n"


def block_learned(ctx: Context) -> str:
    """``learned``: the learned policy on traffic it was not trained on (fast mode, ``policy_sweep.json``'s
    held-out replays): points replayed, the worst difference from LRU, and the share of the LRU-to-optimum gap
    closed where the gap exceeds 5 points, beside ``adaptive_aging``'s."""
    d = ctx.load(POLICY_DATA)
    points = learned_table.held_out_points(d)
    if not points:
        raise DocsError(f"{POLICY_DATA}: learned_eval holds no held-out replay of the learned policy")
    worst = min(points, key=lambda p: p["learned"] - p["lru"])
    big = [p for p in points if p["gap"] > 5]
    rows = [[str(len(points)), f"{worst['learned'] - worst['lru']:+.2f} point",
             str(sum(1 for p in points if p["learned"] < p["lru"] - 0.2))]]
    header = ["held-out points", "worst difference from LRU", "points more than 0.2 below LRU"]
    if big:
        closed = sorted(p["closed_learned"] or 0 for p in big)
        aa = sorted(p["closed_aa"] or 0 for p in big)
        rows[0] += [str(len(big)), f"{closed[0]:.0%} to {closed[-1]:.0%}, median {closed[len(closed) // 2]:.0%}",
                    f"median {aa[len(aa) // 2]:.0%}"]
        header += ["points with a gap over 5 points", "gap closed by learned", "by adaptive_aging"]
    w = ["The `learned` policy replaying traffic its model was not trained on (each trace with the other's model, "
         f"each half of each trace with the other half's; **fast mode**; {ctx.link(POLICY_DATA)}, written by "
         "`python -m kvfabric.bench.policy_table`):", ""]
    w += _table(header, rows, "learned")
    return "\n".join(w) + "\n"


def block_demo(ctx: Context) -> str:
    """``demo``: what ``kvfabric demo``'s built-in workload measured (``demo_misses_whatif.py``): requests, pool
    size, prefix hit rate, evicted blocks, wasted prefill tokens and the offline optimum's hit rate; the events and
    the wall time of ``kvfabric demo`` from ``bench_retention.py``'s demo run."""
    path = f"{RESULTS}/demo_misses_whatif.json"
    d = ctx.load(path)
    s = _get(d, "summary", path)
    e = _get(d, "engines", path)[0]
    rpath = f"{RESULTS}/retention.json"
    r = ctx.load(rpath)
    b = _get(r, "bytes", rpath)[0]
    rows = [[f"{s['requests']:,}", f"{e['num_blocks']:,}", f"{s['prefix_hit_rate'] * 100:.1f} %",
             f"{s['evicted_blocks']:,}", f"{s['wasted_prefill_tokens']:,}",
             f"{e['optimal_prefix_hit_rate'] * 100:.1f} %", f"{b['events']:,}", f"{b['demo_seconds']:.0f} s"]]
    w = [f"The demo's workload through vLLM's real scheduler on CPU ({ctx.link(path)}, "
         f"`python benchmarks/demo_misses_whatif.py`; events and run time from {ctx.link(rpath)}):", ""]
    w += _table(["requests", "pool blocks", "prefix hit rate", "evicted blocks", "wasted prefill tokens",
                 "offline optimum's hit rate", "events", "`kvfabric demo` wall time, imports included"], rows, "demo")
    return "\n".join(w) + "\n"


def block_soak(ctx: Context) -> str:
    """``soak``: the collector under steady load for an hour, SIGKILLed and restarted periodically
    (``bench_soak_collector.py``): events emitted, stored and counted lost per stream, duplicates, and the
    collector's memory and file descriptors over the full periods."""
    path = f"{RESULTS}/soak_collector.json"
    d = ctx.load(path)
    rows = [[r["run"], f"{r['emitted']:,}", f"{r['stored']:,}", f"{r['distinct_stored']:,}",
             f"{r['reported_lost']:,}", f"{r['unreported_lost_at_close']:,}", str(r["sequence_gaps"]),
             "yes" if r["balance_ok"] else "NO"] for r in _get(d, "runs", path)]
    c = _get(d, "collector", path)
    rss, fds = c["rss_mb_range_full_periods"], c["fds_range_full_periods"]
    w = [f"{d['senders']} senders at {d['rate_per_sender']:,} events/s each for {d['minutes']:g} minutes, the "
         f"collector SIGKILLed and restarted every {d['restart_every_s']:g} s ({c['restarts']} restarts; "
         f"`python benchmarks/bench_soak_collector.py`, {ctx.link(path)}):", ""]
    w += _table(["stream", "emitted", "stored", "distinct stored", "counted lost", "lost uncounted", "sequence gaps",
                 "stored + counted = emitted"], rows, "soak")
    w += ["", f"The collector's RSS over the full periods between restarts: {rss[0]:.0f}-{rss[1]:.0f} MiB; open file "
          f"descriptors {fds[0]}-{fds[1]}."]
    return "\n".join(w) + "\n"


def block_collector_memory(ctx: Context) -> str:
    """``collector-memory``: the RSS of a process appending event rows to DuckDB as the collector's writer does,
    by DuckDB memory limit, every 600k rows (``bench_collector_memory.py``), and the growth per million rows stored
    without a limit."""
    path = f"{RESULTS}/collector_memory.json"
    d = ctx.load(path)
    limits = _get(d, "limits", path)
    marks = [p[0] for p in limits[0]["points"]] if limits else []
    if len(marks) < 2 or any([p[0] for p in r["points"]] != marks for r in limits):
        raise DocsError(f"{path}: the limits need the same two or more RSS points (rows stored) each")
    names = {"none": "none (DuckDB's default: 80 % of RAM)", "256MB": "256MB (the collector's default)"}
    rows = [[f"{m:,}"] + [f"{r['points'][k][1]:.0f}" for r in limits] for k, m in enumerate(marks)]
    rows.append(["insert seconds"] + [f"{r['insert_seconds']:.1f}" for r in limits])
    w = [f"RSS (MiB) of a process appending event rows into a fresh DuckDB file as the collector's writer does "
         f"({d['batch_rows']:,}-row batches, one transaction each), by `--memory-limit` (`{d['command']}`, "
         f"{ctx.link(path)}; {d['machine']}, {d['date']}):", ""]
    w += _table(["rows stored"] + [names.get(r["limit"], r["limit"]) for r in limits], rows, "collector-memory")
    notes = []
    uncapped = next((r for r in limits if r["limit"] == "none"), None)
    if uncapped is not None:
        (r0, m0), (r1, m1) = uncapped["points"][0], uncapped["points"][-1]
        notes.append(f"Without a limit the process grows by {(m1 - m0) / ((r1 - r0) / 1e6):.0f} MiB per million "
                     f"rows stored ({m0:.0f} -> {m1:.0f} MiB).")
    capped = [r for r in limits if r["limit"] != "none"]
    if capped:
        peaks = ", ".join(f"{max(p[1] for p in r['points']):.0f} MiB at {r['limit']}" for r in capped)
        notes.append(f"The limit bounds DuckDB's own memory, not the process's (the highest RSS sampled under a limit: "
                     f"{peaks}).")
    w += ["", " ".join(notes)]
    loads = d.get("load_average_1m") or []
    cores = _cores(d["machine"])
    if loads and cores and max(loads) > cores:
        w += ["", f"The machine was busy (1-minute load average {min(loads):.1f}-{max(loads):.1f} on {cores} cores): "
              "insert seconds depend on what else ran; RSS does not."]
    return "\n".join(w) + "\n"


def block_serving(ctx: Context) -> str:
    """``serving``: the GPU A/Bs that ran every planned arm (``benchmarks/results/gpu/serving/*/ab.json``), one row
    per policy against LRU: hit rate, TTFT p50 and p90 and requests/s as medians, each with the A/B's verdict
    ("none" inside the arms' spread). Incomplete A/Bs are left to ``docs/serving-results.md``, which labels them."""
    try:
        results = serving_results.load(serving_results.GPU, ctx.root)
    except serving_results.ResultsError as exc:
        raise DocsError(f"{ctx.page}: {exc}") from exc
    rows = []
    keys = (("prefix_hit_rate", "pct"), ("ttft_p50_s", "ms"), ("ttft_p90_s", "ms"), ("requests_per_s", "rate"))
    for r in results:
        if not r.complete or "lru" not in r.policies:
            continue
        reps = int(r.data["plan"]["repeat"])
        for policy in (p for p in r.policies if p != "lru"):
            verdicts = r.data["verdicts"][policy]
            cells = []
            for key, unit in keys:
                lru, pol = r.median("lru", key), r.median(policy, key)
                if lru is None or pol is None:
                    raise DocsError(f"{r.path}/ab.json: no median of {key} for lru and {policy}")
                cells.append(f"{fmt(lru, unit)} -> {fmt(pol, unit)} "
                             f"({serving_results.verdict_text(verdicts.get(key))})")
            rows.append([" + ".join(r.cards) or "GPU", f"`{r.scenario}`", f"`{policy}` vs `lru`", *cells,
                         str(reps), f"[report]({ctx.rel(str(r.path / 'report.md'))})"])
    w = ["On a GPU (vLLM 0.26.0, the Llama-3-8B shape with dummy weights, compiled; `kvfabric ab`: a fresh server per "
         "arm, arms interleaved, warm-up excluded), the A/Bs that ran every planned arm "
         f"({ctx.link(str(serving_results.GPU) + '/')}, written by `benchmarks/gpu/ab_h200.sh`); medians, LRU -> "
         "the policy, and the verdict: \"none\" where the arms' ranges overlap:", ""]
    w += _table(["card", "scenario", "policies", "prefix hit rate", "TTFT p50", "TTFT p90", "requests/s",
                 "repetitions", "results"], rows, "serving")
    return "\n".join(w) + "\n"


#: Block name -> renderer. Each renderer reads only the results files it links to.
BLOCKS: dict[str, Callable[[Context], str]] = {
    "costs": block_costs,
    "disk": block_disk,
    "ingest": block_ingest,
    "kv-events": block_kv_events,
    "fleet": block_fleet,
    "policy": block_policy,
    "policy-overhead": block_policy_overhead,
    "learned": block_learned,
    "demo": block_demo,
    "soak": block_soak,
    "collector-memory": block_collector_memory,
    "serving": block_serving,
}

_BEGIN = re.compile(r"^<!-- BEGIN GENERATED ([a-z0-9-]+) -->$")
_END = re.compile(r"^<!-- END GENERATED ([a-z0-9-]+) -->$")


def fill_blocks(text: str, ctx: Context) -> str:
    """``text`` with every generated block's content replaced by its rendering. Raises :class:`DocsError` on a
    name :data:`BLOCKS` lacks, a BEGIN without its END (or an END without a BEGIN), or a nested block."""
    out: list[str] = []
    lines = text.splitlines(keepends=True)
    i = 0
    while i < len(lines):
        line = lines[i]
        m = _BEGIN.match(line.rstrip("\n"))
        if _END.match(line.rstrip("\n")):
            raise DocsError(f"{ctx.page}:{i + 1}: END GENERATED without its BEGIN")
        if not m:
            out.append(line)
            i += 1
            continue
        name = m.group(1)
        if name not in BLOCKS:
            raise DocsError(f"{ctx.page}:{i + 1}: unknown generated block {name!r} (known: {', '.join(BLOCKS)})")
        j = i + 1
        while j < len(lines) and not _END.match(lines[j].rstrip("\n")):
            if _BEGIN.match(lines[j].rstrip("\n")):
                raise DocsError(f"{ctx.page}:{j + 1}: a generated block inside block {name!r}")
            j += 1
        if j == len(lines) or _END.match(lines[j].rstrip("\n")).group(1) != name:  # type: ignore[union-attr]
            raise DocsError(f"{ctx.page}:{i + 1}: block {name!r} has no '<!-- END GENERATED {name} -->'")
        out.append(line if line.endswith("\n") else line + "\n")
        out.append(BLOCKS[name](ctx))
        out.append(lines[j])
        i = j + 1
    return "".join(out)


def blocks_in(text: str) -> list[str]:
    """The names of the generated blocks in ``text``, in order."""
    return [m.group(1) for line in text.splitlines() if (m := _BEGIN.match(line))]


_CITED = re.compile(r"benchmarks/results/[A-Za-z0-9_./-]*[A-Za-z0-9_/]")
_OPTION = re.compile(r"--[a-z][a-z-]*[ =]$")


def cited_missing(text: str, page: str, root: Path) -> list[str]:
    """``benchmarks/results/...`` paths ``text`` mentions that do not exist under ``root`` (a path followed by a
    placeholder such as ``<name>`` or a glob is a pattern, and one after a command's option such as ``--out`` names
    what the command writes: neither is a citation)."""
    missing = []
    for m in _CITED.finditer(text):
        if text[m.end():m.end() + 1] in ("<", "*", "{"):
            continue
        if _OPTION.search(text[max(0, m.start() - 40):m.start()]):
            continue  # a command's argument (``--out benchmarks/results/x``): what it writes, not a citation
        if not (root / m.group(0)).exists():
            missing.append(m.group(0))
    return sorted(set(missing))


def pages(root: Path) -> list[str]:
    """The pages that may hold generated blocks, relative to ``root``."""
    out = [p for p in ("README.md", "README.zh-CN.md") if (root / p).is_file()]
    out += sorted(f"docs/{f.name}" for f in (root / "docs").glob("*.md")) if (root / "docs").is_dir() else []
    return out


def render_all(root: Path = ROOT, only: list[str] | None = None
               ) -> tuple[dict[str, str], dict[str, dict[str, list[tuple[float, float]]]]]:
    """Every page as the committed results render it (page -> text), and the policy page's plot series (png ->
    series), written nowhere; ``only``: these pages alone. Raises :class:`DocsError`, :class:`MissingRows` or
    :class:`~kvfabric.bench.serving_results.ResultsError` when something cannot be rendered."""
    out: dict[str, str] = {}
    series: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for page in pages(root):
        if only is not None and page not in only:
            continue
        text = (root / page).read_text()
        if page == POLICY_PAGE:
            data = Context(root, page).load(POLICY_DATA)
            text = policy_table.splice(text, policy_table.page_text(data))
            series = policy_table.plot_series(data)
        elif page == SERVING_PAGE:
            text = serving_results.render(root)
        text = fill_blocks(text, Context(root, page))
        missing = cited_missing(text, page, root)
        if missing:
            raise DocsError(f"{page}: cites {', '.join(missing)}, which do not exist")
        out[page] = text
    return out, series


def check(root: Path = ROOT, only: list[str] | None = None) -> list[str]:
    """What differs between the committed pages (and plots) and what the committed results render: one line per
    page that differs or plot file that is missing; empty when everything matches."""
    rendered, series = render_all(root, only)
    problems = []
    for page, text in rendered.items():
        if (root / page).read_text() != text:
            names = blocks_in(text)
            problems.append(f"{page} differs from what the results render"
                            + (f" (blocks: {', '.join(names)})" if names else ""))
    for png in series:
        if not (root / "docs" / png).is_file():
            problems.append(f"docs/{png} is missing")
    return problems


def write(root: Path = ROOT, only: list[str] | None = None) -> list[str]:
    """Render every page (``only``: these) and the plots into ``root``; returns the pages that changed."""
    rendered, _ = render_all(root, only)
    if POLICY_PAGE in rendered:  # its plots (and the page's generated part, completed below)
        policy_table.render(json.loads((root / POLICY_DATA).read_text()), root / POLICY_PAGE, root / "docs")
    changed = []
    for page, text in rendered.items():
        if (root / page).read_text() != text:
            (root / page).write_text(text)
            changed.append(page)
    return changed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvfabric.bench.docs", formatter_class=HelpFormatter,
                                 description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--check", action="store_true",
                    help="write nothing; exit 1 when a page, block or plot differs from what the results render")
    ap.add_argument("--root", default=str(ROOT), help="the repository (or a copy of it) to render")
    ap.add_argument("--list", action="store_true", help="print the block names and what each renders, and exit")
    ap.add_argument("--pages", nargs="+", metavar="PAGE", help="only these pages (relative to --root)")
    args = ap.parse_args(argv)
    if args.list:
        for name, fn in BLOCKS.items():
            print(f"{name}: {' '.join((fn.__doc__ or '').split())}")
        return 0
    root = Path(args.root)
    if args.pages:
        unknown = sorted(set(args.pages) - set(pages(root)))
        if unknown:
            print(f"docs: --pages: {', '.join(unknown)}: not a page of {root} (README*.md, docs/*.md)",
                  file=sys.stderr)
            return 2
    try:
        if args.check:
            problems = check(root, args.pages)
            for p in problems:
                print(f"docs: {p}; run python -m kvfabric.bench.docs", file=sys.stderr)
            return 1 if problems else 0
        changed = write(root, args.pages)
    except (DocsError, MissingRows, serving_results.ResultsError) as exc:
        print(f"docs: {exc}", file=sys.stderr)
        return 2
    for page in changed:
        print(f"wrote {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
