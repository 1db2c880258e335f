"""``kvfabric ab``: one scenario, several eviction policies, fresh servers, one report.

For each repetition and policy (the order alternates between repetitions, so slow drift of a shared machine
spreads over every arm) it starts a fresh server with the policy (``kvfabric sim-serve`` by default, any
``--serve-cmd`` otherwise), streaming to one collector process (``kvfabric collector``) under its own run id, runs
the scenario with the same seed through :mod:`kvfabric.bench.runner`, waits until the collector holds every event
of the run, reads the collector's analytics (REST), and stops the server. At the end the collector stops and the
report (Markdown + PNG plots + ``ab.json``) joins the collector's analytics with the client's latencies; the rule
for calling a difference is :func:`kvfabric.bench.report.verdict`. ``--format json`` prints, as the last line, per
policy the medians and spreads of the headline metrics.

Everything lands in ``--out``: ``report.md``, ``plots/``, ``ab.json``, ``runs/`` (per run: client results and
collector analytics), ``logs/`` and the collector's ``collector.duckdb``. ``--report-only`` re-renders the report of
an existing ``--out`` without running anything.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from kvfabric.bench.scenario import Scenario, ScenarioError, bundled_scenarios, load_scenario
from kvfabric.bench.servers import (
    PLACEHOLDERS,
    ArmSettings,
    ServerProcess,
    ServerSpecError,
    check_serve_cmd,
    serve_command,
)

__all__ = ["configure", "run"]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
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
    parser.add_argument("--scenario", help="bundled scenario name or TOML file")
    parser.add_argument("--policies", default="lru,adaptive_aging",
                        help="comma-separated policies; the first is the baseline (default %(default)s)")
    parser.add_argument("--repeat", type=int, default=3, help="repetitions per policy (default 3)")
    parser.add_argument("--out", default=None, help="output directory (default ab-<scenario>-<time>)")
    parser.add_argument("--format", choices=("text", "json"), default="text",
                        help="json: print per-policy medians and spreads as one JSON object on the last line")
    parser.add_argument("--serve-cmd", default=None,
                        help="start each arm's server with this command instead of kvfabric sim-serve")
    parser.add_argument("--seed", type=int, default=None, help="override the scenario's seed")
    parser.add_argument("--kv-blocks", type=int, default=None, help="override the scenario's KV capacity (blocks)")
    parser.add_argument("--latency-scale", type=float, default=None,
                        help="override the scenario's sim-serve latency scale")
    parser.add_argument("--port", type=int, default=0, help="server port (default: a free one per arm)")
    parser.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for each server")
    parser.add_argument("--overlap-start", action="store_true",
                        help="start the next arm's server while the current arm runs (hides start-up time where "
                             "it is scarce, e.g. a GPU; the start-up then competes with the running arm)")
    parser.add_argument("--report-only", action="store_true", help="re-render the report of an existing --out")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _say(msg: str) -> None:
    print(msg, flush=True)


def _machine() -> str:
    return f"{platform.node()}, {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"


def _arm_order(policies: list[str], repeat: int) -> list[tuple[int, str]]:
    """(repetition, policy) in run order: forwards on even repetitions, backwards on odd ones (ABBA...)."""
    order = []
    for r in range(repeat):
        for p in (policies if r % 2 == 0 else list(reversed(policies))):
            order.append((r, p))
    return order


def _validate(args: argparse.Namespace) -> tuple[Scenario, list[str]]:
    from dataclasses import replace

    from kvfabric.policies import POLICY_NAMES

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
    if args.serve_cmd is not None:
        check_serve_cmd(args.serve_cmd)
    if args.overlap_start and args.port:
        raise ScenarioError("--overlap-start runs two servers at once: it needs a free port per arm (drop --port)")
    scenario = load_scenario(args.scenario)
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
    return replace(scenario, server=server), policies


async def _bench(scenario: Scenario, url: str, run_id: str, progress: bool, desc: str) -> dict[str, Any]:
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


def run_arms(args: argparse.Namespace, scenario: Scenario, policies: list[str], out: Path) -> dict[str, Any]:
    """Run every arm; returns the plan (what ran, in which order, how long each took)."""
    from kvfabric.bench.analytics import fetch_run, read_events, wait_quiescent
    from kvfabric.collector import CollectorConfig, CollectorProcess

    (out / "runs").mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    db = out / "collector.duckdb"
    if db.exists():
        raise ScenarioError(f"{out} already holds a collector.duckdb: choose a new --out (or --report-only)")
    sock_dir = tempfile.mkdtemp(prefix="kvf-ab-", dir="/tmp")  # sun_path is 108 bytes: keep the socket short
    sock = os.path.join(sock_dir, "c.sock")
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    collector = CollectorProcess(
        CollectorConfig(db_path=str(db), socket_path=sock, port=_free_port()),
        log_path=str(out / "logs" / "collector.log"), ready_timeout=60.0,
    )
    srv = scenario.server
    plan: dict[str, Any] = {
        "scenario": scenario.as_dict(), "policies": policies, "repeat": args.repeat, "seed": scenario.seed,
        "server": "sim-serve" if args.serve_cmd is None else "serve-cmd", "serve_cmd": args.serve_cmd,
        "overlap_start": bool(args.overlap_start),
        "machine": _machine(), "started_at": datetime.now().isoformat(timespec="seconds"),
        "command": "kvfabric " + " ".join(sys.argv[1:]) if sys.argv else "", "arms": [],
    }
    order = _arm_order(policies, args.repeat)
    run_ids = [f"{scenario.name}-{policy}-r{rep + 1}-{stamp}" for rep, policy in order]

    def make_server(i: int) -> tuple[ServerProcess, list[str], str]:
        _rep, policy = order[i]
        port = args.port or _free_port()
        arm = ArmSettings(port=port, policy=policy, run_id=run_ids[i], socket=sock, kv_blocks=srv.kv_blocks,
                          block_size=srv.block_size, max_model_len=srv.max_model_len, model=srv.model,
                          latency_scale=srv.latency_scale)
        argv = serve_command(arm, args.serve_cmd)
        url = f"http://127.0.0.1:{port}"
        server = ServerProcess(argv, url=url, env={**os.environ, **arm.kvfabric_env()},
                               log_path=str(out / "logs" / f"{run_ids[i]}.server.log"),
                               ready_timeout=args.ready_timeout)
        return server, argv, url

    t_start = time.monotonic()
    collector.start()
    upcoming: tuple[ServerProcess, list[str], str] | None = None
    try:
        upcoming = make_server(0)
        upcoming[0].launch()
        for n, (rep, policy) in enumerate(order, 1):
            run_id = run_ids[n - 1]
            server, argv, url = upcoming
            upcoming = None
            t_arm = time.monotonic()
            _say(f"[{n}/{len(order)}] {policy} (repetition {rep + 1}): waiting for the server ...")
            try:
                server.wait_ready()
                overlapped = False
                if args.overlap_start and n < len(order):
                    # Start the next arm's server now: its start-up overlaps this arm's run (see --overlap-start).
                    upcoming = make_server(n)
                    upcoming[0].launch()
                    overlapped = True
                _say(f"      ready in {server.ready_s:.1f} s; running {scenario.name} (seed {scenario.seed})")
                bench = asyncio.run(_bench(scenario, url, run_id, not args.no_progress, f"      {policy}"))
                events = wait_quiescent(collector.http_url or "", run_id)
                analytics = fetch_run(collector.http_url or "", run_id)
                processes = server.stats()
            finally:
                server.stop()
            if upcoming is None and n < len(order):
                upcoming = make_server(n)
                upcoming[0].launch()
            (out / "runs" / f"{run_id}.bench.json").write_text(json.dumps(bench) + "\n")
            (out / "runs" / f"{run_id}.collector.json").write_text(json.dumps(analytics) + "\n")
            s, c = bench["summary"], analytics["summary"]
            _say(f"      {s['requests_ok']} requests in {s['wall_s']:.1f} s; hit rate "
                 f"{100 * c['prefix_hit_rate']:.1f} %, rebuilt {c['rebuilt_from_eviction_blocks']:,} blocks, "
                 f"TTFT p50 {1000 * (s['ttft_p50_s'] or 0):.0f} ms; {events:,} events")
            plan["arms"].append({"run_id": run_id, "policy": policy, "repetition": rep + 1, "argv": argv,
                                 "ready_s": server.ready_s, "arm_s": time.monotonic() - t_arm, "events": events,
                                 "next_server_started_during_run": overlapped, "processes": processes})
    finally:
        if upcoming is not None:
            upcoming[0].stop(timeout=10.0)
        collector.stop()
        shutil.rmtree(sock_dir, ignore_errors=True)
    series = read_events(str(db), [a["run_id"] for a in plan["arms"]])
    for a in plan["arms"]:
        path = out / "runs" / f"{a['run_id']}.collector.json"
        data = json.loads(path.read_text())
        data["events"] = series.get(a["run_id"], {})
        path.write_text(json.dumps(data) + "\n")
    plan["wall_s"] = time.monotonic() - t_start
    (out / "plan.json").write_text(json.dumps(plan, indent=1) + "\n")
    return plan


def run(args: argparse.Namespace) -> int:
    from kvfabric.bench.report import build, json_line, print_table, write_report

    try:
        if args.report_only:
            if not args.out or not (Path(args.out) / "plan.json").is_file():
                raise ScenarioError("--report-only needs --out DIR of a finished kvfabric ab run (with plan.json)")
            out = Path(args.out)
        else:
            scenario, policies = _validate(args)
            out = Path(args.out or f"ab-{scenario.name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}")
            _say(f"kvfabric ab: {scenario.name}, policies {', '.join(policies)}, {args.repeat} repetition(s), "
                 f"{scenario.server.kv_blocks} KV blocks; output in {out}/")
            run_arms(args, scenario, policies, out)
    except (ScenarioError, ServerSpecError) as exc:
        print(f"kvfabric ab: {exc}", file=sys.stderr)
        return 2
    except (RuntimeError, TimeoutError, OSError) as exc:
        print(f"kvfabric ab: {exc}", file=sys.stderr)
        return 1
    result = build(out)
    write_report(out, result)
    print_table(result)
    _say(f"report: {out / 'report.md'}")
    if args.format == "json":
        print(json.dumps(json_line(result)))
    return 0
