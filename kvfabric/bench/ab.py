"""``kvfabric ab``: one scenario, several eviction policies, fresh servers, one report.

For each repetition and policy (the order alternates between repetitions, so slow drift of a shared machine
spreads over every arm) it starts a fresh server with the policy (``kvfabric sim-serve`` by default, any
``--serve-cmd`` otherwise), streaming to one collector process (``kvfabric collector``) under its own run id, runs
the scenario with the same seed through :mod:`kvfabric.bench.runner`, waits until the collector holds every event
of the run, reads the collector's analytics (REST), and stops the server. At the end the collector stops and the
report (Markdown + PNG plots + ``ab.json``) joins the collector's analytics with the client's latencies; the rule
for calling a difference is :func:`kvfabric.bench.report.verdict`. ``--format json`` prints, as the last line, per
policy the medians and spreads of the headline metrics.

Everything lands in ``--out``: ``report.md``, ``plots/``, ``ab.json``, ``plan.json``, ``runs/`` (per run: client
results and collector analytics), ``logs/``, and the collector's ``collector.duckdb`` and ``collector.log``. Several
scenarios (``--scenario a,b``) run back to back against one collector, each in ``--out/<name>/``. ``--prestart N``
starts the next N arms' servers while an arm runs (start-up is most of an arm's time on a GPU machine).
``--report-only`` re-renders the report of an existing ``--out`` without running anything.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
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
from kvfabric.bench.analytics import fetch_run, read_events, wait_quiescent
from kvfabric.bench.report import build, json_line, print_table, write_report
from kvfabric.bench.scenario import Scenario, ScenarioError, bundled_scenarios, load_scenario
from kvfabric.bench.servers import (
    PLACEHOLDERS,
    ArmSettings,
    ServerProcess,
    ServerSpecError,
    check_serve_cmd,
    serve_command,
)
from kvfabric.policies import POLICY_NAMES
from kvfabric.usage import UsageError

__all__ = ["IDLE_HANDSHAKE_S", "configure", "run"]

#: Collector handshake timeout for A/B and soak runs: a server may sit idle this long before its first request.
IDLE_HANDSHAKE_S = 24 * 3600.0


def configure(parser: argparse.ArgumentParser) -> None:
    parser.epilog = (
        "bundled scenarios: " + ", ".join(bundled_scenarios()) + "\n"
        "--serve-cmd placeholders: " + ", ".join("{" + p + "}" for p in PLACEHOLDERS) + "\n\n"
        "examples:\n"
        "  kvfabric ab --scenario template_family_revisit --policies lru,adaptive_aging --repeat 3\n"
        "  kvfabric ab --scenario ordinary_unique_cold --out ab-cold --format json\n"
        "  kvfabric ab --scenario template_family_revisit --serve-cmd \"vllm serve /models/llama --load-format dummy "
        "--skip-tokenizer-init --enable-prefix-caching --enable-prompt-tokens-details --num-gpu-blocks-override "
        "{kv_blocks} --port {port}\"\n"
    )
    parser.add_argument("--scenario", help="bundled scenario name or TOML file; several, comma-separated, run "
                                           "back to back against one collector (a report each, in DIR/<name>/)")
    parser.add_argument("--policies", default="lru,adaptive_aging",
                        help="comma-separated policies; the first is the baseline (default: %(default)s)")
    parser.add_argument("--repeat", type=positive_int, default=3, help="repetitions per policy (default: %(default)s)")
    parser.add_argument("--out", default=None, help="output directory (default ab-<scenario>-<time>)")
    parser.add_argument("--format", choices=("text", "json"), default="text",
                        help="json: print per-policy medians and spreads as one JSON object on the last line "
                             "(default: %(default)s)")
    parser.add_argument("--serve-cmd", default=None,
                        help="start each arm's server with this command instead of kvfabric sim-serve")
    parser.add_argument("--seed", type=int, default=None, help="override the scenario's seed")
    parser.add_argument("--kv-blocks", type=int_range(2), default=None,
                        help="override the scenario's KV capacity (blocks)")
    parser.add_argument("--latency-scale", type=nonneg_float, default=None,
                        help="override the scenario's sim-serve latency scale")
    parser.add_argument("--port", type=tcp_port, default=0,
                        help="server port (default: %(default)s, a free one per arm)")
    parser.add_argument("--ready-timeout", type=positive_float, default=600.0, help="seconds to wait for each server")
    parser.add_argument("--prestart", type=nonneg_int, default=0, metavar="N",
                        help="start the next N arms' servers while the current arm runs (hides start-up time where "
                             "it is scarce, e.g. on a GPU; start-ups then compete with the running arm; default 0)")
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


def _arm_order(policies: list[str], repeat: int) -> list[tuple[int, str]]:
    """(repetition, policy) in run order: forwards on even repetitions, backwards on odd ones (ABBA...)."""
    order = []
    for r in range(repeat):
        for p in (policies if r % 2 == 0 else list(reversed(policies))):
            order.append((r, p))
    return order


def _validate(args: argparse.Namespace) -> tuple[list[Scenario], list[str]]:
    if not args.scenario:
        raise ScenarioError("--scenario is required")
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if len(policies) < 1 or len(set(policies)) != len(policies):
        raise ScenarioError("--policies needs distinct names, e.g. lru,adaptive_aging")
    unknown = [p for p in policies if p not in POLICY_NAMES]
    if unknown:
        raise ScenarioError(f"unknown policy {', '.join(unknown)} (known: {', '.join(POLICY_NAMES)})")
    if args.repeat < 1:
        raise ScenarioError("--repeat must be >= 1")
    if args.prestart < 0:
        raise ScenarioError("--prestart must be >= 0")
    if args.serve_cmd is not None:
        check_serve_cmd(args.serve_cmd)
    if args.prestart and args.port:
        raise ScenarioError("--prestart runs several servers at once: it needs a free port per arm (drop --port)")
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
        scenarios.append(replace(scenario, server=server))
    if len({s.name for s in scenarios}) != len(scenarios):
        raise ScenarioError("--scenario names a scenario twice")
    return scenarios, policies


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


@dataclass
class _Arm:
    """One server + scenario run: what it is, and (once launched) its server."""

    scenario: Scenario
    out: Path
    repetition: int
    policy: str
    run_id: str
    server: ServerProcess | None = None
    argv: list[str] = field(default_factory=list)
    url: str = ""


def _plan_arms(scenarios: list[Scenario], policies: list[str], repeat: int, out: Path,
               stamp: str) -> list[_Arm]:
    """Every arm in run order: scenario by scenario, repetitions alternating the policy order (ABBA...)."""
    arms = []
    for sc in scenarios:
        sc_out = out if len(scenarios) == 1 else out / sc.name
        for rep, policy in _arm_order(policies, repeat):
            arms.append(_Arm(sc, sc_out, rep + 1, policy, f"{sc.name}-{policy}-r{rep + 1}-{stamp}"))
    return arms


def run_arms(args: argparse.Namespace, scenarios: list[Scenario], policies: list[str], out: Path) -> list[Path]:
    """Run every arm against one collector; write each scenario's ``plan.json`` and runs. Returns the scenario
    output directories."""
    from kvfabric.collector import CollectorConfig, CollectorProcess  # (FastAPI, DuckDB: not for --help)

    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    arms = _plan_arms(scenarios, policies, args.repeat, out, stamp)
    sc_outs = list(dict.fromkeys(a.out for a in arms))
    for d in sc_outs:
        if (d / "plan.json").exists() or (d / "runs").exists():
            raise ScenarioError(f"{d} already holds an A/B run: choose a new --out (or --report-only)")
        (d / "runs").mkdir(parents=True, exist_ok=True)
        (d / "logs").mkdir(parents=True, exist_ok=True)
    db = out / "collector.duckdb"
    if db.exists():
        raise ScenarioError(f"{out} already holds a collector.duckdb: choose a new --out (or --report-only)")
    sock_dir = tempfile.mkdtemp(prefix="kvf-ab-", dir="/tmp")  # sun_path is 108 bytes: keep the socket short
    sock = os.path.join(sock_dir, "c.sock")
    collector = CollectorProcess(
        # A hook's forwarder connects when its engine starts but sends its schema only with the first events; servers
        # wait idle (--prestart) longer than the default 10 s handshake, which would drop and count a first batch.
        CollectorConfig(db_path=str(db), socket_path=sock, port=_free_port(), handshake_timeout_s=IDLE_HANDSHAKE_S),
        log_path=str(out / "collector.log"), ready_timeout=60.0,
    )
    plans: dict[str, dict[str, Any]] = {
        sc.name: {
            "scenario": sc.as_dict(), "policies": policies, "repeat": args.repeat, "seed": sc.seed,
            "server": "sim-serve" if args.serve_cmd is None else "serve-cmd", "serve_cmd": args.serve_cmd,
            "prestart": args.prestart, "machine": _machine(),
            "started_at": datetime.now().isoformat(timespec="seconds"),
            "command": "kvfabric " + " ".join(sys.argv[1:]) if sys.argv else "", "arms": [],
        }
        for sc in scenarios
    }

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
    collector.start()
    try:
        launch(arms[0])
        for n, arm in enumerate(arms, 1):
            sc = arm.scenario
            server = arm.server
            assert server is not None
            t_arm = time.monotonic()
            _say(f"[{n}/{len(arms)}] {sc.name}: {arm.policy} (repetition {arm.repetition}): waiting for the server")
            try:
                server.wait_ready()
                # Servers started ahead (--prestart) start up while this arm runs; the first arm's starts alone.
                for a in arms[n : n + args.prestart]:
                    if a.server is None:
                        launch(a)
                ahead = [a for a in arms[n : n + args.prestart] if a.server is not None]
                _say(f"      ready in {server.ready_s:.1f} s; running {sc.name} (seed {sc.seed})"
                     + (f"; the next {len(ahead)} server(s) start meanwhile" if ahead else ""))
                bench = asyncio.run(_bench(sc, arm.url, arm.run_id, not args.no_progress, f"      {arm.policy}"))
                events = wait_quiescent(collector.http_url or "", arm.run_id)
                analytics = fetch_run(collector.http_url or "", arm.run_id)
                processes = server.stats()
            finally:
                server.stop()
            if n < len(arms) and arms[n].server is None:
                launch(arms[n])
            (arm.out / "runs" / f"{arm.run_id}.bench.json").write_text(json.dumps(bench) + "\n")
            (arm.out / "runs" / f"{arm.run_id}.collector.json").write_text(json.dumps(analytics) + "\n")
            s, c = bench["summary"], analytics["summary"]
            _say(f"      {s['requests_ok']} requests in {s['wall_s']:.1f} s; hit rate "
                 f"{100 * c['prefix_hit_rate']:.1f} %, rebuilt {c['rebuilt_from_eviction_blocks']:,} blocks, "
                 f"TTFT p50 {1000 * (s['ttft_p50_s'] or 0):.0f} ms; {events:,} events")
            plans[sc.name]["arms"].append({
                "run_id": arm.run_id, "policy": arm.policy, "repetition": arm.repetition,
                "argv": [_portable(a) for a in arm.argv],
                "ready_s": server.ready_s, "arm_s": time.monotonic() - t_arm, "events": events,
                "servers_starting_during_run": len(ahead),
                "processes": [{**p, "cmdline": _portable(str(p["cmdline"]))} for p in processes],
            })
            # Written after every arm: if the whole run is cut short (a time limit), --report-only still reports
            # the arms that finished (without the DuckDB-derived series, which are added at the end).
            plans[sc.name]["wall_s"] = time.monotonic() - t_start
            (arm.out / "plan.json").write_text(json.dumps(plans[sc.name], indent=1) + "\n")
    finally:
        for a in arms:
            if a.server is not None and a.server.proc is not None and a.server.proc.poll() is None:
                a.server.stop(timeout=10.0)
        collector.stop()
        shutil.rmtree(sock_dir, ignore_errors=True)
    series = read_events(str(db), [a.run_id for a in arms])
    for a in arms:
        path = a.out / "runs" / f"{a.run_id}.collector.json"
        data = json.loads(path.read_text())
        data["events"] = series.get(a.run_id, {})
        path.write_text(json.dumps(data) + "\n")
    wall = time.monotonic() - t_start
    for sc, d in zip(scenarios, sc_outs, strict=True):
        plans[sc.name]["wall_s"] = wall
        plans[sc.name]["collector_db"] = os.path.relpath(db, d)
        (d / "plan.json").write_text(json.dumps(plans[sc.name], indent=1) + "\n")
    return sc_outs


def run(args: argparse.Namespace) -> int:
    try:
        if args.report_only:
            if not args.out or not Path(args.out).is_dir():
                raise ScenarioError("--report-only needs --out DIR of a finished kvfabric ab run")
            out = Path(args.out)
            outs = [out] if (out / "plan.json").is_file() else sorted(p.parent for p in out.glob("*/plan.json"))
            if not outs:
                raise ScenarioError(f"--report-only: no plan.json in {out} (nor in its subdirectories)")
        else:
            scenarios, policies = _validate(args)
            names = "+".join(s.name for s in scenarios)
            out = Path(args.out or f"ab-{names}-{datetime.now().strftime('%Y%m%d-%H%M%S')}")
            _say(f"kvfabric ab: {', '.join(s.name for s in scenarios)}; policies {', '.join(policies)}; "
                 f"{args.repeat} repetition(s); output in {out}/")
            outs = run_arms(args, scenarios, policies, out)
    except (ScenarioError, ServerSpecError) as exc:
        raise UsageError(str(exc)) from None
    except (RuntimeError, TimeoutError, OSError) as exc:
        print(f"kvfabric ab: {exc}", file=sys.stderr)
        return 1
    lines = {}
    for d in outs:
        result = build(d)
        write_report(d, result)
        _say(f"\n== {result['plan']['scenario']['name']}")
        print_table(result)
        _say(f"report: {d / 'report.md'}")
        lines[result["plan"]["scenario"]["name"]] = json_line(result)
    if args.format == "json":
        print(json.dumps(next(iter(lines.values())) if len(lines) == 1 else {"scenarios": lines}))
    return 0
