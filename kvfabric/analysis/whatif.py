"""``kvfabric whatif``: what another policy, or another KV capacity, would have done with the traffic a run had.

The run's admissions are rebuilt from its events as block-hash chains, in lookup order
(:mod:`kvfabric.analysis.traffic`), and replayed through the offline prefix-cache model (:func:`kvfabric.sim.offline.
simulate`, vLLM's cache at block granularity, one key per recorded block) three times per engine: under policy P at
capacity N (the what-if), under the optimum (Belady, ``policy="optimal"``) at N, and under the run's own policy and
capacity (the calibration: how close the model comes to what actually happened). Multi-engine runs replay each
engine's traffic in its own cache of N blocks and add up.

Why the replay of the run's own configuration is not exact (docs/design.md §5, what-if): the model admits requests
one after another with a fixed window of ``concurrency`` requests in flight (the run's mean, measured from the
events) where the engine had a varying number, so pinned blocks differ; a request's output blocks are private in the
model, while in the run the next turn of a conversation could hit its previous answer; admission order stands for
arrival order; vLLM keeps duplicate copies of a block the model merges. :data:`TOLERANCE` bounds the difference on
runs like the demo; the answer reports the measured difference (``replay_own_error``) and, as the most useful
number, ``predicted_change`` = what-if minus the replay of the own configuration (the model's bias cancels).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from typing import Any

from kvfabric.analysis.traffic import RecordedAdmission, mean_concurrency, recorded_traffic, to_trace_requests
from kvfabric.argtypes import int_range, positive_int
from kvfabric.policies import POLICY_NAMES
from kvfabric.queries import BadParameter, DatabaseUnavailable, QueryRunner, UnknownRun
from kvfabric.queries import availability as A
from kvfabric.queries.sources import add_source_arguments, runner_from_args, source_label
from kvfabric.sim.offline import simulate
from kvfabric.usage import UsageError

TOLERANCE = 0.02
"""Stated bound on |replayed - actual| prefix hit rate under the run's own policy and capacity (absolute, as a
fraction of prompt tokens). Measured on the demo run: -0.0056 (benchmarks/results/demo_misses_whatif.md)."""

OPTIMAL = "optimal"
MAX_REST_ADMISSIONS = 20_000
"""The REST what-if replays at most this many admissions: the replay runs in the collector process and holds the
GIL, so ingest slows meanwhile. The CLI, on a database no collector holds, has no bound."""


def policy_names() -> tuple[str, ...]:
    return (*POLICY_NAMES, OPTIMAL)


def _simulate(trace: list[Any], block_size: int, policy: str, num_blocks: int, concurrency: int,
              progress: Iterator[Any] | None) -> dict[str, Any]:
    try:
        return simulate(trace, policy, num_blocks, block_size=block_size, max_output_tokens=None,
                        concurrency=concurrency, trace_block_tokens=block_size, progress=progress)
    except RuntimeError as e:  # the window of requests in flight does not fit the pool
        raise BadParameter(
            f"{num_blocks} blocks cannot hold {concurrency} of this run's requests at once ({e}); "
            "raise num_blocks or lower concurrency"
        ) from e


def whatif(
    runner: QueryRunner,
    run: str,
    policy: str | None = None,
    num_blocks: int | None = None,
    concurrency: int | None = None,
    *,
    max_admissions: int | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """Replay ``run``'s recorded traffic under ``policy`` at ``num_blocks`` (defaults: the run's own), under the
    optimum at the same capacity, and under the run's own configuration. ``concurrency`` None: each engine's mean
    number of requests in flight, rounded. Raises UnknownRun, BadParameter."""
    names = policy_names()
    if policy is not None and policy not in names:
        raise BadParameter(f"unknown policy {policy!r} (known: {', '.join(names)})")
    if num_blocks is not None and num_blocks < 2:
        raise BadParameter(f"num_blocks must be at least 2 (vLLM's null block plus one), got {num_blocks}")
    if concurrency is not None and concurrency < 1:
        raise BadParameter(f"concurrency must be at least 1, got {concurrency}")
    engines = {e["engine"]: e for e in runner.run_engines(run)}
    summary = runner.run_summary(run)
    if not A.has_lookups(summary["sources"]):
        return unavailable(run, policy, num_blocks, summary)
    traffic = recorded_traffic(runner, run)
    if max_admissions is not None and len(traffic) > max_admissions:
        raise BadParameter(f"run {run!r} has {len(traffic)} admissions, more than the {max_admissions} this "
                           "endpoint replays; use `kvfabric whatif` on the database")
    by_engine: dict[str, list[RecordedAdmission]] = {}
    for a in traffic:
        by_engine.setdefault(a.engine, []).append(a)
    own_policies = sorted({str(e["policy"]) for e in engines.values()})
    want_policy = policy or (own_policies[0] if len(own_policies) == 1 else None)
    if want_policy is None:
        raise BadParameter(f"run {run!r} ran several policies ({', '.join(own_policies)}): name one")

    totals: dict[str, dict[str, int]] = {k: {"prompt_tokens": 0, "prefix_hit_tokens": 0, "wasted_prefill_tokens": 0,
                                               "evicted_blocks": 0} for k in ("whatif", "optimal", "own")}
    per_engine = []
    bar = _bar(len(traffic) * 3) if progress else None
    ticks = _ticks(bar) if bar is not None else None
    try:
        for engine, adms in sorted(by_engine.items()):
            decl = engines.get(engine, {})
            own_policy = str(decl.get("policy") or want_policy)
            own_blocks = int(decl.get("num_blocks") or 0)
            blocks = num_blocks or own_blocks
            if own_policy not in names or own_blocks < 2:
                raise BadParameter(f"engine {engine!r} of run {run!r} declared policy {own_policy!r} and "
                                   f"{own_blocks} blocks: the offline replay cannot model it")
            measured = mean_concurrency(adms)
            window = concurrency or max(1, round(measured))
            trace, bs = to_trace_requests(adms), adms[0].block_size
            results = {
                "whatif": _simulate(trace, bs, want_policy, blocks, window, ticks),
                "optimal": _simulate(trace, bs, OPTIMAL, blocks, window, ticks),
                "own": _simulate(trace, bs, own_policy, own_blocks, window, ticks),
            }
            for key, res in results.items():
                for field in totals[key]:
                    totals[key][field] += int(res[field])
            per_engine.append({
                "engine": engine, "admissions": len(adms), "block_size": adms[0].block_size,
                "own_policy": own_policy, "own_num_blocks": own_blocks, "num_blocks": blocks,
                "mean_in_flight": measured, "concurrency": window,
                **{f"{k}_prefix_hit_rate": _rate(v["prefix_hit_tokens"], v["prompt_tokens"])
                   for k, v in results.items()},
            })
    finally:
        if bar is not None:
            bar.close()

    actual_rate = float(summary["prefix_hit_rate"])
    own_rate = _rate(totals["own"]["prefix_hit_tokens"], totals["own"]["prompt_tokens"])
    whatif_rate = _rate(totals["whatif"]["prefix_hit_tokens"], totals["whatif"]["prompt_tokens"])
    error = own_rate - actual_rate
    return {
        "run_id": run,
        "policy": want_policy,
        "num_blocks": num_blocks if num_blocks is not None else (
            per_engine[0]["num_blocks"] if len(per_engine) == 1 else None),
        "admissions": len(traffic),
        "prompt_tokens": int(summary["prompt_tokens"]),
        "engines": per_engine,
        "actual_policy": ", ".join(own_policies),
        "actual_prefix_hit_rate": actual_rate,
        "actual_wasted_prefill_tokens": int(summary["wasted_prefill_tokens"]),
        "actual_evicted_blocks": int(summary["evicted_blocks"]),
        "whatif_prefix_hit_rate": whatif_rate,
        "whatif_wasted_prefill_tokens": totals["whatif"]["wasted_prefill_tokens"],
        "whatif_evicted_blocks": totals["whatif"]["evicted_blocks"],
        "optimal_prefix_hit_rate": _rate(totals["optimal"]["prefix_hit_tokens"], totals["optimal"]["prompt_tokens"]),
        "optimal_wasted_prefill_tokens": totals["optimal"]["wasted_prefill_tokens"],
        "replay_own_prefix_hit_rate": own_rate,
        "replay_own_wasted_prefill_tokens": totals["own"]["wasted_prefill_tokens"],
        "replay_own_error": error,
        "predicted_change": whatif_rate - own_rate,
        "tolerance": TOLERANCE,
        "within_tolerance": abs(error) <= TOLERANCE,
        "unavailable": None,
    }


def unavailable(run: str, policy: str | None, num_blocks: int | None, summary: dict[str, Any]) -> dict[str, Any]:
    """The what-if of a run whose events carry no lookups (vLLM's KV events): no admissions to replay, so every
    replayed or looked-up number is null and ``unavailable`` says why; what the run had in evictions stays."""
    out: dict[str, Any] = dict.fromkeys(_NUMBERS)
    out.update({
        "run_id": run, "policy": policy, "num_blocks": num_blocks, "admissions": 0, "engines": [],
        "actual_policy": ", ".join(summary["policies"]) or None,
        "actual_wasted_prefill_tokens": int(summary["wasted_prefill_tokens"]),
        "actual_evicted_blocks": int(summary["evicted_blocks"]),
        "tolerance": TOLERANCE, "unavailable": A.NO_LOOKUPS,
    })
    return out


_NUMBERS: tuple[str, ...] = (
    "prompt_tokens", "actual_prefix_hit_rate", "whatif_prefix_hit_rate", "whatif_wasted_prefill_tokens",
    "whatif_evicted_blocks", "optimal_prefix_hit_rate", "optimal_wasted_prefill_tokens", "replay_own_prefix_hit_rate",
    "replay_own_wasted_prefill_tokens", "replay_own_error", "predicted_change", "within_tolerance",
)


def _rate(hit: int, prompt: int) -> float:
    return hit / prompt if prompt else 0.0


def _bar(total: int) -> Any:
    try:
        # tqdm: only when a bar is drawn, and optional (a missing one costs the bar only)
        from tqdm import tqdm
    except ImportError:  # a progress bar is never worth failing for
        return None
    return tqdm(total=total, desc="whatif replay", unit="req", file=sys.stderr, leave=False)


def _ticks(bar: Any) -> Iterator[None]:
    while True:
        bar.update(1)
        yield None


# --------------------------------------------------------------------------------------------- CLI


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Replay a recorded run's traffic (block-hash chains rebuilt from its events, in arrival order) through the "
        "offline prefix-cache model under another policy or capacity, and through the optimum; print the prefix "
        "hit rate and wasted prefill next to what the run actually had. The replay of the run's own policy and "
        f"capacity is shown too: it should come within {TOLERANCE:.2f} of the actual hit rate."
    )
    add_source_arguments(parser)
    parser.add_argument("--run", required=True, help="run id")
    parser.add_argument("--policy", default=None, choices=policy_names(),
                        help="policy to replay under (default: the run's own)")
    parser.add_argument("--num-blocks", type=int_range(2), default=None,
                        help="KV capacity in blocks per engine, null block included (default: the run's own)")
    parser.add_argument("--concurrency", type=positive_int, default=None,
                        help="requests in flight in the replay (default: the run's mean, measured from its events)")
    parser.add_argument("--format", choices=("text", "json"), default="text",
                        help="json: one JSON object on the last line (default: %(default)s)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def run(args: argparse.Namespace) -> int:
    try:
        out = whatif(runner_from_args(args), args.run, args.policy, args.num_blocks, args.concurrency,
                     progress=not args.no_progress and args.format == "text")
    except DatabaseUnavailable as exc:
        raise UsageError(f"{source_label(args)}: {exc}") from None
    except (BadParameter, UnknownRun) as exc:
        raise UsageError(str(exc)) from None
    if args.format == "json":
        print(json.dumps(out, sort_keys=True))
        return 0
    print_report(out)
    return 0


def print_report(out: dict[str, Any]) -> None:
    if out.get("unavailable"):
        print(f"What-if for run {out['run_id']}: {out['unavailable']} ({out['actual_evicted_blocks']:,} evicted "
              f"blocks, {out['actual_wasted_prefill_tokens']:,} wasted prefill tokens recorded)")
        return
    engines = out["engines"]
    conc = ", ".join(f"{e['engine']}: {e['concurrency']} (mean {e['mean_in_flight']:.2f})" for e in engines)
    print(f"What-if for run {out['run_id']}: {out['admissions']:,} admissions, {out['prompt_tokens']:,} prompt tokens")
    print(f"  replayed with requests in flight = {conc}")
    own = ", ".join(f"{e['own_policy']}@{e['own_num_blocks']}" for e in engines)
    blocks = ", ".join(str(e["num_blocks"]) for e in engines)
    rows = [
        ("actual (recorded)", own, out["actual_prefix_hit_rate"], out["actual_wasted_prefill_tokens"]),
        ("replay, own config", own, out["replay_own_prefix_hit_rate"], out["replay_own_wasted_prefill_tokens"]),
        ("what-if", f"{out['policy']}@{blocks}", out["whatif_prefix_hit_rate"], out["whatif_wasted_prefill_tokens"]),
        ("optimum", f"optimal@{blocks}", out["optimal_prefix_hit_rate"], out["optimal_wasted_prefill_tokens"]),
    ]
    print(f"  {'':<20} {'policy@blocks':<22} {'prefix hit rate':>15} {'wasted prefill tok':>19}")
    for name, cfg, rate, wasted in rows:
        print(f"  {name:<20} {cfg:<22} {100 * rate:>14.2f}% {wasted:>19,}")
    verdict = "within" if out["within_tolerance"] else "OUTSIDE"
    print(f"  replay error on the own config: {100 * out['replay_own_error']:+.2f} points ({verdict} the stated "
          f"tolerance of {100 * out['tolerance']:.0f} points)")
    print(f"  predicted change of the what-if over the own config: {100 * out['predicted_change']:+.2f} points")
