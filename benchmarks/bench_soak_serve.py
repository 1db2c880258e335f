#!/usr/bin/env python3
"""Soak: a long ``kvfabric bench --duration`` against ``kvfabric sim-serve`` with the hook streaming to a collector;
memory (RSS) and open file descriptors of every process involved must stay flat.

Processes sampled every ``--interval`` seconds from /proc: the server (vLLM's API server), the EngineCore (where
the engine runs: the Scheduler, the recorder), the hook's forwarder child, and the collector. The
traffic mixes every session shape that holds state somewhere (hot/cold prefixes, long conversations, forks), with
the KV pool under pressure so blocks are evicted and rebuilt all the time, and the policy steering.

Flat means: after a warm-up (``--warmup`` seconds of traffic after the server is ready: pools, caches and buffers
reach their working size), the RSS of every process grows by less than 5 % + 16 MiB from the first to the last fifth
of the samples (medians), and its median count of open file descriptors by at most 4 (connections come and go with
the traffic). The results file states each number and the verdict.

    python benchmarks/bench_soak_serve.py                      # 10 minutes; writes benchmarks/results/soak_serve.*
    python benchmarks/bench_soak_serve.py --duration 60 --out /tmp/soak   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvfabric.bench.ab import IDLE_HANDSHAKE_S  # noqa: E402
from kvfabric.bench.analytics import fetch_run, wait_quiescent  # noqa: E402
from kvfabric.bench.servers import ServerProcess, process_stats, process_tree  # noqa: E402
from kvfabric.collector import CollectorConfig, CollectorProcess  # noqa: E402

SCENARIO = """
name = "soak"
description = "Every session shape that holds state, unbounded, for a soak."
shows = "Flat memory and file descriptors."
seed = 1

[[traffic]]
name = "hot_cold"
mode = "pressure"
concurrency = 3
[traffic.params]
hot_families = 12
hot_share = 0.5
hot_prefix_tokens = [512, 1536]
cold_tokens = [512, 2048]
max_tokens = [8, 32]

[[traffic]]
name = "conversations"
mode = "continuous"
concurrency = 2
[traffic.params]
first_tokens = [256, 1024]
turns = [3, 8]
user_tokens = [32, 192]
max_tokens = [16, 64]

[[traffic]]
name = "forks"
mode = "multi_turn_fork"
concurrency = 1
[traffic.params]
max_tokens = [8, 32]
"""

ROLES = ("server", "engine_core", "forwarder", "collector")
MiB = 1024 * 1024


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _roles(server_pid: int, collector_pid: int) -> dict[str, int]:
    found = {"server": server_pid, "collector": collector_pid}
    for pid in process_tree(server_pid)[1:]:
        st = process_stats(pid)
        if st is None:
            continue
        if "kvfabric.forwarder" in str(st["cmdline"]):
            found["forwarder"] = pid
        elif "EngineCor" in str(st["comm"]) and "engine_core" not in found:
            found["engine_core"] = pid
    if "engine_core" not in found and "forwarder" in found:
        # Without setproctitle the EngineCore keeps the server's name; it is the process that started the hook's
        # forwarder (its parent).
        try:
            with open(f"/proc/{found['forwarder']}/stat") as f:
                found["engine_core"] = int(f.read().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            pass
    return found


class Sampler(threading.Thread):
    """Samples RSS, fds and CPU of the four processes every ``interval`` seconds (roles re-resolved each time)."""

    def __init__(self, server_pid: int, collector_pid: int, interval: float) -> None:
        super().__init__(daemon=True)
        self.server_pid, self.collector_pid, self.interval = server_pid, collector_pid, interval
        self.samples: list[dict[str, Any]] = []
        self.t0 = time.monotonic()
        self._halt = threading.Event()

    def sample(self) -> None:
        row: dict[str, Any] = {"t_s": round(time.monotonic() - self.t0, 1)}
        for role, pid in _roles(self.server_pid, self.collector_pid).items():
            st = process_stats(pid)
            if st is not None:
                row[role] = {"pid": pid, "rss_mib": st["rss_bytes"] / MiB, "fds": st["fds"], "cpu_s": st["cpu_s"]}
        self.samples.append(row)

    def run(self) -> None:
        while not self._halt.wait(self.interval):
            self.sample()

    def stop(self) -> None:
        self._halt.set()
        self.join()
        self.sample()


def analyse(samples: list[dict[str, Any]], warmup_s: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for role in ROLES:
        pts = [(s["t_s"], s[role]) for s in samples if role in s]
        warm = [(t, v) for t, v in pts if t >= warmup_s]
        if len(warm) < 5:
            out[role] = {"samples": len(pts), "flat": None}
            continue
        k = max(1, len(warm) // 5)
        first = statistics.median(v["rss_mib"] for _, v in warm[:k])
        last = statistics.median(v["rss_mib"] for _, v in warm[-k:])
        ts = [t for t, _ in warm]
        rs = [v["rss_mib"] for _, v in warm]
        tm, rm = statistics.fmean(ts), statistics.fmean(rs)
        den = sum((t - tm) ** 2 for t in ts)
        slope = sum((t - tm) * (r - rm) for t, r in zip(ts, rs, strict=True)) / den * 60 if den else 0.0
        fds = [v["fds"] for _, v in warm]
        # Open connections come and go with the traffic: compare typical counts at both ends, not the extremes.
        fds_growth = statistics.median(fds[-k:]) - statistics.median(fds[:k])
        growth = last - first
        flat = growth <= 0.05 * first + 16 and fds_growth <= 4
        out[role] = {
            "pid": warm[-1][1]["pid"], "samples": len(pts), "rss_start_mib": pts[0][1]["rss_mib"],
            "rss_first_fifth_mib": first, "rss_last_fifth_mib": last, "rss_growth_mib": growth,
            "rss_max_mib": max(rs), "rss_slope_mib_per_min": slope, "fds_min": min(fds), "fds_max": max(fds),
            "fds_growth": fds_growth,
            "cpu_s": warm[-1][1]["cpu_s"], "flat": flat,
        }
    out["all_flat"] = all(out[r].get("flat") for r in ROLES)
    return out


def plot(samples: list[dict[str, Any]], path: Path, warmup_s: float) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7.5, 5.5), sharex=True)
    for role in ROLES:
        pts = [(s["t_s"] / 60, s[role]) for s in samples if role in s]
        if pts:
            ax1.plot([t for t, _ in pts], [v["rss_mib"] for _, v in pts], label=role)
            ax2.plot([t for t, _ in pts], [v["fds"] for _, v in pts], label=role)
    for ax in (ax1, ax2):
        ax.axvline(warmup_s / 60, color="gray", linestyle=":", linewidth=1)
        ax.grid(True, alpha=0.3)
    ax1.set_ylabel("RSS (MiB)")
    ax1.set_yscale("log")
    ax2.set_ylabel("open file descriptors")
    ax2.set_xlabel("minutes since the server started (dotted: end of warm-up)")
    ax1.legend(fontsize=8, loc="center right")
    ax1.set_title("Soak: kvfabric sim-serve + hook + forwarder + collector")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_markdown(path: Path, res: dict[str, Any], png: str | None) -> None:
    a, b, c = res["analysis"], res["bench"], res["collector"]
    w = [
        "# Soak: flat memory and file descriptors under `kvfabric bench --duration`",
        "",
        f"Written by `{res['command']}` on {res['date']}. Machine: {res['machine']}.",
        "",
        f"Setup: `kvfabric sim-serve --kv-blocks {res['kv_blocks']} --policy {res['policy']} --collector-socket ... "
        f"--run-id {res['run_id']}` (vLLM {res['vllm']}'s real OpenAI server, engine, scheduler; forward pass "
        "modelled at H200 speed for the Llama-3-8B shape); the hook records every block event and streams it through "
        "its forwarder to a `kvfabric collector`; the client is "
        f"`kvfabric bench --scenario <soak traffic> --duration {res['duration_s']:g}` "
        "(hot/cold prefixes, long conversations, forks; KV pool under pressure). Sampled every "
        f"{res['interval_s']:g} s; the verdict uses the samples after the warm-up ({res['warmup_s']:g} s of traffic, "
        f"until {res['warmup_end_s'] / 60:.1f} min).",
        "",
        f"Traffic: {b['requests_ok']:,} requests ok, {b['requests_failed']:,} failed in {b['wall_s']:.0f} s "
        f"({b['requests_per_s']:.1f} req/s); TTFT p50 {1000 * (b['ttft_p50_s'] or 0):.0f} ms. Collector: "
        f"{c['events']:,} events stored for the run, {c['evicted_blocks']:,} evictions, "
        f"{c['rebuilt_from_eviction_blocks']:,} rebuilt blocks, {c['sink_dropped_events']:,} events dropped, "
        f"{c['sequence_gaps']:,} sequence gaps.",
        "",
        "| process | RSS at start | RSS first fifth after warm-up | last fifth | growth | slope | open fds (range) | "
        "fds growth | CPU s | flat |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for role in ROLES:
        r = a[role]
        if r.get("flat") is None:
            w.append(f"| {role} | - | - | - | - | - | - | - | - | not sampled |")
            continue
        w.append(f"| {role} | {r['rss_start_mib']:.0f} MiB | {r['rss_first_fifth_mib']:.0f} MiB | "
                 f"{r['rss_last_fifth_mib']:.0f} MiB | {r['rss_growth_mib']:+.1f} MiB | "
                 f"{r['rss_slope_mib_per_min']:+.2f} MiB/min | {r['fds_min']}-{r['fds_max']} | {r['fds_growth']:+g} | "
                 f"{r['cpu_s']:.0f} | "
                 f"{'yes' if r['flat'] else '**no**'} |")
    w += [
        "",
        "Flat = RSS growth from the first to the last fifth of the post-warm-up samples (medians) below 5 % + 16 MiB, "
        "and the median count of open file descriptors grown by at most 4 between the same fifths. "
        f"**Verdict: {'flat' if a['all_flat'] else 'NOT flat'}.**",
        "",
    ]
    if png:
        w += [f"![RSS and file descriptors over time]({png})", ""]
    w += ["Samples (one a minute):", "", "| minute | " + " | ".join(f"{r} RSS / fds" for r in ROLES) + " |",
          "|---|" + "---|" * len(ROLES)]
    last_min = -1
    for s in res["samples"]:
        minute = int(s["t_s"] // 60)
        if minute == last_min:
            continue
        last_min = minute
        cells = [f"{s[r]['rss_mib']:.0f} MiB / {s[r]['fds']}" if r in s else "-" for r in ROLES]
        w.append(f"| {s['t_s'] / 60:.1f} | " + " | ".join(cells) + " |")
    path.write_text("\n".join(w) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=600.0, help="bench duration in seconds (default 600)")
    ap.add_argument("--interval", type=float, default=10.0, help="sampling interval in seconds")
    ap.add_argument("--warmup", type=float, default=120.0, help="seconds of the run excluded from the verdict")
    ap.add_argument("--policy", default="adaptive_aging")
    ap.add_argument("--kv-blocks", type=int, default=1024)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"),
                    help="directory for soak_serve.{md,json,png}")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kvf-soak-", dir="/tmp"))
    run_id = "soak"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFABRIC_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    collector = CollectorProcess(
        CollectorConfig(db_path=str(work / "soak.duckdb"), socket_path=str(work / "c.sock"), port=_free_port(),
                        handshake_timeout_s=IDLE_HANDSHAKE_S),
        log_path=str(work / "collector.log"), env=env, ready_timeout=60.0,
    )
    port = _free_port()
    server = ServerProcess(
        [sys.executable, "-m", "kvfabric.cli", "sim-serve", "--kv-blocks", str(args.kv_blocks), "--max-model-len",
         "8192", "--policy", args.policy, "--collector-socket", str(work / "c.sock"), "--run-id", run_id,
         "--port", str(port)],
        url=f"http://127.0.0.1:{port}", env=env, log_path=str(work / "server.log"), ready_timeout=300.0,
    )
    scenario = work / "soak.toml"
    scenario.write_text(SCENARIO)
    t_start = time.monotonic()
    try:
        collector.start()
        assert collector.proc is not None
        server.launch()
        sampler = Sampler(server.pid or 0, collector.proc.pid, args.interval)
        sampler.start()
        server.wait_ready()
        print(f"server ready in {server.ready_s:.0f} s; soaking for {args.duration:g} s", flush=True)
        bench_out = work / "bench.json"
        subprocess.run(
            [sys.executable, "-m", "kvfabric.cli", "bench", "--scenario", str(scenario), "--endpoint", server.url,
             "--duration", str(args.duration), "--run-id", run_id, "--out", str(bench_out), "--no-progress"],
            env=env, check=True, timeout=args.duration + 600,
        )
        wait_quiescent(collector.http_url or "", run_id, timeout=120)
        sampler.stop()
        ready_at = sampler.samples and next((s["t_s"] for s in sampler.samples if "engine_core" in s), 0.0)
        coll = fetch_run(collector.http_url or "", run_id, timeout=600)["summary"]  # millions of events
        bench = json.loads(bench_out.read_text())["summary"]
    finally:
        server.stop()
        if collector.proc is not None:
            collector.stop()
    from importlib.metadata import version

    warmup_end = float(ready_at or 0.0) + args.warmup
    analysis = analyse(sampler.samples, warmup_end)
    res = {
        "command": "python benchmarks/bench_soak_serve.py " + " ".join(sys.argv[1:]),
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.node()}, {platform.machine()}, {os.cpu_count()} cores, Python "
                   f"{platform.python_version()}",
        "vllm": version("vllm"), "policy": args.policy, "kv_blocks": args.kv_blocks,
        "run_id": run_id, "duration_s": args.duration, "interval_s": args.interval, "warmup_s": args.warmup,
        "warmup_end_s": warmup_end,
        "wall_s": time.monotonic() - t_start, "bench": bench,
        "collector": {k: coll[k] for k in ("events", "evicted_blocks", "rebuilt_from_eviction_blocks",
                                           "sink_dropped_events", "sequence_gaps", "prefix_hit_rate")},
        "analysis": analysis, "samples": sampler.samples,
    }
    (out / "soak_serve.json").write_text(json.dumps(res, indent=1) + "\n")
    png = "soak_serve.png" if plot(sampler.samples, out / "soak_serve.png", warmup_end) else None
    write_markdown(out / "soak_serve.md", res, png)
    shutil.rmtree(work, ignore_errors=True)
    print(f"{'flat' if analysis['all_flat'] else 'NOT flat'}; results in {out}/soak_serve.md")
    return 0 if analysis["all_flat"] else 1


if __name__ == "__main__":
    sys.exit(main())
