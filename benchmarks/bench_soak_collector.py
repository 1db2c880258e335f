"""Soak: steady load into a real collector that is killed (SIGKILL) and restarted on a schedule.

What it shows (docs/reliability.md): over the whole run, every event emitted is stored exactly once or counted as
lost (stored + counted loss == emitted), and neither the collector nor the senders grow in memory or file
descriptors across restarts.

Layout: one collector process (``python -m kvfabric.collector``) and ``--senders`` emitter processes, each the
hook's own :class:`~kvfabric.forwarder.sinks.UnixArrowSink` (protocol 2: acknowledged commits, replay of unacknowledged
batches) fed at ``--rate`` events/s by a thread standing in for vLLM's scheduler. Every ``--restart-every`` the
collector is killed with SIGKILL (no flush) and a new one started on the same database and socket. At the end the
senders close their sinks, the collector stops with SIGTERM, and the database is read back.

Memory and descriptors are sampled from /proc every ``--sample-every`` seconds for the collector and each sender.
"Flat" is judged on values at the same age: the senders over the run (after a warm-up), the collector at the end
of each incarnation (a fresh process every restart).

    python benchmarks/bench_soak_collector.py                              # one hour, restart every 10 min
    python benchmarks/bench_soak_collector.py --minutes 2 --restart-every 30s --out /tmp/soak.md   # quick check
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def parse_duration(text: str) -> float:
    """``90``, ``30s``, ``10m``, ``1h`` -> seconds."""
    t = text.strip().lower()
    for suffix, mult in (("h", 3600.0), ("m", 60.0), ("s", 1.0)):
        if t.endswith(suffix):
            return float(t[: -len(suffix)]) * mult
    return float(t)


def proc_stats(pid: int) -> tuple[int, int] | None:
    """(RSS bytes, open file descriptors) of a live process, None if it is gone."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
        return rss, len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, StopIteration):
        return None


# ------------------------------------------------------------------------------------------------- emitter


def run_emitter(args: argparse.Namespace) -> int:
    """One sender process: the hook's UnixArrowSink fed at a steady rate; prints its accounting as JSON."""
    from kvfabric.contract import schema as S
    from kvfabric.forwarder.buffer import EventBuffer
    from kvfabric.forwarder.sinks import UnixArrowSink

    run_id, engine = args.run, args.engine
    idx = {name: S.EMIT_COLUMNS.index(name) for name in ("ts_ns", "event", "engine", "run_id", "block_id", "count",
                                                          "request_id", "family", "policy", "step")}
    width = len(S.EMIT_COLUMNS)

    def row(i: int) -> tuple:
        values: list[object] = [None] * width
        values[idx["ts_ns"]] = time.time_ns()
        values[idx["event"]] = S.BLOCK_TOUCHED if i % 3 else S.BLOCK_ALLOCATED
        values[idx["engine"]] = engine
        values[idx["run_id"]] = run_id
        values[idx["block_id"]] = i  # unique per event: duplicates in storage would show
        values[idx["request_id"]] = f"req-{i // 64}"
        values[idx["family"]] = f"{(i // 4096) % 97:016x}"
        values[idx["policy"]] = "lru"
        values[idx["step"]] = i // 256
        return tuple(values)

    def dropped(n: int) -> tuple:
        values: list[object] = [None] * width
        values[idx["ts_ns"]] = time.time_ns()
        values[idx["event"]] = S.SINK_DROPPED
        values[idx["engine"]] = engine
        values[idx["run_id"]] = run_id
        values[idx["count"]] = n
        return tuple(values)

    meta = {S.META_SCHEMA_VERSION: str(S.SCHEMA_VERSION), S.META_ENGINE: engine, S.META_RUN_ID: run_id,
            S.META_BLOCK_SIZE: "16", S.META_NUM_BLOCKS: "100000", S.META_POLICY: "lru",
            S.META_VLLM_VERSION: "soak"}
    buffer = EventBuffer(capacity=args.buffer_events, wake_at=args.batch_events)
    sink = UnixArrowSink(args.socket, buffer, meta, dropped, batch_events=args.batch_events, flush_ms=100)
    sink.start()
    emitted = 0
    t0 = time.monotonic()
    end = t0 + args.seconds
    while (now := time.monotonic()) < end:
        due = int((now - t0) * args.rate)
        while emitted < due:
            buffer.append(row(emitted))
            emitted += 1
        time.sleep(0.01)
    sink.close(timeout=args.close_timeout)
    print(json.dumps({
        "run": run_id, "emitted": emitted, "buffer_total": buffer.total, "lost_events": sink.lost_events,
        "reported_lost": sink.reported_lost, "accounted": sink.accounted_events(), "acked_events": sink.acked_events,
        "connects": sink.connects, "batches": sink.sent_batches,
    }), flush=True)
    return 0


# -------------------------------------------------------------------------------------------------- driver


@dataclass
class Sample:
    t: float
    who: str
    rss: int
    fds: int


@dataclass
class Soak:
    samples: list[Sample] = field(default_factory=list)
    incarnation_end: list[tuple[int, float, int, int]] = field(default_factory=list)  # (n, age s, rss, fds)
    restarts: list[float] = field(default_factory=list)


def run_driver(args: argparse.Namespace) -> int:
    from kvfabric.collector import CollectorConfig, CollectorProcess

    total_s = args.minutes * 60.0
    restart_s = parse_duration(args.restart_every)
    args.commit = _commit()  # the code that runs, recorded now (the tree may move on during a long soak)
    workdir = tempfile.mkdtemp(prefix="kvf-soak-", dir=args.workdir)
    db = os.path.join(workdir, "soak.duckdb")
    sock = os.path.join(workdir, "s", "kvf.sock")
    log_path = os.path.join(workdir, "collector.log")
    port = _free_port()
    cfg = CollectorConfig(db_path=db, socket_path=sock, port=port)
    soak = Soak()
    t_start = time.monotonic()

    def start_collector() -> CollectorProcess:
        return CollectorProcess(cfg, log_path=log_path, ready_timeout=120.0).start()

    collector = start_collector()
    born = time.monotonic()
    runs = [f"soak-{i}" for i in range(args.senders)]
    emitters = [
        subprocess.Popen(
            [sys.executable, __file__, "--role", "emitter", "--socket", sock, "--run", run, "--engine", f"e{i}",
             "--rate", str(args.rate), "--seconds", str(total_s), "--batch-events", str(args.batch_events),
             "--buffer-events", str(args.buffer_events), "--close-timeout", "120"],
            stdout=subprocess.PIPE, stderr=open(os.path.join(workdir, f"emitter{i}.log"), "wb"),
        )
        for i, run in enumerate(runs)
    ]
    stop = threading.Event()

    def sampler() -> None:
        while not stop.wait(args.sample_every):
            now = time.monotonic() - t_start
            if collector.proc is not None:
                st = proc_stats(collector.proc.pid)
                if st:
                    soak.samples.append(Sample(now, "collector", *st))
            for i, e in enumerate(emitters):
                st = proc_stats(e.pid)
                if st:
                    soak.samples.append(Sample(now, f"sender{i}", *st))

    th = threading.Thread(target=sampler, daemon=True)
    th.start()
    progress = _progress(total_s)
    next_restart = t_start + restart_s
    n_incarnation = 0
    try:
        while any(e.poll() is None for e in emitters):
            now = time.monotonic()
            progress(min(total_s, now - t_start))
            if now >= next_restart and now - t_start < total_s - 5:
                assert collector.proc is not None
                st = proc_stats(collector.proc.pid)
                if st:
                    soak.incarnation_end.append((n_incarnation, now - born, *st))
                collector.proc.send_signal(signal.SIGKILL)  # no flush, no goodbye
                collector.kill()
                soak.restarts.append(now - t_start)
                time.sleep(1.0)
                collector = start_collector()
                born = time.monotonic()
                n_incarnation += 1
                next_restart += restart_s
            time.sleep(0.5)
        progress(total_s, done=True)
        outputs = [json.loads(e.stdout.read().decode().strip().splitlines()[-1]) for e in emitters if e.stdout]
    finally:
        stop.set()
        th.join()
        if collector.proc is not None and collector.proc.poll() is None:
            st = proc_stats(collector.proc.pid)
            if st:
                soak.incarnation_end.append((n_incarnation, time.monotonic() - born, *st))
            rc = collector.stop(timeout=120)
        else:
            rc = -1
        for e in emitters:
            if e.poll() is None:
                e.kill()
    result = summarise(args, soak, outputs, db, rc, total_s, restart_s)
    write_results(args, result, soak)
    shutil.rmtree(workdir, ignore_errors=True)
    print(f"wrote {args.out}")
    if args.format == "json":
        print(json.dumps(result))
    return 0 if result["ok"] else 1


def summarise(args: argparse.Namespace, soak: Soak, outputs: list[dict], db: str, rc: int, total_s: float,
              restart_s: float) -> dict:
    import duckdb

    per_run = []
    with duckdb.connect(db, read_only=True) as con:
        for out in outputs:
            stored, distinct, reported = con.execute(
                "SELECT count(*) FILTER (WHERE event <> 'sink_dropped'), "
                "count(DISTINCT block_id) FILTER (WHERE event <> 'sink_dropped'), "
                "coalesce(sum(\"count\") FILTER (WHERE event = 'sink_dropped'), 0) FROM events WHERE run_id = ?",
                [out["run"]]).fetchone()
            gaps, dups, conns = con.execute(
                "SELECT coalesce(sum(gaps), 0), coalesce(sum(duplicates), 0), coalesce(sum(connections), 0) "
                "FROM streams WHERE run_id = ?", [out["run"]]).fetchone()
            unreported = out["lost_events"] - out["reported_lost"]
            per_run.append({
                "run": out["run"], "emitted": out["emitted"], "stored": stored, "distinct_stored": distinct,
                "reported_lost": reported, "unreported_lost_at_close": unreported,
                "balance_ok": stored + reported + unreported == out["emitted"] and distinct == stored,
                "sequence_gaps": gaps, "duplicates_refused": dups, "connections": conns,
                "sink_connects": out["connects"],
            })
    senders = {}
    for who in sorted({s.who for s in soak.samples if s.who.startswith("sender")}):
        xs = [s for s in soak.samples if s.who == who]
        warm = [s for s in xs if s.t >= min(total_s * 0.1, 120)]  # after the warm-up (buffers, imports, caches)
        k = max(1, len(warm) // 10)
        first, last = warm[:k], warm[-k:]
        senders[who] = {
            "rss_mb_first": _median([s.rss for s in first]) / 2**20,
            "rss_mb_last": _median([s.rss for s in last]) / 2**20,
            "rss_mb_max": max(s.rss for s in xs) / 2**20, "fds_min": min(s.fds for s in xs),
            "fds_max": max(s.fds for s in xs),
        }
    ends = [{"incarnation": n, "age_s": round(age), "rss_mb": rss / 2**20, "fds": fds}
            for n, age, rss, fds in soak.incarnation_end]
    full = [e for e in ends if e["age_s"] >= 0.5 * restart_s]  # incarnations that lived (most of) a whole period
    col = {
        "incarnations": ends,
        "rss_mb_range_full_periods": [min(e["rss_mb"] for e in full), max(e["rss_mb"] for e in full)] if full else None,
        "fds_range_full_periods": [min(e["fds"] for e in full), max(e["fds"] for e in full)] if full else None,
        "restarts": len(soak.restarts),
    }
    emitted = sum(r["emitted"] for r in per_run)
    ok = all(r["balance_ok"] for r in per_run) and rc == 0
    return {
        "ok": ok, "minutes": args.minutes, "restart_every_s": restart_s, "rate_per_sender": args.rate,
        "senders": args.senders, "emitted": emitted, "stored": sum(r["stored"] for r in per_run),
        "counted_lost": sum(r["reported_lost"] + r["unreported_lost_at_close"] for r in per_run),
        "runs": per_run, "sender_processes": senders, "collector": col, "final_stop_exit_code": rc,
    }


def _median(xs: list[int]) -> float:
    ys = sorted(xs)
    return float(ys[len(ys) // 2]) if ys else 0.0


def write_results(args: argparse.Namespace, r: dict, soak: Soak) -> None:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    png = out.with_suffix(".png")
    _plot(soak, png)
    out.with_suffix(".json").write_text(json.dumps(r, indent=2) + "\n")
    cmd = "python benchmarks/bench_soak_collector.py " + " ".join(sys.argv[1:])
    balance = "==" if r["emitted"] == r["stored"] + r["counted_lost"] else "!="
    lines = [
        "# Collector soak: steady load, SIGKILL + restart on a schedule",
        "",
        f"Command: `{cmd.strip()}`  ",
        f"Code: commit {args.commit}  ",
        f"Machine: {os.cpu_count()} cores, {_mem_gib():.0f} GiB RAM, Python {platform.python_version()}, "
        f"{platform.platform()}  ",
        f"Load: {r['senders']} sender processes (the hook's UnixArrowSink, protocol 2) at {r['rate_per_sender']:,} "
        f"events/s each for {r['minutes']:g} min; the collector killed with SIGKILL and restarted every "
        f"{r['restart_every_s']:g} s ({r['collector']['restarts']} restarts).",
        "",
        f"**Result: {'PASS' if r['ok'] else 'FAIL'}** - emitted {r['emitted']:,}, stored {r['stored']:,}, counted "
        f"lost {r['counted_lost']:,}: stored + counted loss {balance} emitted.",
        "",
        "| run | emitted | stored | distinct stored | lost (reported) | lost (at close) | balance | gaps | "
        "resends dropped as duplicates | connections |",
        "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for p in r["runs"]:
        lines.append(
            f"| {p['run']} | {p['emitted']:,} | {p['stored']:,} | {p['distinct_stored']:,} | {p['reported_lost']:,} | "
            f"{p['unreported_lost_at_close']:,} | {'ok' if p['balance_ok'] else 'MISMATCH'} | {p['sequence_gaps']} | "
            f"{p['duplicates_refused']} | {p['connections']} |")
    lines += ["", "Sender processes (alive the whole run; after a warm-up of min(10% of the run, 2 min)):", "",
              "| process | RSS first 10% (MiB) | RSS last 10% (MiB) | RSS max (MiB) | fds min..max |",
              "|---|---:|---:|---:|---|"]
    for who, s in r["sender_processes"].items():
        lines.append(f"| {who} | {s['rss_mb_first']:.1f} | {s['rss_mb_last']:.1f} | {s['rss_mb_max']:.1f} | "
                     f"{s['fds_min']}..{s['fds_max']} |")
    lines += ["", "Collector, at the end of each incarnation (a new process after every restart):", "",
              "| incarnation | age (s) | RSS (MiB) | fds |", "|---:|---:|---:|---:|"]
    for e in r["collector"]["incarnations"]:
        lines.append(f"| {e['incarnation']} | {e['age_s']} | {e['rss_mb']:.1f} | {e['fds']} |")
    lines += ["", f"Collector final SIGTERM exit code: {r['final_stop_exit_code']} (0 = clean flush).", "",
              f"Memory and descriptors over time: `{png.name}`; raw numbers: `{out.with_suffix('.json').name}`.", ""]
    out.write_text("\n".join(lines))


def _plot(soak: Soak, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    bounds = [0.0, *soak.restarts, float("inf")]
    for k, who in enumerate(sorted({s.who for s in soak.samples})):
        xs = [s for s in soak.samples if s.who == who]
        # One line per process: the collector is a new process after every restart.
        parts = [[s for s in xs if lo <= s.t < hi] for lo, hi in itertools.pairwise(bounds)] \
            if who == "collector" else [xs]
        for j, part in enumerate(p for p in parts if p):
            kw = {"label": who} if j == 0 else {}
            a1.plot([s.t / 60 for s in part], [s.rss / 2**20 for s in part], color=f"C{k}", lw=1, **kw)
            a2.plot([s.t / 60 for s in part], [s.fds for s in part], color=f"C{k}", lw=1, **kw)
    for t in soak.restarts:
        for a in (a1, a2):
            a.axvline(t / 60, color="grey", ls=":", lw=0.8)
    a1.set_ylabel("RSS (MiB)")
    a2.set_ylabel("open fds")
    a2.set_xlabel("minutes (dotted: collector killed with SIGKILL and restarted)")
    a1.legend(loc="upper left", fontsize=8)
    a1.set_title("Collector soak: memory and file descriptors")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).parent)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=10, cwd=Path(__file__).parent).stdout.strip()
        return out.stdout.strip() + (" (with uncommitted changes)" if dirty else "") if out.returncode == 0 else "?"
    except OSError:
        return "?"


def _mem_gib() -> float:
    with open("/proc/meminfo", encoding="ascii") as f:
        return int(f.readline().split()[1]) / 2**20


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _progress(total_s: float):  # type: ignore[no-untyped-def]
    from tqdm import tqdm

    bar = tqdm(total=int(total_s), unit="s", desc="soak", file=sys.stderr, mininterval=5.0)

    def update(t: float, done: bool = False) -> None:
        step = int(t) - bar.n
        if step > 0:
            bar.update(step)
        if done:
            bar.close()

    return update


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=60.0, help="length of the steady load (default: 60)")
    ap.add_argument("--restart-every", default="10m", help="collector SIGKILL + restart period, e.g. 30s, 10m")
    ap.add_argument("--senders", type=int, default=2, help="sender processes, one stream each (default: 2)")
    ap.add_argument("--rate", type=int, default=2000, help="events/s per sender (default: 2000, a moderate load)")
    ap.add_argument("--batch-events", type=int, default=4096, help="sink batch size (default: the hook's 4096)")
    ap.add_argument("--buffer-events", type=int, default=1_000_000, help="sink buffer bound (default: the hook's)")
    ap.add_argument("--sample-every", type=float, default=10.0, help="seconds between /proc samples")
    ap.add_argument("--workdir", default=None, help="where the temporary database lives (default: the system's)")
    ap.add_argument("--out", default=str(RESULTS / "soak_collector.md"), help="results file (.md; .json, .png beside)")
    ap.add_argument("--format", choices=["text", "json"], default="text", help="json: one JSON object, last line")
    # Internal: the sender processes run this script too.
    ap.add_argument("--role", choices=["driver", "emitter"], default="driver", help=argparse.SUPPRESS)
    ap.add_argument("--socket", help=argparse.SUPPRESS)
    ap.add_argument("--run", help=argparse.SUPPRESS)
    ap.add_argument("--engine", help=argparse.SUPPRESS)
    ap.add_argument("--seconds", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--close-timeout", type=float, default=120.0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.role == "emitter":
        return run_emitter(args)
    return run_driver(args)


if __name__ == "__main__":
    sys.exit(main())
