"""``kvfabric ab``: one scenario, several eviction policies, fresh servers, one report.

The method (docs/design.md §8.3; why, docs/decisions.md "A fair A/B"):

* **Interleaved arms.** Every repetition runs every arm once in the same order (ABAB...; with ``--capacities``,
  capacity by capacity within a repetition): slow drift of a shared machine lands on every arm alike, and no arm
  always runs first or last.
* **Isolated arms.** One server at a time (``--prestart 0``, the default): nothing else starts, loads or compiles
  while an arm is measured. ``--prestart N`` starts the next N arms' servers during a run (faster on a GPU, where
  start-up is most of an arm's time); the report then says the arms were not isolated.
* **Warm-up excluded.** After each server is ready, ``--warmup`` requests of a fixed prompt set (distinct token ids
  of their own, so they can never be hit by the scenario's prompts; by default shorter than one block with their
  output, so nothing of them stays cached: a policy that keeps cold blocks, as ``adaptive_aging`` kept 126 of 128
  warm-up blocks of 256-token prompts, would otherwise be measured in a smaller pool) run first; once the
  collector has stored their events, the measurement starts at a wall-clock cut. The client results hold no
  warm-up request, and when the collector has stopped every event of the run before the cut (and the later
  evictions of the warm-up's blocks) moves to the run id ``<run>~warmup``
  (:func:`kvfabric.bench.analytics.split_warmup`); the run's analytics are then recomputed from the collector's
  file, so no number includes the warm-up.
* **Repetitions** (``--repeat``, default 5): medians with the range (min-max), and the verdict rule
  :func:`kvfabric.bench.report.verdict` on each metric, overall and per traffic component; goodput counts the
  requests whose TTFT meets the scenario's ``ttft_slo_ms`` (or ``--ttft-slo-ms``).
* ``--capacities a,b,c`` runs every capacity x policy x repetition and reports the KV saved at equal hit rate
  (:mod:`kvfabric.bench.kv_saved`).

Per arm: a fresh server with the policy (``kvfabric sim-serve`` by default, any ``--serve-cmd`` otherwise),
streaming to one collector process (``kvfabric collector``) under its own run id; the scenario with the same seed
through :mod:`kvfabric.bench.runner`; a wait until the collector holds every event of the run; the collector's
analytics (REST); the server stopped. At the end the collector stops, warm-ups are split off, and the report
(Markdown + PNG plots + ``ab.json``) joins the collector's analytics with the client's latencies. ``--format json``
prints, as the last line, per policy the medians and spreads of the headline metrics.

Everything lands in ``--out``: ``report.md``, ``plots/``, ``ab.json``, ``plan.json``, ``runs/`` (per run: client
results and collector analytics), ``logs/``, and the collector's ``collector.duckdb`` and ``collector.log``. Several
scenarios (``--scenario a,b``) run back to back against one collector, each in ``--out/<name>/``.
``--report-only`` re-renders the report of an existing ``--out`` without running anything (and first splits off
the warm-ups of a run cut short, when its ``collector.duckdb`` is still there).

**Sittings.** ``--time-limit S`` starts no arm that would not finish within S seconds of the command's start (the
estimate: the longest arm so far in this sitting, its first left out once there is another: that start fills the
compile cache); the A/B then stops cleanly and reports the arms that ran.
``--resume --out DIR`` continues it, possibly on another day or machine: the options come from ``plan.json`` (only
``--serve-cmd`` may be given anew, e.g. another model path), the arms that already ran are skipped by run id, the
order stays ABAB, and each sitting gets a collector file of its own (``collector.duckdb``, ``collector-2.duckdb``,
...; every arm records its file, and warm-ups are split off per file). ``plan.json`` lists the sittings (when,
where, which arms), and the report says how many there were.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shlex
import shutil
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from kvfabric.argtypes import int_range, nonneg_float, nonneg_int, positive_float, positive_int
from kvfabric.argtypes import port as tcp_port
from kvfabric.bench.analytics import fetch_run, offline_run, read_events, split_warmup, wait_quiescent
from kvfabric.bench.report import build, json_line, print_table, write_report
from kvfabric.bench.scenario import Scenario, ScenarioError, bundled_scenarios, load_scenario
from kvfabric.bench.servers import (
    HOLD_SUFFIX,
    PLACEHOLDERS,
    ArmSettings,
    ServerProcess,
    ServerSpecError,
    check_serve_cmd,
    hold_summary,
    serve_command,
    split_arm,
)
from kvfabric.policies import POLICY_NAMES
from kvfabric.usage import UsageError

__all__ = ["DEFAULT_REPEAT", "DEFAULT_WARMUP", "IDLE_HANDSHAKE_S", "configure", "run"]

#: Repetitions per arm by default (the issue's "at least 5").
DEFAULT_REPEAT = 5
#: Warm-up requests per server by default.
DEFAULT_WARMUP = 8
#: Output tokens of a warm-up request.
WARMUP_MAX_TOKENS = 4
#: Seed of the warm-up's prompts (the same in every arm; token ids drawn apart from any scenario's).
WARMUP_SEED = "kvfabric-ab-warmup"

#: The options a resumed A/B takes from its plan.json (the rest are this command's: output, progress, timeouts).
RESUMED_OPTIONS = ("scenario", "policies", "repeat", "serve_cmd", "seed", "kv_blocks", "capacities",
                   "latency_scale", "warmup", "warmup_tokens", "ttft_slo_ms", "prestart")

#: Collector handshake timeout for A/B and soak runs: a server may sit idle this long before its first request.
IDLE_HANDSHAKE_S = 24 * 3600.0


def configure(parser: argparse.ArgumentParser) -> None:
    parser.epilog = (
        "bundled scenarios: " + ", ".join(bundled_scenarios()) + "\n"
        "--serve-cmd placeholders: " + ", ".join("{" + p + "}" for p in PLACEHOLDERS) + "\n\n"
        "examples:\n"
        "  kvfabric ab --scenario template_family_revisit --policies lru,adaptive_aging --repeat 3\n"
        "  kvfabric ab --scenario ordinary_unique_cold --out ab-cold --format json\n"
        "  kvfabric ab --scenario smoke --policies lru,adaptive_aging --capacities 300,450,600 --repeat 3\n"
        "  kvfabric ab --scenario rag_document_revisit --policies lru,learned,learned+hold --repeat 3\n"
        "  kvfabric ab --scenario long_conversation_return --policies lru,shared_aware --time-limit 540 --out ab-lcr\n"
        "  kvfabric ab --resume --out ab-lcr --time-limit 540     (the arms left, in a later sitting)\n"
        "  kvfabric ab --scenario template_family_revisit --serve-cmd \"vllm serve /models/llama --load-format dummy "
        "--skip-tokenizer-init --enable-prefix-caching --enable-prompt-tokens-details --num-gpu-blocks-override "
        "{kv_blocks} --port {port}\"\n"
    )
    parser.add_argument("--scenario", help="bundled scenario name or TOML file; several, comma-separated, run "
                                           "back to back against one collector (a report each, in DIR/<name>/)")
    parser.add_argument("--policies", default="lru,adaptive_aging",
                        help="comma-separated policies; the first is the baseline; POLICY+hold is the policy with "
                             "cache-aware scheduling on (KVFABRIC_CACHE_AWARE_SCHEDULING=1; every other arm runs "
                             "with it off) (default: %(default)s)")
    parser.add_argument("--repeat", type=positive_int, default=DEFAULT_REPEAT,
                        help="repetitions per arm; every repetition runs every arm once, in the same order "
                             "(ABAB...) (default: %(default)s)")
    parser.add_argument("--out", default=None, help="output directory (default ab-<scenario>-<time>)")
    parser.add_argument("--format", choices=("text", "json"), default="text",
                        help="json: print per-policy medians and spreads as one JSON object on the last line "
                             "(default: %(default)s)")
    parser.add_argument("--serve-cmd", default=None,
                        help="start each arm's server with this command instead of kvfabric sim-serve")
    parser.add_argument("--seed", type=int, default=None, help="override the scenario's seed")
    parser.add_argument("--kv-blocks", type=int_range(2), default=None,
                        help="override the scenario's KV capacity (blocks)")
    parser.add_argument("--capacities", default=None, metavar="A,B,C",
                        help="sweep the KV pool: comma-separated capacities in blocks (at least two; they override "
                             "the scenario's kv_blocks); every capacity x policy x repetition is an arm, and the "
                             "report gives the KV saved at equal hit rate against lru, which must be among "
                             "--policies (default: no sweep)")
    parser.add_argument("--latency-scale", type=nonneg_float, default=None,
                        help="override the scenario's sim-serve latency scale")
    parser.add_argument("--warmup", type=nonneg_int, default=DEFAULT_WARMUP, metavar="N",
                        help="warm-up requests after each server start, before the measurement, excluded from "
                             "every number (client and collector); a fixed prompt set of its own, two at a time; "
                             "0: none (default: %(default)s)")
    parser.add_argument("--warmup-tokens", type=int_range(1), default=None, metavar="T",
                        help="prompt length of each warm-up request in tokens (default: block size - 5, so that "
                             "with its 4 output tokens a warm-up request never fills a block and leaves nothing "
                             "cached; longer warm-ups leave blocks in the pool that policies keep differently, "
                             "and the report says so)")
    parser.add_argument("--ttft-slo-ms", type=positive_float, default=None, metavar="MS",
                        help="TTFT SLO for goodput (requests/s whose TTFT is at most this), overriding the "
                             "scenario's ttft_slo_ms; with --report-only, recomputes goodput (default: the "
                             "scenario's; no goodput when neither is set)")
    parser.add_argument("--port", type=tcp_port, default=0,
                        help="server port (default: %(default)s, a free one per arm)")
    parser.add_argument("--ready-timeout", type=positive_float, default=600.0, help="seconds to wait for each server")
    parser.add_argument("--prestart", type=nonneg_int, default=0, metavar="N",
                        help="start the next N arms' servers while the current arm runs: hides start-up time "
                             "where it is scarce (a GPU), but the start-ups then compete with the measured arm, "
                             "and the report says the arms were not isolated (default: %(default)s, isolated "
                             "arms)")
    parser.add_argument("--time-limit", type=positive_float, default=None, metavar="S",
                        help="start no arm that would not finish within S seconds of this command's start "
                             "(estimated from the longest arm so far); stop cleanly and report the arms that ran; "
                             "--resume continues (default: no limit)")
    parser.add_argument("--resume", action="store_true",
                        help="continue the A/B in --out DIR that stopped early: run the arms it has not run, with "
                             "the options recorded in its plan.json (--serve-cmd may be given anew)")
    parser.add_argument("--report-only", action="store_true", help="re-render the report of an existing --out")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars (they are drawn on stderr)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _say(msg: str) -> None:
    print(msg, flush=True)


def _machine() -> str:
    return f"{platform.node()}, {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"


def _portable(text: str) -> str:
    """``text`` with this interpreter's path written as ``python``: plans and reports get committed as examples,
    and the machine's install location is noise there."""
    return text.replace(sys.executable, "python")


def _arm_order(policies: list[str], repeat: int, capacities: list[int | None] | None = None
               ) -> list[tuple[int, int | None, str]]:
    """(repetition, capacity, policy) in run order: every repetition runs every (capacity, policy) once, in the same
    order, capacity by capacity (ABAB..., never AAA...BBB); capacity None when there is no sweep."""
    caps: list[int | None] = list(capacities) if capacities else [None]
    return [(r, c, p) for r in range(repeat) for c in caps for p in policies]


def _parse_capacities(text: str) -> list[int]:
    """``--capacities`` as sorted distinct block counts (at least two, each >= 2)."""
    caps = []
    for part in (x.strip() for x in text.split(",")):
        if not part:
            continue
        try:
            value = int(part, 10)
        except ValueError:
            raise ScenarioError(f"--capacities: {part!r} is not a whole number of KV blocks") from None
        if value < 2:
            raise ScenarioError(f"--capacities: {value} blocks is too small (>= 2)")
        caps.append(value)
    if len(set(caps)) < 2 or len(set(caps)) != len(caps):
        raise ScenarioError("--capacities needs at least two distinct capacities, e.g. 300,450,600")
    return sorted(caps)


def _slo_ms(args: argparse.Namespace, scenario: Scenario) -> tuple[float | None, str | None]:
    """The TTFT SLO for goodput and where it came from (``--ttft-slo-ms`` beats the scenario's ``ttft_slo_ms``)."""
    if getattr(args, "ttft_slo_ms", None) is not None:
        return float(args.ttft_slo_ms), "--ttft-slo-ms"
    slo = getattr(scenario, "ttft_slo_ms", None)
    return (float(slo), "scenario") if slo is not None else (None, None)


def _validate(args: argparse.Namespace) -> tuple[list[Scenario], list[str], list[int] | None]:
    if not args.scenario:
        raise ScenarioError("--scenario is required")
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if len(policies) < 1 or len(set(policies)) != len(policies):
        raise ScenarioError("--policies needs distinct names, e.g. lru,adaptive_aging")
    unknown = [p for p in policies if split_arm(p)[0] not in POLICY_NAMES]
    if unknown:
        raise ScenarioError(f"unknown policy {', '.join(unknown)} (known: {', '.join(POLICY_NAMES)}; "
                            f"POLICY{HOLD_SUFFIX} adds cache-aware scheduling)")
    if args.repeat < 1:
        raise ScenarioError("--repeat must be >= 1")
    if args.prestart < 0:
        raise ScenarioError("--prestart must be >= 0")
    if args.warmup < 0:
        raise ScenarioError("--warmup must be >= 0")
    if args.serve_cmd is not None:
        check_serve_cmd(args.serve_cmd)
    if args.prestart and args.port:
        raise ScenarioError("--prestart runs several servers at once: it needs a free port per arm (drop --port)")
    capacities = None
    if args.capacities is not None:
        if args.kv_blocks is not None:
            raise ScenarioError("--capacities sets the KV pool of every arm: drop --kv-blocks")
        capacities = _parse_capacities(args.capacities)
        if "lru" not in policies:
            raise ScenarioError("--capacities measures KV saved against lru: add lru to --policies")
    scenarios = []
    for name in [n.strip() for n in args.scenario.split(",") if n.strip()]:
        scenario = load_scenario(name)
        if args.seed is not None:
            scenario = replace(scenario, seed=args.seed)
        server = scenario.server
        if args.kv_blocks is not None:
            if args.kv_blocks < 2:
                raise ScenarioError("--kv-blocks must be >= 2")
            server = replace(server, kv_blocks=args.kv_blocks)
        if args.latency_scale is not None:
            if args.latency_scale < 0:
                raise ScenarioError("--latency-scale must be >= 0")
            server = replace(server, latency_scale=args.latency_scale)
        if capacities and args.serve_cmd is None:
            # sim-serve's rule (docs/design.md §8.1): vLLM's null block holds nothing, and a request that cannot fit
            # would wait forever.
            small = [c for c in capacities if (c - 1) * server.block_size < server.max_model_len]
            if small:
                raise ScenarioError(f"--capacities {small[0]}: ({small[0]} - 1) x block size {server.block_size} < "
                                    f"{scenario.name}'s max_model_len {server.max_model_len}")
        scenarios.append(replace(scenario, server=server))
    if len({s.name for s in scenarios}) != len(scenarios):
        raise ScenarioError("--scenario names a scenario twice")
    return scenarios, policies, capacities


async def _bench(scenario: Scenario, url: str, run_id: str, progress: bool, desc: str) -> dict[str, Any]:
    # (the client loads httpx: only when an arm runs, so `kvfabric ab --help` stays fast)
    from kvfabric.bench.client import CompletionClient, discover_model
    from kvfabric.bench.runner import run_scenario

    model = await discover_model(url)
    client = CompletionClient(url, model, token_prompts=scenario.prompt_format == "tokens",
                              max_connections=max(16, 2 * sum(t.concurrency for t in scenario.traffic)))
    try:
        result = await run_scenario(scenario, client, run_id=run_id, endpoint=url, progress=progress, desc=desc)
    finally:
        await client.aclose()
    return result.as_dict()


def warmup_tokens(requested: int | None, scenario: Scenario) -> int:
    """The warm-up's prompt length: ``requested``, or (None) block size - 1 - :data:`WARMUP_MAX_TOKENS`, so that
    prompt and answer stay inside one partial block, which vLLM never caches; at least 1, at most
    ``max_model_len - 8``."""
    srv = scenario.server
    tokens = requested if requested is not None else srv.block_size - 1 - WARMUP_MAX_TOKENS
    return max(1, min(tokens, srv.max_model_len - 8))


def warmup_prompts(n: int, tokens: int) -> list[list[int]]:
    """The warm-up's prompts: ``n`` prompts of ``tokens`` token ids, the same in every arm, drawn from a seed of
    their own (a scenario's prompt sharing a whole block with them is as likely as a 64-bit hash collision)."""
    # (the prompts pull in kvfabric.sim: only when an arm runs, so `kvfabric ab --help` stays fast)
    from kvfabric.bench.prompts import draw_tokens

    return [draw_tokens(random.Random(f"{WARMUP_SEED}/{i}"), tokens) for i in range(n)]


async def _warmup(scenario: Scenario, url: str, run_id: str, n: int, tokens: int) -> dict[str, Any]:
    """Send the ``n`` warm-up requests of ``tokens`` tokens (two at a time, :data:`WARMUP_MAX_TOKENS` output tokens
    each) to a ready server; their request ids are ``<run>-warmup-<i>``. Returns counts and time; the records are
    not kept (no number may include them)."""
    # (httpx and kvfabric.sim: only when an arm runs, so `kvfabric ab --help` stays fast)
    from kvfabric.bench.client import CompletionClient, RequestRecord, discover_model
    from kvfabric.bench.prompts import Prompt, PromptFormat

    fmt = PromptFormat(scenario.prompt_format)
    model = await discover_model(url)
    client = CompletionClient(url, model, token_prompts=fmt.tokens, max_connections=4)
    slots = asyncio.Semaphore(2)
    t0 = time.monotonic()
    records: list[RequestRecord] = []

    async def one(i: int, prompt: list[int]) -> None:
        async with slots:
            rec = RequestRecord(index=i, request_id=f"{run_id}-warmup-{i:03d}", component="(warm-up)",
                                session=f"warmup-{i}", turn=0, family=None, start_s=0.0,
                                max_tokens=WARMUP_MAX_TOKENS)
            await client.complete(rec, fmt.render(Prompt().plus(prompt)), None, t0)
            records.append(rec)

    try:
        await asyncio.gather(*(one(i, p) for i, p in enumerate(warmup_prompts(n, tokens))))
    finally:
        await client.aclose()
    return {"requests": n, "requests_ok": sum(r.ok for r in records), "prompt_tokens": tokens,
            "wall_s": time.monotonic() - t0,
            "errors": sorted({r.error for r in records if r.error})[:3]}


@dataclass
class _Arm:
    """One server + scenario run: what it is, and (once launched) its server. ``scenario.server.kv_blocks`` is the
    arm's capacity (the swept one under ``--capacities``)."""

    scenario: Scenario
    out: Path
    repetition: int
    policy: str
    run_id: str
    capacity: int | None = None
    server: ServerProcess | None = None
    argv: list[str] = field(default_factory=list)
    url: str = ""


def _plan_arms(scenarios: list[Scenario], policies: list[str], repeat: int, out: Path, stamp: str,
               capacities: list[int] | None = None) -> list[_Arm]:
    """Every arm in run order: scenario by scenario, then :func:`_arm_order` (ABAB...)."""
    arms = []
    for sc in scenarios:
        sc_out = out if len(scenarios) == 1 else out / sc.name
        for rep, cap, policy in _arm_order(policies, repeat, list(capacities) if capacities else None):
            arm_sc = sc if cap is None else replace(sc, server=replace(sc.server, kv_blocks=cap))
            kv = "" if cap is None else f"-kv{cap}"
            arms.append(_Arm(arm_sc, sc_out, rep + 1, policy, f"{sc.name}-{policy}{kv}-r{rep + 1}-{stamp}", cap))
    return arms


def arm_db(out: Path, plan: dict[str, Any], arm: dict[str, Any]) -> Path:
    """The collector file that holds an arm's events: the arm's own record (each sitting has its file), else the
    plan's (A/Bs from before sittings), else ``collector.duckdb`` in ``out`` or, for one scenario of several, its
    parent (a run cut short before it recorded any)."""
    rel = arm.get("collector_db") or plan.get("collector_db")
    if rel:
        return out / rel
    for d in (out, out.parent):
        if (d / "collector.duckdb").is_file():
            return d / "collector.duckdb"
    return out / "collector.duckdb"


def finalise(out: Path, db: Path | None = None) -> int:
    """Split the warm-ups off the collector's files and recompute every run's analytics from them (the collector
    has stopped). ``db``: only the arms whose events are in that file (None: every arm, each from its own file).
    Idempotent: a run already finalised, or whose file is gone, is left alone. Returns the number of runs
    finalised."""
    plan_path = out / "plan.json"
    plan = json.loads(plan_path.read_text())
    groups: dict[Path, list[dict[str, Any]]] = {}
    for a in plan["arms"]:
        if (a.get("warmup") or {}).get("excluded_from_collector"):
            continue
        f = arm_db(out, plan, a)
        if (db is None or f.resolve() == db.resolve()) and f.is_file():
            groups.setdefault(f, []).append(a)
    for f, todo in groups.items():
        moved = split_warmup(str(f), {a["run_id"]: (a.get("warmup") or {}).get("cut_ns") for a in todo})
        series = read_events(str(f), [a["run_id"] for a in todo])
        for a in todo:
            path = out / "runs" / f"{a['run_id']}.collector.json"
            data = offline_run(str(f), a["run_id"])
            data["events"] = series.get(a["run_id"], {})
            path.write_text(json.dumps(data, default=str) + "\n")
            warm = a.setdefault("warmup", {"requests": 0})
            warm["collector_rows_moved"] = moved.get(a["run_id"], 0)
            warm["excluded_from_collector"] = True
    plan_path.write_text(json.dumps(plan, indent=1) + "\n")
    return sum(len(t) for t in groups.values())


def _scenario_out(out: Path, scenarios: list[Scenario], sc: Scenario) -> Path:
    return out if len(scenarios) == 1 else out / sc.name


def _sitting_db(out: Path) -> Path:
    """This sitting's collector file: ``collector.duckdb``, or for a resumed A/B the first free
    ``collector-N.duckdb`` (each sitting's warm-ups are split off its own file)."""
    db, n = out / "collector.duckdb", 1
    while db.exists() or db.with_name(db.name + ".wal").exists():
        n += 1
        db = out / f"collector-{n}.duckdb"
    return db


def load_resume(args: argparse.Namespace) -> tuple[list[Scenario], list[str], list[int] | None,
                                                  dict[str, dict[str, Any]]]:
    """``--resume``: set ``args`` to the options recorded in ``--out``'s plan(s) (``--serve-cmd`` given now wins),
    and return the scenarios, policies, capacities and the plans by scenario name. Refuses an A/B whose plan has no
    recorded options, or whose scenario file has changed since it started (the arms would not be comparable)."""
    if not args.out or not Path(args.out).is_dir():
        raise ScenarioError("--resume needs --out DIR of a kvfabric ab run that stopped early")
    out = Path(args.out)
    paths = [out / "plan.json"] if (out / "plan.json").is_file() else sorted(out.glob("*/plan.json"))
    if not paths:
        raise ScenarioError(f"--resume: no plan.json in {out} (nor in its subdirectories)")
    plans = [json.loads(p.read_text()) for p in paths]
    options = plans[0].get("options")
    if options is None:
        raise ScenarioError(f"--resume: {paths[0]} records no options (an A/B from before --resume): run it anew")
    serve_cmd = args.serve_cmd
    for k in RESUMED_OPTIONS:
        setattr(args, k, options.get(k))
    if serve_cmd is not None:
        args.serve_cmd = serve_cmd
    scenarios, policies, capacities = _validate(args)
    by_name = {str(p["scenario"]["name"]): p for p in plans}
    for sc in scenarios:
        plan = by_name.get(sc.name)
        if plan is None:
            raise ScenarioError(f"--resume: {out} holds no plan for scenario {sc.name}")
        if json.loads(json.dumps(sc.as_dict())) != plan["scenario"]:
            raise ScenarioError(f"--resume: scenario {sc.name} has changed since the A/B started: its arms would "
                                "not be comparable; run it anew")
    return scenarios, policies, capacities, by_name


def run_arms(args: argparse.Namespace, scenarios: list[Scenario], policies: list[str], out: Path,
             capacities: list[int] | None = None, resume: dict[str, dict[str, Any]] | None = None
             ) -> tuple[list[Path], int]:
    """Run every arm (``resume``: every arm its plans have not run) against one collector; write each scenario's
    ``plan.json`` and runs. Returns the scenario output directories and the number of arms left for a later
    sitting (``--time-limit``)."""
    from kvfabric.collector import CollectorConfig, CollectorProcess  # (FastAPI, DuckDB: not for --help)

    stamp = str(next(iter(resume.values()))["stamp"]) if resume else datetime.now().strftime("%Y%m%d-%H%M%S")
    planned = _plan_arms(scenarios, policies, args.repeat, out, stamp, capacities)
    done = {a["run_id"] for p in (resume or {}).values() for a in p["arms"]}
    arms = [a for a in planned if a.run_id not in done]
    sc_outs = [_scenario_out(out, scenarios, sc) for sc in scenarios]
    if resume is None:
        for d in sc_outs:
            if (d / "plan.json").exists() or (d / "runs").exists():
                raise ScenarioError(f"{d} already holds an A/B run: choose a new --out (or --report-only, "
                                    "or --resume)")
        if (out / "collector.duckdb").exists():
            raise ScenarioError(f"{out} already holds a collector.duckdb: choose a new --out (or --report-only)")
    for d in sc_outs:
        (d / "runs").mkdir(parents=True, exist_ok=True)
        (d / "logs").mkdir(parents=True, exist_ok=True)
    if not arms:
        _say(f"kvfabric ab: every planned arm has run already ({len(planned)}); re-rendering the report")
        return sc_outs, 0
    db = _sitting_db(out)
    sock_dir = tempfile.mkdtemp(prefix="kvf-ab-", dir="/tmp")  # sun_path is 108 bytes: keep the socket short
    sock = os.path.join(sock_dir, "c.sock")
    collector = CollectorProcess(
        # A hook's forwarder connects when its engine starts but sends its schema only with the first events; servers
        # wait idle (--prestart) longer than the default 10 s handshake, which would drop and count a first batch.
        CollectorConfig(db_path=str(db), socket_path=sock, port=_free_port(), handshake_timeout_s=IDLE_HANDSHAKE_S),
        log_path=str(out / "collector.log"), ready_timeout=60.0,
    )
    plans: dict[str, dict[str, Any]] = {}
    command = "kvfabric " + shlex.join(sys.argv[1:]) if sys.argv else ""
    sitting = {"started_at": datetime.now().isoformat(timespec="seconds"), "machine": _machine(),
               "command": command, "serve_cmd": args.serve_cmd, "collector_db": db.name, "arms": [],
               "wall_s": 0.0, "stopped_early": False}
    for sc in scenarios:
        if resume is not None:
            plans[sc.name] = resume[sc.name]
            plans[sc.name]["sittings"].append(json.loads(json.dumps(sitting)))
            continue
        slo, slo_from = _slo_ms(args, sc)
        plans[sc.name] = {
            "scenario": sc.as_dict(), "policies": policies, "repeat": args.repeat, "seed": sc.seed,
            "capacities": capacities, "order": "interleaved (ABAB): every repetition runs every arm once, in the "
                                               "same order",
            "server": "sim-serve" if args.serve_cmd is None else "serve-cmd", "serve_cmd": args.serve_cmd,
            "prestart": args.prestart, "isolated": args.prestart == 0,
            "warmup": {"requests": args.warmup, "prompt_tokens": warmup_tokens(args.warmup_tokens, sc),
                       "max_tokens": WARMUP_MAX_TOKENS,
                       "leaves_cached_blocks": warmup_tokens(args.warmup_tokens, sc) + WARMUP_MAX_TOKENS
                       >= sc.server.block_size,
                       "excluded": "client: warm-up requests are not in the run's results; collector: events "
                                   "before the cut (and evictions of warm-up blocks) moved to <run>~warmup"},
            "ttft_slo_ms": slo, "ttft_slo_from": slo_from,
            "machine": _machine(), "started_at": sitting["started_at"], "command": command, "arms": [],
            "stamp": stamp, "options": {k: getattr(args, k) for k in RESUMED_OPTIONS},
            "sittings": [json.loads(json.dumps(sitting))],
        }

    def record_sitting(plan: dict[str, Any], wall: float, stopped: bool) -> None:
        cur = plan["sittings"][-1]
        cur.update(wall_s=wall, stopped_early=stopped)
        plan["wall_s"] = sum(x["wall_s"] for x in plan["sittings"])

    def launch(arm: _Arm) -> None:
        srv = arm.scenario.server
        port = args.port or _free_port()
        settings = ArmSettings(port=port, policy=arm.policy, run_id=arm.run_id, socket=sock,
                               kv_blocks=srv.kv_blocks, block_size=srv.block_size, max_model_len=srv.max_model_len,
                               model=srv.model, latency_scale=srv.latency_scale)
        arm.argv = serve_command(settings, args.serve_cmd)
        arm.url = f"http://127.0.0.1:{port}"
        arm.server = ServerProcess(arm.argv, url=arm.url, env={**os.environ, **settings.kvfabric_env()},
                                   log_path=str(arm.out / "logs" / f"{arm.run_id}.server.log"),
                                   ready_timeout=args.ready_timeout)
        arm.server.launch()

    t_start = time.monotonic()
    left = 0
    collector.start()
    http = collector.http_url or ""
    try:
        launch(arms[0])
        for n, arm in enumerate(arms, 1):
            sc = arm.scenario
            server = arm.server
            assert server is not None
            t_arm = time.monotonic()
            cap = f" at {arm.capacity:,} blocks" if arm.capacity is not None else ""
            _say(f"[{n}/{len(arms)}] {sc.name}: {arm.policy}{cap} (repetition {arm.repetition}): waiting for the "
                 "server")
            warm: dict[str, Any] = {"requests": 0}
            try:
                server.wait_ready()
                # Servers started ahead (--prestart) start up while this arm runs; the first arm's starts alone.
                for a in arms[n : n + args.prestart]:
                    if a.server is None:
                        launch(a)
                ahead = [a for a in arms[n : n + args.prestart] if a.server is not None]
                if args.warmup:
                    warm = asyncio.run(_warmup(sc, arm.url, arm.run_id, args.warmup,
                                               warmup_tokens(args.warmup_tokens, sc)))
                    if not warm["requests_ok"]:
                        raise RuntimeError(f"{arm.run_id}: no warm-up request succeeded ({warm['errors']})")
                    # Every warm-up event is stored before the cut: the measured run's events all come after it.
                    warm["events"] = wait_quiescent(http, arm.run_id, settle_s=1.0)
                    warm["cut_ns"] = time.time_ns()
                _say(f"      ready in {server.ready_s:.1f} s"
                     + (f"; warm-up {warm['requests_ok']}/{warm['requests']} in {warm['wall_s']:.1f} s"
                        if args.warmup else "")
                     + f"; running {sc.name} (seed {sc.seed})"
                     + (f"; the next {len(ahead)} server(s) start meanwhile" if ahead else ""))
                bench = asyncio.run(_bench(sc, arm.url, arm.run_id, not args.no_progress, f"      {arm.policy}"))
                events = wait_quiescent(http, arm.run_id)
                # Provisional (warm-up included) until finalise() has split the warm-up off, once the collector stops.
                analytics = {**fetch_run(http, arm.run_id), "warmup_included": bool(args.warmup)}
                processes = server.stats()
            finally:
                server.stop()
            arm_s = time.monotonic() - t_arm
            # The next arm's time: the longest of this sitting's arms after its first, whose server start also
            # filled the compile cache (on a GPU 2-3 times a later start); the first alone until there is another.
            sitting_arms = [x["arm_s"] for x in plans[sc.name]["arms"]
                            if x["run_id"] in plans[sc.name]["sittings"][-1]["arms"]] + [arm_s]
            longest = max(sitting_arms[1:] or sitting_arms)
            if (n < len(arms) and args.time_limit is not None
                    and time.monotonic() - t_start + longest > args.time_limit):
                left = len(arms) - n  # the next arm would not finish in time: stop cleanly, --resume goes on
            elif n < len(arms) and arms[n].server is None:
                launch(arms[n])
            (arm.out / "runs" / f"{arm.run_id}.bench.json").write_text(json.dumps(bench) + "\n")
            (arm.out / "runs" / f"{arm.run_id}.collector.json").write_text(json.dumps(analytics) + "\n")
            s, c = bench["summary"], analytics["summary"]
            _say(f"      {s['requests_ok']} requests in {s['wall_s']:.1f} s; hit rate "
                 f"{100 * c['prefix_hit_rate']:.1f} %{' (with the warm-up)' if args.warmup else ''}, rebuilt "
                 f"{c['rebuilt_from_eviction_blocks']:,} blocks, TTFT p50 {1000 * (s['ttft_p50_s'] or 0):.0f} ms; "
                 f"{events:,} events")
            plans[sc.name]["arms"].append({
                "run_id": arm.run_id, "policy": arm.policy, "repetition": arm.repetition,
                "kv_blocks": sc.server.kv_blocks, "capacity": arm.capacity,
                "argv": [_portable(a) for a in arm.argv],
                "ready_s": server.ready_s, "arm_s": arm_s, "events": events,
                "collector_db": os.path.relpath(db, arm.out), "sitting": len(plans[sc.name]["sittings"]),
                "warmup": warm, "servers_starting_during_run": len(ahead),
                "processes": [{**p, "cmdline": _portable(str(p["cmdline"]))} for p in processes],
                # (read once the server has stopped: the hold writes its line when vLLM shuts the scheduler down)
                "hold": hold_summary(server.log_path) if split_arm(arm.policy)[1] else None,
            })
            plans[sc.name]["sittings"][-1]["arms"].append(arm.run_id)
            # Written after every arm: if the whole run is cut short (a time limit), --report-only still reports
            # the arms that finished (it splits the warm-ups off first while collector.duckdb is there).
            record_sitting(plans[sc.name], time.monotonic() - t_start, False)
            (arm.out / "plan.json").write_text(json.dumps(plans[sc.name], indent=1) + "\n")
            if left:
                _say(f"      stopping: the next arm would end past --time-limit {args.time_limit:g} s; {left} "
                     f"arm(s) left for a later sitting (kvfabric ab --resume --out {out})")
                break
    finally:
        for a in arms:
            if a.server is not None and a.server.proc is not None and a.server.proc.poll() is None:
                a.server.stop(timeout=10.0)
        collector.stop()
        shutil.rmtree(sock_dir, ignore_errors=True)
    wall = time.monotonic() - t_start
    for sc, d in zip(scenarios, sc_outs, strict=True):
        record_sitting(plans[sc.name], wall, bool(left))
        plans[sc.name].pop("collector_db", None)  # every arm names its own file
        (d / "plan.json").write_text(json.dumps(plans[sc.name], indent=1) + "\n")
        finalise(d, db)
    return sc_outs, left


def run(args: argparse.Namespace) -> int:
    try:
        if args.report_only and args.resume:
            raise ScenarioError("--report-only and --resume exclude each other")
        if args.report_only:
            if not args.out or not Path(args.out).is_dir():
                raise ScenarioError("--report-only needs --out DIR of a finished kvfabric ab run")
            out = Path(args.out)
            outs = [out] if (out / "plan.json").is_file() else sorted(p.parent for p in out.glob("*/plan.json"))
            if not outs:
                raise ScenarioError(f"--report-only: no plan.json in {out} (nor in its subdirectories)")
            for d in outs:
                if finalise(d):
                    _say(f"{d}: warm-ups split off the collector's runs")
        else:
            resume = None
            if args.resume:
                if args.scenario:
                    raise ScenarioError("--resume takes the scenario and every option from the plan: drop "
                                        "--scenario (only --serve-cmd may be given anew)")
                scenarios, policies, capacities, resume = load_resume(args)
            else:
                scenarios, policies, capacities = _validate(args)
            names = "+".join(s.name for s in scenarios)
            out = Path(args.out or f"ab-{names}-{datetime.now().strftime('%Y%m%d-%H%M%S')}")
            ran = sum(len(p["arms"]) for p in (resume or {}).values())
            _say(f"kvfabric ab{' (resumed: ' + str(ran) + ' arm(s) ran before)' if resume else ''}: "
                 f"{', '.join(s.name for s in scenarios)}; policies {', '.join(policies)}; "
                 + (f"capacities {', '.join(map(str, capacities))} blocks; " if capacities else "")
                 + f"{args.repeat} repetition(s), interleaved; warm-up {args.warmup} request(s) per server; "
                 + ("isolated arms" if not args.prestart else f"--prestart {args.prestart}: arms not isolated")
                 + (f"; time limit {args.time_limit:g} s" if args.time_limit else "")
                 + f"; output in {out}/")
            outs, left = run_arms(args, scenarios, policies, out, capacities, resume)
            if left:
                _say(f"kvfabric ab: stopped by --time-limit with {left} arm(s) not run; the report covers the arms "
                     f"that ran; continue with: kvfabric ab --resume --out {out}")
    except (ScenarioError, ServerSpecError) as exc:
        raise UsageError(str(exc)) from None
    except (RuntimeError, TimeoutError, OSError) as exc:
        print(f"kvfabric ab: {exc}", file=sys.stderr)
        return 1
    lines = {}
    slo = getattr(args, "ttft_slo_ms", None)
    for d in outs:
        result = build(d, ttft_slo_ms=slo if args.report_only else None)
        write_report(d, result)
        _say(f"\n== {result['plan']['scenario']['name']}")
        print_table(result)
        _say(f"report: {d / 'report.md'}")
        lines[result["plan"]["scenario"]["name"]] = json_line(result)
    if args.format == "json":
        print(json.dumps(next(iter(lines.values())) if len(lines) == 1 else {"scenarios": lines}))
    return 0
