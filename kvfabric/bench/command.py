"""``kvfabric bench``: the long-conversation pressure benchmark against any OpenAI-compatible server.

Runs one mode (``--mode``) or a scenario file (``--scenario``) against ``--endpoint``'s ``/v1/completions``,
streaming, and reports TTFT, TPOT, E2E latency, requests/s and the cached prompt tokens the server reported per
request. ``--out`` keeps every request's numbers as JSON; ``--format json`` prints the summary as the last line.
Seeded: the same seed sends the same prompts (a next turn holds the previous prompt plus the answer the server
actually returned). ``--run-id`` records the server's ``KVFABRIC_RUN_ID`` so results and the collector's
analytics can be joined. Exit status 2 with one line for bad options or an unreachable server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import textwrap
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvfabric.argtypes import nonneg_float, positive_float, positive_int
from kvfabric.bench.modes import MODES, ModeError, describe
from kvfabric.bench.prompts import FORMATS
from kvfabric.bench.scenario import Scenario, ScenarioError, bundled_scenarios, load_scenario, single_mode_scenario
from kvfabric.usage import UsageError

__all__ = ["configure", "parse_params", "run"]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.epilog = (
        "modes (--param KEY=VALUE sets a parameter; each shown with its default):\n"
        + "".join(f"  {name:<17} {m.summary}\n{_wrapped(describe(m.params))}" for name, m in MODES.items())
        + "bundled scenarios: " + ", ".join(bundled_scenarios()) + "\n\n"
        "examples:\n"
        "  kvfabric bench --endpoint http://127.0.0.1:8000 --mode continuous --requests 200 --concurrency 8\n"
        "  kvfabric bench --endpoint http://127.0.0.1:8000 --mode dataset "
        "--param path=../shared/traces/mooncake_synthetic_trace.jsonl --param limit=300\n"
        "  kvfabric bench --endpoint http://127.0.0.1:8000 --scenario template_family_revisit --out r.json\n"
        "  kvfabric bench --endpoint http://127.0.0.1:8000 --mode pressure --duration 600   # soak\n"
    )
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--mode", choices=list(MODES), help="one traffic mode (parameters: --param)")
    what.add_argument("--scenario", help="a scenario: bundled name or TOML file (kvfabric/bench/scenario.py)")
    parser.add_argument("--endpoint", default="http://127.0.0.1:8000", help="server base URL (default: %(default)s)")
    parser.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    parser.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                        help="a mode parameter (with --mode); VALUE is JSON, e.g. turns=[2,5] hot_share=0.3")
    parser.add_argument("--sessions", type=positive_int, default=None, help="sessions to run (with --mode)")
    parser.add_argument("--requests", type=positive_int, default=None,
                        help="stop issuing after this many requests (with --mode: default 200 unless --sessions "
                             "or --duration bound the run)")
    parser.add_argument("--duration", type=positive_float, default=None, help="stop issuing after this many seconds")
    parser.add_argument("--concurrency", type=positive_int, default=None,
                        help="sessions in flight at once (with --mode: default 8; with --scenario: overrides every "
                             "component's)")
    parser.add_argument("--rate", type=positive_float, default=None,
                        help="Poisson session arrivals per second (open loop; default: closed loop)")
    parser.add_argument("--seed", type=int, default=None, help="workload seed (default: the scenario's, else 0)")
    parser.add_argument("--prompt-format", choices=FORMATS, default=None,
                        help="tokens: token-id prompts (servers without a tokenizer); text: text prompts (default: "
                             "the scenario's, else tokens, or text with --no-vllm-extensions)")
    parser.add_argument("--no-hints", action="store_true", help="do not send KVFabric's request hints (vllm_xargs)")
    parser.add_argument("--no-vllm-extensions", action="store_true",
                        help="plain OpenAI requests: no ignore_eos, return_token_ids, vllm_xargs (text prompts)")
    parser.add_argument("--run-id", default=None,
                        help="the server's KVFABRIC_RUN_ID (recorded in the results; names the request ids)")
    parser.add_argument("--wait-ready", type=nonneg_float, default=0.0,
                        help="seconds to wait for the server to answer /v1/models (default 0: it must be up)")
    parser.add_argument("--timeout", type=positive_float, default=600.0, help="per-request timeout in seconds")
    parser.add_argument("--out", default=None, help="write the full results (every request) to this JSON file")
    parser.add_argument("--format", choices=("text", "json"), default="text",
                        help="json: print the summary as one JSON object on the last line (default: %(default)s)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (it is drawn on stderr)")


def parse_params(items: list[str]) -> dict[str, Any]:
    """``["k=v", ...]`` -> dict, values parsed as JSON when they are JSON, else kept as strings."""
    params: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ModeError(f"--param wants KEY=VALUE, not {item!r}")
        try:
            params[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            params[key.strip()] = value
    return params


def build_scenario(args: argparse.Namespace) -> Scenario:
    """The scenario the options describe (raises ScenarioError/ModeError)."""
    if args.mode is not None:
        requests = args.requests
        if requests is None and args.sessions is None and args.duration is None:
            requests = 200
        scenario = single_mode_scenario(
            args.mode, parse_params(args.param), sessions=args.sessions, requests=requests,
            concurrency=args.concurrency or 8, rate=args.rate, seed=args.seed or 0,
            prompt_format=args.prompt_format or ("text" if args.no_vllm_extensions else "tokens"),
            hints=not args.no_hints,
        )
        return scenario
    if args.param or args.sessions is not None:
        raise ScenarioError("--param and --sessions go with --mode (a scenario file sets its own)")
    scenario = load_scenario(args.scenario)
    return override(scenario, seed=args.seed, concurrency=args.concurrency, rate=args.rate,
                    prompt_format=args.prompt_format or ("text" if args.no_vllm_extensions else None),
                    hints=False if args.no_hints else None)


def override(scenario: Scenario, *, seed: int | None = None, concurrency: int | None = None,
             rate: float | None = None, prompt_format: str | None = None, hints: bool | None = None) -> Scenario:
    """A copy of ``scenario`` with the given settings replaced (None keeps the scenario's)."""

    traffic = tuple(
        replace(t, concurrency=concurrency or t.concurrency, rate=rate if rate is not None else t.rate)
        for t in scenario.traffic
    )
    return replace(
        scenario,
        traffic=traffic,
        seed=scenario.seed if seed is None else seed,
        prompt_format=prompt_format or scenario.prompt_format,
        hints=scenario.hints if hints is None else hints,
    )


async def wait_ready(endpoint: str, wait_s: float) -> str:
    """Poll ``/v1/models`` until it answers (at most ``wait_s``); return the first model id."""
    # httpx: only when a server is polled, not for `kvfabric bench --help`
    import httpx

    from kvfabric.bench.client import discover_model  # (httpx: not for `kvfabric bench --help`)

    deadline = time.monotonic() + wait_s
    while True:
        try:
            return await discover_model(endpoint)
        except (httpx.HTTPError, OSError, RuntimeError, KeyError, ValueError) as exc:
            if time.monotonic() >= deadline:
                raise ConnectionError(f"no OpenAI-compatible server at {endpoint} ({exc or type(exc).__name__})") \
                    from None
            await asyncio.sleep(0.5)


def print_summary(s: dict[str, Any], *, title: str) -> None:
    def ms(x: float | None) -> str:
        return "-" if x is None else f"{1000 * x:.1f} ms"

    rate = s.get("client_hit_rate")
    lines = [
        title,
        f"  requests        {s['requests_ok']:,} ok, {s['requests_failed']:,} failed in {s['wall_s']:.1f} s "
        f"({(s['requests_per_s'] or 0):.2f} req/s, {(s['output_tokens_per_s'] or 0):.0f} output tok/s)",
        f"  TTFT            p50 {ms(s['ttft_p50_s'])}  p90 {ms(s['ttft_p90_s'])}  p99 {ms(s['ttft_p99_s'])}",
        f"  TPOT            p50 {ms(s['tpot_p50_s'])}  p99 {ms(s['tpot_p99_s'])}",
        f"  E2E             p50 {ms(s['e2e_p50_s'])}  p99 {ms(s['e2e_p99_s'])}",
        f"  cached tokens   {s['cached_tokens']:,} of {s['prompt_tokens']:,} prompt tokens"
        + (f" ({100 * rate:.1f} %)" if rate is not None else " (the server did not report them)"),
    ]
    if s.get("errors"):
        lines.append("  errors          " + "; ".join(s["errors"]))
    print("\n".join(lines), flush=True)


async def _main(args: argparse.Namespace, scenario: Scenario) -> dict[str, Any]:
    # (the client loads httpx: only when a benchmark runs, so `kvfabric bench --help` stays fast)
    from kvfabric.bench.client import CompletionClient
    from kvfabric.bench.runner import run_scenario

    model = args.model or await wait_ready(args.endpoint, args.wait_ready)
    if args.model and args.wait_ready:
        await wait_ready(args.endpoint, args.wait_ready)
    client = CompletionClient(
        args.endpoint, model, token_prompts=scenario.prompt_format == "tokens",
        vllm_extensions=not args.no_vllm_extensions, timeout_s=args.timeout,
        max_connections=max(16, 2 * sum(t.concurrency for t in scenario.traffic)),
    )
    try:
        result = await run_scenario(
            scenario, client, run_id=args.run_id, endpoint=args.endpoint, duration_s=args.duration,
            max_requests=args.requests if args.scenario else None, progress=not args.no_progress,
        )
    finally:
        await client.aclose()
    return result.as_dict()


def _wrapped(text: str, indent: str = " " * 21, width: int = 100) -> str:
    return textwrap.fill(text, width=width, initial_indent=indent, subsequent_indent=indent,
                         break_on_hyphens=False) + "\n"


def _check_out(path: str) -> None:
    """Refuse an --out that cannot be written before the run, not after it (its results would be lost)."""
    parent = Path(path).parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--out {path}: cannot create {exc.filename or parent} ({exc.strerror})") from None
    if Path(path).is_dir():
        raise UsageError(f"--out {path} is a directory; it names the JSON file to write")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"--out {path}: cannot write in {parent} (permission denied)")


def run(args: argparse.Namespace) -> int:
    if args.no_vllm_extensions and args.prompt_format == "tokens":
        raise UsageError("token prompts need vLLM's return_token_ids: drop --no-vllm-extensions or use "
                         "--prompt-format text")
    if args.out:
        _check_out(args.out)
    try:
        scenario = build_scenario(args)
    except (ScenarioError, ModeError) as exc:
        raise UsageError(str(exc)) from None
    try:
        results = asyncio.run(_main(args, scenario))
    except ConnectionError as exc:
        raise UsageError(f"--endpoint: {exc}") from None
    summary = results["summary"]
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print_summary(summary, title=f"kvfabric bench: {scenario.name} against {args.endpoint} ({results['model']})"
                  + (f", run {args.run_id}" if args.run_id else ""))
    if args.out:
        print(f"  results         {args.out}")
    if args.format == "json":
        print(json.dumps({"run_id": args.run_id, "scenario": scenario.name, "stopped_by": results["stopped_by"],
                          **summary}))
    return 0 if summary["requests_ok"] > 0 else 1
