"""Regenerate ``docs/policy-results.md`` and its plots: every policy vs LRU and the offline optimum, on the traces.

One command (``python -m kvfabric.bench.policy_table``) runs:

1. the sweep: every policy, LRU and the optimum at capacities from 2% to 50% of each trace's unique blocks, on
   the whole of each trace, in fast mode (:mod:`kvfabric.sim.offline`, vLLM's 16-token blocks);
2. the agreement check: real scheduler (vLLM, hook on) against fast mode on the first ``--real-limit`` rows of
   each trace at two capacities, for LRU, adaptive_aging, learned (built-in model) and the optimum;
3. a robustness check on data the design did not look at as a whole: the first 1500 rows of each trace (a
   different mix: fewer returning sessions), 512-token blocks;
4. the admission gate's effect (``KVFABRIC_ADMISSION_ANCHOR_BLOCKS=24``) on LRU and adaptive_aging.

5. the whole traces through vLLM's real scheduler at ``--real-full-fractions`` (LRU, adaptive_aging, optimum);
6. ``learned``: reuse models learned from one trace (and from each half of each trace) replayed on the other
   (:mod:`kvfabric.bench.learned_table`), in fast mode; the models go to ``benchmarks/results/policy_models/``;
7. ``learnedreal``: the across-traces models through vLLM's real scheduler at ``--real-full-fractions``.

Raw results go to ``benchmarks/results/policy_sweep.json`` (``--reuse`` re-renders from it without rerunning;
``--sections`` reruns only some parts; ``--reuse --relative-paths`` rewrites an older file's absolute row paths).
Rows name traces by their path relative to the repository root and are matched by file name; rendering fails
(exit 1, nothing written) when a table would lack rows or a plot data. Runtime on 2 cores: about 35 minutes for
the sweep (with the peers; longer on a busy machine), 2 for the agreement runs, 20 for the whole traces through
the real scheduler (3 minutes and 6 GB each), about 30 for the learned policy's models and held-out replays, 10
for those through the real scheduler.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from kvfabric.bench import learned_table
from kvfabric.bench.table_rows import (
    MissingRows,
    gap_closed,
    need,
    repo_relative,
    resolve,
    trace_key,
    trace_name,
)
from kvfabric.policies.base import PolicySettings
from kvfabric.sim.offline import load_trace, simulate, unique_blocks
from kvfabric.sim.replay import replay_real

# Relative to the repository root: the traces sit beside the checkout, too big to carry in it. Results rows record
# trace paths relative to the repository root (:func:`~kvfabric.bench.table_rows.repo_relative`) and are matched
# by the trace's file name, so a results file renders the same from any checkout.
DEFAULT_TRACES = (
    "../shared/traces/mooncake_conversation_first_half.jsonl",
    "../shared/traces/mooncake_synthetic_trace.jsonl",
)
FRACTIONS = (0.02, 0.05, 0.10, 0.20, 0.30, 0.50)
#: Peers (other engines' policies, ``kvfabric/policies/peers.py``) sit beside KVFabric's, the optimum last.
PEERS = ("lfu", "slru", "fifo", "tlru")
POLICIES = ("lru", "family_protect", "shared_aware", "adaptive_aging", *PEERS, "optimal")
OURS = "adaptive_aging"


def _shown(sweep: list[dict[str, Any]]) -> tuple[str, ...]:
    """The policies a page shows: every one of :data:`POLICIES`, except peers a results file predates (a sweep run
    before they existed has no rows of them; one that has any row of a peer must have all of them)."""
    present = {r.get("policy") for r in sweep}
    return tuple(p for p in POLICIES if p not in PEERS or p in present)


@functools.lru_cache(maxsize=4)
def _whole(path: str) -> Any:
    return load_trace(resolve(path))


def _trace(path: str, limit: int | None, skip: int = 0) -> Any:
    rows = _whole(path)
    return rows[skip:] if limit is None else rows[skip:skip + limit]


def _unique(path: str, limit: int | None, block_size: int, skip: int = 0) -> int:
    return unique_blocks(_trace(path, limit, skip), block_size)


def _floor(path: str, limit: int | None, block_size: int, skip: int = 0) -> int:
    """The smallest pool that can hold the trace's longest request (vLLM's null block and one output token too)."""
    return max(-(-(r.input_length + 1) // block_size) for r in _trace(path, limit, skip)) + 2


def _fast(task: dict[str, Any]) -> dict[str, Any]:
    t0 = time.perf_counter()
    out = simulate(_trace(task["trace"], task.get("limit"), task.get("skip", 0)), task["policy"],
                   task["num_blocks"], block_size=task["block_size"], anchor_blocks=task.get("anchor", 0),
                   settings=PolicySettings(model_path=task.get("model")))
    out.update(task)
    out["wall_s"] = time.perf_counter() - t0
    return out


def _real(task: dict[str, Any]) -> dict[str, Any]:
    out = replay_real(resolve(task["trace"]), task["policy"], task["num_blocks"], limit=task["limit"],
                      block_size=task["block_size"], progress=False, policy_model=task.get("model"))
    out.update(task)
    return out


def _run(fn: Any, tasks: list[dict[str, Any]], jobs: int, label: str) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    try:
        # tqdm: only when a bar is drawn, and optional (a missing one costs the bar only)
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        tqdm = None  # type: ignore[assignment]
    bar = tqdm(total=len(tasks), desc=label, file=sys.stderr) if tqdm is not None else None
    # Longest tasks first (the optimum and tight capacities), so two workers finish together.
    order = sorted(tasks, key=lambda t: (t["policy"] != "optimal", t["num_blocks"]))
    if jobs <= 1:
        for t in order:
            results.append(fn(t))
            if bar is not None:
                bar.update(1)
    else:
        with ProcessPoolExecutor(jobs) as pool:
            for r in pool.map(fn, order):
                results.append(r)
                if bar is not None:
                    bar.update(1)
    if bar is not None:
        bar.close()
    return results


SECTIONS = ("sweep", "robust", "agree", "realfull", "learned", "learnedreal")


def run_all(traces: Sequence[str], fractions: Sequence[float], block_size: int, jobs: int,
            real_limit: int, real_full_fractions: Sequence[float], sections: Sequence[str] = SECTIONS,
            previous: dict[str, Any] | None = None,
            models_dir: str = learned_table.MODELS_DIR) -> dict[str, Any]:
    """Run the requested sections; sections not run are taken from ``previous`` (a loaded results file).
    Rows and metadata name each trace by its path relative to the repository root."""
    traces = [repo_relative(tr) for tr in traces]
    sweep_tasks = []
    meta: dict[str, Any] = {"traces": {}}
    for tr in traces:
        unique = _unique(tr, None, block_size)
        meta["traces"][tr] = {"unique_blocks": unique, "rows": len(_trace(tr, None))}
        for f in fractions:
            n = max(int(unique * f), _floor(tr, None, block_size))
            for p in POLICIES:
                sweep_tasks.append({"trace": tr, "fraction": f, "num_blocks": n, "policy": p,
                                    "block_size": block_size, "anchor": 0})
            for p in ("lru", OURS):
                sweep_tasks.append({"trace": tr, "fraction": f, "num_blocks": n, "policy": p,
                                    "block_size": block_size, "anchor": 24})
    robust_tasks = []
    for tr in traces:
        unique = _unique(tr, 1500, 512)
        for f in fractions:
            for p in ("lru", OURS, "optimal"):
                n = max(int(unique * f), 400, _floor(tr, 1500, 512))
                robust_tasks.append({"trace": tr, "limit": 1500, "fraction": f, "num_blocks": n,
                                     "policy": p, "block_size": 512, "anchor": 0})
    agree_tasks = []
    for tr in traces:
        unique = _unique(tr, real_limit, block_size)
        for f in (0.05, 0.20):
            for p in ("lru", OURS, "learned", "optimal"):  # learned: its built-in model (the modes must agree)
                n = max(int(unique * f), _floor(tr, real_limit, block_size))
                agree_tasks.append({"trace": tr, "limit": real_limit, "fraction": f, "num_blocks": n,
                                    "policy": p, "block_size": block_size, "anchor": 0})
    full_tasks = []
    for tr in traces:
        unique = _unique(tr, None, block_size)
        for f in real_full_fractions:
            n = max(int(unique * f), _floor(tr, None, block_size))
            for p in ("lru", OURS, "optimal"):
                full_tasks.append({"trace": tr, "limit": None, "fraction": f, "num_blocks": n, "policy": p,
                                   "block_size": block_size, "anchor": 0})
    prev = previous or {}
    t0 = time.time()
    out: dict[str, Any] = {}
    out["sweep"] = _run(_fast, sweep_tasks, jobs, "sweep (fast mode)") if "sweep" in sections \
        else prev.get("sweep", [])
    out["robust"] = _run(_fast, robust_tasks, jobs, "robustness (prefixes)") if "robust" in sections \
        else prev.get("robust", [])
    if "agree" in sections:
        out["agree_fast"] = _run(_fast, agree_tasks, jobs, "agreement: fast")
        out["agree_real"] = _run(_real, agree_tasks, jobs, "agreement: real scheduler")
    else:
        out["agree_fast"], out["agree_real"] = prev.get("agree_fast", []), prev.get("agree_real", [])
    if "realfull" in sections:
        out["full_real"] = _run(_real, full_tasks, jobs, "whole traces: real scheduler")
    else:
        out["full_real"] = prev.get("full_real", [])
    if "learned" in sections:
        out["learned_models"] = _run(learned_table.train, learned_table.model_tasks(traces, block_size, models_dir),
                                     jobs, "learned: models")
        out["learned_eval"] = _run(_fast, learned_table.eval_tasks(traces, fractions, block_size, models_dir,
                                                                   _unique, _floor), jobs, "learned: held out")
    else:
        out["learned_models"] = prev.get("learned_models", [])
        out["learned_eval"] = prev.get("learned_eval", [])
    if "learnedreal" in sections:
        out["learned_real"] = _run(_real, learned_table.real_tasks(traces, real_full_fractions, block_size,
                                                                   models_dir, _unique, _floor),
                                   jobs, "learned: real scheduler")
    else:
        out["learned_real"] = prev.get("learned_real", [])
    runtime = dict(prev.get("meta", {}).get("section_runtime_s", {}))
    runtime[",".join(sections)] = time.time() - t0
    meta.update({
        "block_size": block_size,
        "fractions": list(fractions),
        "real_limit": real_limit,
        "real_full_fractions": list(real_full_fractions),
        "section_runtime_s": runtime,
        "runtime_s": sum(runtime.values()),
        "machine": f"{platform.node()}, {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                   f"Python {platform.python_version()}",
        "command": "python -m kvfabric.bench.policy_table " + " ".join(sys.argv[1:]),
    })
    out["meta"] = meta
    return relative_traces(out)


def relative_traces(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with every row's ``trace`` (and a path-valued ``trained_on``) spelled as the metadata spells the
    trace of the same file name: relative to the repository root. Sections carried over from an older results
    file (written with absolute paths from another checkout) are rewritten here, so a results file this module
    writes holds one spelling per trace. Rows of a trace the metadata does not hold are left as they are (the
    renderer then refuses them)."""
    spelled = {trace_key(tr): tr for tr in (data.get("meta") or {}).get("traces") or {}}
    for section, rows in data.items():
        if section == "meta" or not isinstance(rows, list):
            continue
        for r in rows:
            for field in ("trace", "trained_on"):
                v = r.get(field)
                if isinstance(v, str) and v.endswith(".jsonl") and trace_key(v) in spelled:
                    r[field] = spelled[trace_key(v)]
    return data


# --------------------------------------------------------------------------------------------- rendering


def _check(data: dict[str, Any]) -> None:
    """What every rendering needs: traces with distinct names, capacities, and rows in the sections every page
    shows (the sweep, the agreement runs, the robustness runs). Raises :class:`MissingRows`."""
    meta = data.get("meta") or {}
    traces = list(meta.get("traces") or {})
    if not traces:
        raise MissingRows("meta.traces is empty: no trace to render")
    keys = [trace_key(tr) for tr in traces]
    if len(set(keys)) != len(keys):
        raise MissingRows(f"meta.traces holds two traces of the same name ({traces}): rows could not be told apart")
    if not meta.get("fractions"):
        raise MissingRows("meta.fractions is empty: no capacity to render")
    for section in ("sweep", "agree_real", "agree_fast", "robust"):
        if not data.get(section):
            raise MissingRows(f"section {section!r} has no rows: its table would be empty")
    for tr in traces:
        if os.path.isabs(tr):
            raise MissingRows(f"meta.traces names {tr!r} by an absolute path: results record paths relative to the "
                              "repository root (rerun the sweep)")


def render(data: dict[str, Any], out_md: Path, plots_dir: Path) -> str:
    """Write the generated part of ``out_md`` and the plots in ``plots_dir`` from a results file's ``data``.

    Raises :class:`~kvfabric.bench.table_rows.MissingRows` (before writing anything) when a table would lack a
    row it should have or a plot would have no data."""
    text = page_text(data)
    series = plot_series(data)
    _plots(data, series, plots_dir)
    out_md.write_text(splice(out_md.read_text() if out_md.exists() else None, text))
    return text


def page_text(data: dict[str, Any]) -> str:
    """The generated part of ``docs/policy-results.md`` from a results file's ``data``, written nowhere (a pure
    function of ``data``). Raises :class:`~kvfabric.bench.table_rows.MissingRows` when a table would lack a row
    it should have, or a plot the page shows would have no data (:func:`plot_series`)."""
    _check(data)
    plot_series(data)
    meta = data["meta"]
    sweep = data["sweep"]
    shown = _shown(sweep)  # (shown, less the peers an older results file lacks)
    lines: list[str] = []
    w = lines.append
    w("## Results")
    w("")
    w("Generated by `python -m kvfabric.bench.policy_table` (raw numbers: `benchmarks/results/policy_sweep.json`).")
    w(f"Machine: {meta['machine']}. Runtime: {meta['runtime_s'] / 60:.0f} min.")
    w("")
    w("Traces: `shared/traces/` (Mooncake, FAST'25, Apache-2.0), whole files. Replay: one request at a time")
    w("(the traces' README's sequential replay), vLLM's 16-token blocks, one output token per request (outputs are")
    w("made up, so their blocks are never reused). Capacity = pool size as a share of the trace's unique 16-token")
    w("blocks. Prefix hit rate = hit tokens / prompt tokens over admissions (docs/design.md §5); wasted prefill")
    w("tokens = 16 x blocks rebuilt after their eviction. *Gap closed* = (policy - LRU) / (optimum - LRU) in hit rate.")
    w("")
    w("Numbers in the tables come from the fast mode (`kvfabric replay --fast`, `kvfabric/sim/offline.py`):")
    w("the same policies, indexes and statistics as the hook, without vLLM, because replaying the whole traces")
    w(f"through vLLM's real scheduler {len(shown)} x {len(meta['fractions'])} x 2 times takes hours on 2 cores.")
    w("The [agreement section](#agreement-real-scheduler-vs-fast-mode) shows both modes on the same rows.")
    w("")
    w("Policies: `lru` (vLLM's own order), `family_protect` and `shared_aware` (docs/design.md §6), `adaptive_aging`")
    w("(this project's: LRU plus an aging credit for proven blocks, learned online from ghost hits; see")
    if any(p in PEERS for p in shown):
        w("[below](#adaptive_aging)), other engines' policies as baselines (`lfu`, `slru`, `fifo`: SGLang's rules;")
        w("`tlru`: tail-optimized LRU, arXiv:2510.15152, at its default budget; docs/design.md §6), `optimal`")
        w("(Belady's MIN, ties towards deeper blocks, under the same pinning).")
    else:
        w("[below](#adaptive_aging)), `optimal` (Belady's MIN, ties towards deeper blocks, under the same pinning).")
    w("")
    for tr in meta["traces"]:
        info = meta["traces"][tr]
        name = trace_name(tr)
        w(f"### {name}")
        w("")
        w(f"{info['rows']:,} requests, {info['unique_blocks']:,} unique 16-token blocks.")
        w("")
        w("#### Prefix hit rate (%)")
        w("")
        w("| capacity | blocks | " + " | ".join(shown) + " | LRU-to-optimum gap | gap closed by "
          f"{OURS} |")
        w("|---|---|" + "---|" * (len(shown) + 2))
        for f in meta["fractions"]:
            row = {p: need(sweep, "sweep", trace=tr, fraction=f, policy=p, anchor=0) for p in shown}
            rates = {p: row[p]["prefix_hit_rate"] * 100 for p in shown}
            gap = rates["optimal"] - rates["lru"]
            closed = gap_closed(rates[OURS], rates["lru"], rates["optimal"])
            cells = []
            for p in shown:
                mark = ""
                if p not in ("lru", "optimal") and rates[p] < rates["lru"] - 0.005:
                    mark = " ↓"
                cells.append(f"{rates[p]:.2f}{mark}")
            w(f"| {f:.0%} | {row['lru']['num_blocks']:,} | " + " | ".join(cells)
              + f" | {gap:.2f} | {'-' if closed is None else f'{closed:.0%}'} |")
        w("")
        w("↓ = below LRU. Gap closed by each policy:")
        w("")
        w("| capacity | " + " | ".join(p for p in shown if p not in ("lru", "optimal")) + " |")
        w("|---|" + "---|" * (len(shown) - 2))
        for f in meta["fractions"]:
            rates = {p: need(sweep, "sweep", trace=tr, fraction=f, policy=p, anchor=0)["prefix_hit_rate"]
                     for p in shown}
            cells = []
            for p in shown:
                if p in ("lru", "optimal"):
                    continue
                c = gap_closed(rates[p], rates["lru"], rates["optimal"])
                cells.append("-" if c is None else f"{c:.0%}")
            w(f"| {f:.0%} | " + " | ".join(cells) + " |")
        w("")
        w("#### Wasted prefill tokens (millions; lower is better)")
        w("")
        w("| capacity | " + " | ".join(shown) + " |")
        w("|---|" + "---|" * len(shown))
        for f in meta["fractions"]:
            wasted = [need(sweep, "sweep", trace=tr, fraction=f, policy=p, anchor=0)["wasted_prefill_tokens"]
                      for p in shown]
            cells = [f"{v / 1e6:.2f}" for v in wasted]
            w(f"| {f:.0%} | " + " | ".join(cells) + " |")
        w("")
        w(f"![hit rate vs capacity, {name}](policy-hit-rate-{name}.png)")
        w("")
        w("#### Admission gate (`KVFABRIC_ADMISSION_ANCHOR_BLOCKS=24`)")
        w("")
        w("| capacity | lru | lru + gate | adaptive_aging | adaptive_aging + gate |")
        w("|---|---|---|---|---|")
        for f in meta["fractions"]:
            vals = []
            for p, a in (("lru", 0), ("lru", 24), (OURS, 0), (OURS, 24)):
                r = need(sweep, "sweep (admission gate)", trace=tr, fraction=f, policy=p, anchor=a)
                vals.append(f"{r['prefix_hit_rate'] * 100:.2f}")
            w(f"| {f:.0%} | " + " | ".join(vals) + " |")
        w("")
    w("### Gap closed, both traces")
    w("")
    w("![share of the LRU-to-optimum gap closed](policy-gap-closed.png)")
    w("")
    learned_table.render(data, w)
    if data.get("full_real"):
        w("### Whole traces through vLLM's real scheduler")
        w("")
        w("The same replays with `kvfabric replay` (no `--fast`): vLLM 0.33's Scheduler, KVCacheManager and BlockPool")
        w("on CPU with the hook on; numbers counted from the hook's events. Fast mode's figures beside them.")
        w("")
        w("| trace | capacity | blocks | policy | hit rate real | hit rate fast | wasted prefill real (M tokens) | "
          "wasted fast | replay wall s |")
        w("|---|---|---|---|---|---|---|---|---|")
        for r in sorted(data["full_real"], key=lambda r: (trace_key(r["trace"]), r["fraction"],
                                                          shown.index(r["policy"]))):
            # Fast mode's figure for the same capacity (none when the sweep did not run that capacity).
            fst = (need(sweep, "sweep (beside the real scheduler's whole traces)", trace=r["trace"],
                        fraction=r["fraction"], policy=r["policy"], anchor=0)
                   if r["fraction"] in meta["fractions"] else None)
            fast_rate = "-" if fst is None else f"{fst['prefix_hit_rate'] * 100:.2f}"
            fast_waste = "-" if fst is None else f"{fst['wasted_prefill_tokens'] / 1e6:.2f}"
            w(f"| {trace_name(r['trace'])} | {r['fraction']:.0%} | {r['num_blocks']:,} | {r['policy']} | "
              f"{r['prefix_hit_rate'] * 100:.2f} | {fast_rate} | {r['wasted_prefill_tokens'] / 1e6:.2f} | "
              f"{fast_waste} | {r['replay_wall_s']:.0f} |")
        w("")
    # Agreement
    w("### Agreement: real scheduler vs fast mode")
    w("")
    w(f"First {meta['real_limit']} rows of each trace, capacities relative to *those rows'* unique blocks. Real =")
    w("`kvfabric replay` (vLLM 0.33's Scheduler/KVCacheManager/BlockPool on CPU, simulated model, hook on, counts")
    w("from the hook's events); fast = `kvfabric replay --fast`.")
    w("")
    w("| trace | capacity | blocks | policy | hit rate real | hit rate fast | rebuilt real | rebuilt fast |")
    w("|---|---|---|---|---|---|---|---|")
    for r in data["agree_real"]:
        fst = need(data["agree_fast"], "agree_fast (beside agree_real)", trace=r["trace"], fraction=r["fraction"],
                   policy=r["policy"])
        w(f"| {trace_name(r['trace'])} | {r['fraction']:.0%} | {r['num_blocks']:,} | {r['policy']} | "
          f"{r['prefix_hit_rate'] * 100:.3f} | {fst['prefix_hit_rate'] * 100:.3f} | "
          f"{r['rebuilt_from_eviction_blocks']:,} | {fst['rebuilt_from_eviction_blocks']:,} |")
    w("")
    # Robustness
    w("### Robustness: the first 1,500 rows of each trace")
    w("")
    w("A different mix than the whole files (few returning conversations yet, families not yet repeated);")
    w("512-token blocks, capacities relative to those rows' unique blocks (at least 400 blocks).")
    w("")
    w("| trace | capacity | lru | adaptive_aging | optimal | gap closed |")
    w("|---|---|---|---|---|---|")
    for tr in meta["traces"]:
        for f in meta["fractions"]:
            rs = {p: need(data["robust"], "robust", trace=tr, fraction=f, policy=p) for p in ("lru", OURS, "optimal")}
            lru, ours, opt = (rs[p]["prefix_hit_rate"] * 100 for p in ("lru", OURS, "optimal"))
            c = gap_closed(ours, lru, opt)
            mark = " ↓" if ours < lru - 0.005 else ""
            w(f"| {trace_name(tr)} | {f:.0%} | {lru:.2f} | {ours:.2f}{mark} | {opt:.2f} | "
              f"{'-' if c is None else f'{c:.0%}'} |")
    w("")
    return "\n".join(lines) + "\n"


_MARK_BEGIN = "<!-- generated:begin -->"
_MARK_END = "<!-- generated:end -->"


def splice(old: str | None, generated: str) -> str:
    """The page with ``generated`` between its markers, the hand-written prose around them kept (a page without
    markers, or none, becomes the generated part alone)."""
    if old is None:
        return f"{_MARK_BEGIN}\n{generated}{_MARK_END}\n"
    if _MARK_BEGIN in old and _MARK_END in old:
        head, rest = old.split(_MARK_BEGIN, 1)
        _, tail = rest.split(_MARK_END, 1)
        return f"{head}{_MARK_BEGIN}\n{generated}{_MARK_END}{tail}"
    return f"{_MARK_BEGIN}\n{generated}{_MARK_END}\n"


STYLES = {"lru": ("k", "o"), "family_protect": ("tab:orange", "s"), "shared_aware": ("tab:purple", "^"),
          "adaptive_aging": ("tab:green", "D"), "lfu": ("tab:brown", "x"), "slru": ("tab:pink", "+"),
          "fifo": ("tab:gray", "1"), "tlru": ("tab:olive", "*"), "optimal": ("tab:red", "")}


def plot_series(data: dict[str, Any]) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """What each plot draws, by file name: ``{png: {series label: [(x, y), ...]}}``; ``policy-learned-gap.png``
    is drawn from :func:`kvfabric.bench.learned_table.held_out_points` and appears only when the results hold the
    learned section. Raises :class:`MissingRows` when a plot would have no series or a series no point: an empty
    plot is never drawn."""
    meta = data["meta"]
    sweep = data["sweep"]
    shown = _shown(sweep)
    out: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for tr in meta["traces"]:
        name = trace_name(tr)
        lines: dict[str, list[tuple[float, float]]] = {}
        for p in shown:
            lines[p] = [(f * 100, need(sweep, f"sweep (plot of {name})", trace=tr, fraction=f, policy=p,
                                       anchor=0)["prefix_hit_rate"] * 100) for f in meta["fractions"]]
        held = sorted((r for r in data.get("learned_eval", []) if r.get("split") == "trace"
                       and r.get("policy") == "learned" and trace_key(r["trace"]) == trace_key(tr)),
                      key=lambda r: r["fraction"])
        if held:
            lines[f"learned (model of {trace_name(held[0]['trained_on'])})"] = [
                (r["fraction"] * 100, r["prefix_hit_rate"] * 100) for r in held]
        out[f"policy-hit-rate-{name}.png"] = lines
    gap: dict[str, list[tuple[float, float]]] = {}
    for tr in meta["traces"]:
        for p in (q for q in shown if q not in ("lru", "optimal")):
            pts = []
            for f in meta["fractions"]:
                rs = {q: need(sweep, "sweep (gap-closed plot)", trace=tr, fraction=f, policy=q, anchor=0)
                      for q in ("lru", p, "optimal")}
                c = gap_closed(rs[p]["prefix_hit_rate"], rs["lru"]["prefix_hit_rate"], rs["optimal"]["prefix_hit_rate"])
                pts.append((f, 0.0 if c is None else max(-1.0, c) * 100))
            gap[f"{trace_name(tr)}/{p}"] = pts
    out["policy-gap-closed.png"] = gap
    points = learned_table.held_out_points(data)
    if data.get("learned_eval") or data.get("learned_models"):
        out["policy-learned-gap.png"] = {
            "learned": [(p["fraction"], max(-1.0, p["closed_learned"] or 0.0) * 100) for p in points],
            "adaptive_aging": [(p["fraction"], max(-1.0, p["closed_aa"] or 0.0) * 100) for p in points]}
    for png, series in out.items():
        if not series:
            raise MissingRows(f"{png}: no series to plot")
        for label, pts in series.items():
            if not pts:
                raise MissingRows(f"{png}: series {label!r} has no point")
    return out


def _plots(data: dict[str, Any], series: dict[str, dict[str, list[tuple[float, float]]]], plots_dir: Path) -> None:
    """Draw :func:`plot_series`'s series into ``plots_dir``."""
    import matplotlib  # matplotlib: only for plots (the Agg backend is set before pyplot loads)

    matplotlib.use("Agg")
    # matplotlib: only for plots, after the backend is chosen
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    meta = data["meta"]
    shown = _shown(data["sweep"])
    for tr in meta["traces"]:
        name = trace_name(tr)
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for label, pts in series[f"policy-hit-rate-{name}.png"].items():
            color, marker = STYLES.get(label, ("tab:blue", "v"))
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker=marker or None, color=color,
                    linestyle="--" if label == "optimal" else "-", label=label)
        ax.set_xscale("log")
        ax.set_xticks([f * 100 for f in meta["fractions"]])
        ax.set_xticklabels([f"{f:.0%}" for f in meta["fractions"]])
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("cache capacity (share of the trace's unique blocks)")
        ax.set_ylabel("prefix hit rate (%)")
        ax.set_title(f"{name}: prefix hit rate by policy")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(plots_dir / f"policy-hit-rate-{name}.png", dpi=110)
        plt.close(fig)
    # Share of the LRU-to-optimum gap each policy closes (negative: below LRU), per trace and capacity.
    policies = [p for p in shown if p not in ("lru", "optimal")]
    traces = list(meta["traces"])
    gap = series["policy-gap-closed.png"]
    fig, axes = plt.subplots(1, len(traces), figsize=(6 * len(traces), 3.8), squeeze=False)
    for ax, tr in zip(axes[0], traces, strict=True):
        fr = meta["fractions"]
        width = 0.8 / len(policies)
        for i, p in enumerate(policies):
            vals = [y for _, y in gap[f"{trace_name(tr)}/{p}"]]
            ax.bar([j + i * width for j in range(len(fr))], vals, width, color=STYLES[p][0], label=p)
        ax.axhline(0, color="k", linewidth=0.8)
        ax.axhline(40, color="tab:red", linewidth=0.8, linestyle=":", label="target (40%)")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(fr))])
        ax.set_xticklabels([f"{f:.0%}" for f in fr])
        ax.set_ylim(-100, 100)
        ax.set_xlabel("cache capacity")
        ax.set_ylabel("LRU-to-optimum gap closed (%), clipped at -100")
        ax.set_title(trace_name(tr))
        ax.grid(True, axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(plots_dir / "policy-gap-closed.png", dpi=110)
    plt.close(fig)
    if "policy-learned-gap.png" in series:
        learned_table.plot(learned_table.held_out_points(data), plots_dir)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--traces", nargs="+", default=[resolve(tr) for tr in DEFAULT_TRACES],
                        help="trace files (default: ../shared/traces/, beside the checkout)")
    parser.add_argument("--fractions", default=",".join(str(f) for f in FRACTIONS))
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--real-limit", type=int, default=600, help="rows replayed through the real scheduler")
    parser.add_argument("--data", default="benchmarks/results/policy_sweep.json")
    parser.add_argument("--out", default="docs/policy-results.md")
    parser.add_argument("--plots", default="docs")
    parser.add_argument("--real-full-fractions", default="0.05,0.2",
                        help="capacities at which the whole traces also go through the real scheduler ('' = none)")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"what to run (default all: {','.join(SECTIONS)}); the rest comes from --data")
    parser.add_argument("--reuse", action="store_true", help="re-render from --data without running anything")
    parser.add_argument("--relative-paths", action="store_true",
                        help="with --reuse: first rewrite --data's row trace paths as its metadata spells them "
                             "(relative to the repository root; nothing is rerun, no number changes)")
    args = parser.parse_args(argv)
    data_path = Path(args.data)
    previous = json.loads(data_path.read_text()) if data_path.exists() else None
    if args.reuse:
        if previous is None:
            parser.error(f"--reuse: {data_path} does not exist")
        data = previous
        if args.relative_paths:
            data = relative_traces(data)
            data_path.write_text(json.dumps(data, indent=1, sort_keys=True, default=str))
    else:
        fractions = [float(f) for f in args.fractions.split(",")]
        full = [float(f) for f in args.real_full_fractions.split(",") if f.strip()]
        sections = [s for s in args.sections.split(",") if s]
        data = run_all(args.traces, fractions, args.block_size, args.jobs, args.real_limit, full, sections,
                       previous, models_dir=str(data_path.parent / "policy_models"))
        data_path.parent.mkdir(parents=True, exist_ok=True)
        data_path.write_text(json.dumps(data, indent=1, sort_keys=True, default=str))
    Path(args.plots).mkdir(parents=True, exist_ok=True)
    try:
        text = render(data, Path(args.out), Path(args.plots))
    except MissingRows as exc:
        print(f"error: {args.data}: {exc}; nothing written", file=sys.stderr)
        return 1
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
