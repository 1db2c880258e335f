#!/usr/bin/env python3
"""Retention soak: does a collector's disk and memory stay flat once ``--retain`` starts deleting? And how many bytes
does the store spend per request and per event?

For each backend (``file``: one DuckDB file; ``lake``: DuckLake with a throwaway PostgreSQL catalog and a local data
folder) a real collector process (``python -m kvfabric.collector --retain R --maintenance-interval I``) is fed
steadily through its Unix socket by a load generator in this process (one stream, a batch of ``--rate`` events of
mixed kinds, stamped now, every second), and every ``--sample`` seconds the store's bytes on disk (file + WAL; the
lake's data folder + ``pg_database_size`` of its catalog) and the collector's RSS are recorded.

Flat means, after retention kicked in (``t >= retain + interval``): the least-squares slope over the last half of
the run is below ``--tolerance`` (default 10 %) of the slope before retention (the store's growth rate without it),
for disk; for RSS, the last half's slope over that half is below ``--tolerance`` of its mean.

Bytes per request and per event: ``kvfabric demo`` (vLLM's real Scheduler with a simulated model, the plugin
streaming to a real collector) into a fresh store of each backend; the store's bytes divided by requests
(``prefix_lookup`` rows) and by events, total and net of the empty store's bytes.

    python benchmarks/bench_retention.py [--backends file,lake] [--duration 240] [--retain 60] [--interval 10]
                                         [--rate 5000] [--sample 5]

Writes benchmarks/results/retention.json, renders benchmarks/results/retention.md (and retention.png, with
matplotlib) from it; ``--render-only`` re-renders from the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the test kits: PostgreSQL, collector files, batches
RESULTS = ROOT / "benchmarks" / "results"


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------------- stores


class Store:
    """Where one collector stores: ``config_kwargs`` for CollectorConfig, ``bytes()`` on disk (+ catalog)."""

    def __init__(self, kind: str, root: str, pg: Any | None) -> None:
        self.kind = kind
        self.root = root
        self.pg = pg
        self.db_path = os.path.join(root, "events.duckdb")
        self.data = os.path.join(root, "lake-data")
        self.dbname = None
        self.catalog = None
        if kind == "lake":
            assert pg is not None
            self.dbname = f"lake_{os.path.basename(root).replace('-', '_')}"
            self.catalog = pg.create_database(self.dbname)
            os.makedirs(self.data, exist_ok=True)

    def config_kwargs(self) -> dict[str, Any]:
        return {"lake": self.catalog, "data": self.data} if self.kind == "lake" else {}

    def catalog_bytes(self) -> int:
        if self.pg is None:
            return 0
        out = subprocess.run(
            [str(self.pg.bin_dir / "psql"), "-h", self.pg.host, "-p", str(self.pg.port), "-U", self.pg.user,
             "-d", str(self.dbname), "-Atc", "SELECT pg_database_size(current_database())"],
            capture_output=True, text=True, check=True, timeout=30)
        return int(out.stdout.strip())

    def bytes(self) -> dict[str, int]:
        from kvfabric.ingest.backend import folder_bytes
        from kvfabric.ingest.store import db_size_bytes

        if self.kind == "file":
            return {"disk": db_size_bytes(self.db_path), "data": db_size_bytes(self.db_path), "catalog": 0}
        data = folder_bytes(self.data)
        cat = self.catalog_bytes()
        return {"disk": data + cat, "data": data, "catalog": cat}


# ------------------------------------------------------------------------------------------------ load generator


class Load:
    """One stream; every second one batch of ``rate`` rows stamped now (a mix of the hook's event kinds)."""

    def __init__(self, socket_path: str, rate: int) -> None:
        self.socket_path = socket_path
        self.rate = rate
        self.sent = 0
        self.seq = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.error: BaseException | None = None

    def batch(self) -> Any:
        import pyarrow as pa

        from kvfabric.contract import schema as S

        n, seq, t0 = self.rate, self.seq, time.time_ns()
        kinds = [S.BLOCK_ALLOCATED, S.BLOCK_SEALED, S.BLOCK_TOUCHED, S.BLOCK_FREED, S.BLOCK_EVICTED,
                 S.PREFIX_LOOKUP]
        cols: dict[str, Any] = {
            "seq": pa.array([seq] * n, pa.int64()),
            "ts_ns": pa.array([t0 + i * 1000 for i in range(n)], pa.int64()),
            "step": pa.array([seq * 100 + i // 50 for i in range(n)], pa.int64()),
            "engine": pa.array(["e0"] * n, pa.string()),
            "run_id": pa.array(["soak"] * n, pa.string()),
            "event": pa.array([kinds[i % len(kinds)] for i in range(n)], pa.string()),
            "request_id": pa.array([f"req-{seq}-{i // 30}" for i in range(n)], pa.string()),
            "block_id": pa.array([(seq * n + i) % 4096 for i in range(n)], pa.int32()),
            "block_hash": pa.array([(seq * n + i) * 2654435761 % (1 << 62) for i in range(n)], pa.int64()),
            "family": pa.array([f"fam{i % 17}" for i in range(n)], pa.string()),
            "depth": pa.array([i % 64 for i in range(n)], pa.int32()),
            "ref_count": pa.array([i % 3 for i in range(n)], pa.int32()),
        }
        arrays = []
        for f in S.EVENT_SCHEMA:
            a = cols.get(f.name)
            arrays.append(a.cast(f.type) if a is not None else pa.nulls(n, f.type))
        return pa.RecordBatch.from_arrays(arrays, schema=S.EVENT_SCHEMA)

    def _run(self) -> None:
        from support.collector_testkit import meta, send_stream

        try:
            next_t = time.monotonic()
            while not self._stop.is_set():
                b = self.batch()
                send_stream(self.socket_path, meta("soak-stream", "soak", "e0"), [b])
                self.sent += b.num_rows
                self.seq += 1
                next_t += 1.0
                self._stop.wait(max(0.0, next_t - time.monotonic()))
        except BaseException as e:  # reported by the soak
            self.error = e

    def start(self) -> Load:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)


# --------------------------------------------------------------------------------------------------------- soak


def soak(kind: str, args: argparse.Namespace, pg: Any | None) -> dict[str, Any]:
    from support.collector_testkit import collector_files, rss_bytes

    with collector_files() as f:
        store = Store(kind, f.root, pg)
        config = f.config(retain_s=args.retain, maintenance_interval_s=args.interval, **store.config_kwargs())
        from kvfabric.collector import CollectorProcess

        say(f"{kind}: collector --retain {args.retain:g}s --maintenance-interval {args.interval:g}s, "
            f"{args.rate} events/s for {args.duration:g}s")
        samples: list[dict[str, float]] = []
        with CollectorProcess(config, log_path=f.log_path, ready_timeout=60.0) as proc:
            assert proc.proc is not None
            load = Load(f.socket_path, args.rate).start()
            t0 = time.monotonic()
            try:
                while (t := time.monotonic() - t0) < args.duration:
                    b = store.bytes()
                    samples.append({"t": round(t, 1), "disk": b["disk"], "data": b["data"], "catalog": b["catalog"],
                                    "rss": rss_bytes(proc.proc.pid), "sent": load.sent})
                    s = samples[-1]
                    say(f"{kind} t={t:5.0f}s sent={load.sent:>9,} disk={s['disk'] / 2**20:7.1f} MiB "
                        f"rss={s['rss'] / 2**20:6.1f} MiB")
                    if load.error is not None:
                        raise RuntimeError(f"load generator failed: {load.error}")
                    time.sleep(max(0.0, args.sample - (time.monotonic() - t0 - t)))
            finally:
                load.stop()
            retention_lines = [ln for ln in f.log().splitlines() if "retention" in ln]
        return {"backend": kind, "samples": samples, "sent": load.sent,
                "maintenance_log_tail": retention_lines[-3:]}


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope (units per second)."""
    n = len(points)
    if n < 2:
        return 0.0
    mx = sum(p[0] for p in points) / n
    my = sum(p[1] for p in points) / n
    den = sum((p[0] - mx) ** 2 for p in points)
    return sum((p[0] - mx) * (p[1] - my) for p in points) / den if den else 0.0


def verdict(result: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    s = result["samples"]
    kick = args.retain + args.interval
    pre = [(p["t"], p["disk"]) for p in s if p["t"] <= args.retain]
    post = [p for p in s if p["t"] >= kick]
    half = [p for p in s if p["t"] >= s[-1]["t"] / 2 and p["t"] >= kick]
    first_window = [p for p in post if p["t"] < kick + args.retain]
    growth = slope(pre)
    disk_slope = slope([(p["t"], p["disk"]) for p in half])
    rss_slope = slope([(p["t"], p["rss"]) for p in half])
    span = (half[-1]["t"] - half[0]["t"]) if len(half) > 1 else 0.0
    rss_mean = sum(p["rss"] for p in half) / len(half) if half else 0.0

    def mean(pts: list[dict[str, Any]], key: str) -> float:
        return sum(p[key] for p in pts) / len(pts) if pts else 0.0

    return {
        "retention_kicks_in_s": kick,
        "pre_retention_disk_slope_bytes_per_s": round(growth, 1),
        "last_half_disk_slope_bytes_per_s": round(disk_slope, 1),
        "last_half_rss_slope_bytes_per_s": round(rss_slope, 1),
        "first_window_disk_mean": round(mean(first_window, "disk")),
        "last_half_disk_mean": round(mean(half, "disk")),
        "last_half_disk_max": max((p["disk"] for p in half), default=0),
        "first_window_rss_mean": round(mean(first_window, "rss")),
        "last_half_rss_mean": round(rss_mean),
        "last_half_rss_max": max((p["rss"] for p in half), default=0),
        "disk_flat": bool(half) and disk_slope <= args.tolerance * max(growth, 1.0),
        "rss_flat": bool(half) and rss_slope * span <= args.tolerance * rss_mean,
        "tolerance": args.tolerance,
    }


# ------------------------------------------------------------------------------------------- bytes per request


def empty_store_bytes(store: Store) -> int:
    from kvfabric.ingest.backend import Backend
    from kvfabric.lake import LakeLocation

    lake = LakeLocation.parse(store.catalog, store.data) if store.kind == "lake" else None
    con = Backend(store.db_path, lake).open()
    con.close()
    return store.bytes()["disk"]


def per_request(kind: str, pg: Any | None) -> dict[str, Any]:
    import duckdb

    root = tempfile.mkdtemp(prefix="kvf-demo-", dir="/tmp")
    try:
        store = Store(kind, root, pg)
        empty = empty_store_bytes(store)
        cmd = [sys.executable, "-m", "kvfabric.cli", "demo", "--parquet", os.path.join(root, "pq"),
               "--run-id", "bytes", "--json"]
        cmd += (["--lake", str(store.catalog), "--data", store.data] if kind == "lake"
                else ["--db", store.db_path])
        say(f"{kind}: kvfabric demo into a fresh store")
        t0 = time.monotonic()
        subprocess.run(cmd, check=True, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=900)
        seconds = time.monotonic() - t0
        after = store.bytes()
        pq = os.path.join(root, "pq")
        glob = os.path.join(pq, "**", "*.parquet").replace("'", "''")
        con = duckdb.connect()
        events_files = [p for p in Path(pq).rglob("*.parquet") if "events" in str(p)]
        try:
            src = f"read_parquet('{glob}', union_by_name=true)" if not events_files else \
                "read_parquet([" + ", ".join("'" + str(p).replace("'", "''") + "'" for p in events_files) + "])"
            events, requests = con.execute(
                f"SELECT count(*), count(*) FILTER (WHERE event = 'prefix_lookup') FROM {src}").fetchone()
        finally:
            con.close()
        out = {"backend": kind, "requests": int(requests), "events": int(events), "store_bytes": after["disk"],
               "data_bytes": after["data"], "catalog_bytes": after["catalog"], "empty_store_bytes": empty,
               "bytes_per_request": round(after["disk"] / requests, 1),
               "bytes_per_event": round(after["disk"] / events, 2),
               "net_bytes_per_request": round((after["disk"] - empty) / requests, 1),
               "net_bytes_per_event": round((after["disk"] - empty) / events, 2),
               "demo_seconds": round(seconds, 1)}
        say(f"{kind}: {out}")
        return out
    finally:
        shutil.rmtree(root, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------- rendering


def render(doc: dict[str, Any], md_path: Path, png_path: Path | None) -> None:
    a = doc["args"]
    mib = 2**20
    lines = [
        "# Retention soak: disk and memory with `--retain`, and bytes per request / event",
        "",
        f"Command: `{doc['command']}`  ",
        f"Machine: {doc['machine']}, {doc['date']}",
        "",
        f"A real collector per backend with `--retain {a['retain']:g}s --maintenance-interval {a['interval']:g}s`, "
        f"fed {a['rate']:,} events/s (one stream, one batch a second, mixed event kinds stamped now) through its "
        f"Unix socket for {a['duration']:g} s; every {a['sample']:g} s the store's bytes on disk (DuckDB file + WAL; "
        "lake: the data folder + `pg_database_size` of the PostgreSQL catalog) and the collector's RSS.",
        "",
        f"Flat (tolerance {a['tolerance']:.0%}): after retention kicks in (t >= retain + interval), the disk's "
        "least-squares slope over the last half of the run is below the tolerance times the slope before retention "
        "(the growth rate without it; a negative slope, shrinking, is flat); the RSS's last-half slope times the "
        "half's length is below the tolerance times its mean.",
        "",
        "| backend | events sent | disk slope before (KiB/s) | disk slope last half (KiB/s) | disk first window "
        "mean (MiB) | disk last half mean / max (MiB) | RSS first window (MiB) | RSS last half mean / max (MiB) | "
        "RSS slope last half (KiB/s) | disk flat | RSS flat |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["soak"]:
        v = r["verdict"]
        lines.append(
            f"| {r['backend']} | {r['sent']:,} | {v['pre_retention_disk_slope_bytes_per_s'] / 1024:.1f} | "
            f"{v['last_half_disk_slope_bytes_per_s'] / 1024:.2f} | {v['first_window_disk_mean'] / mib:.1f} | "
            f"{v['last_half_disk_mean'] / mib:.1f} / {v['last_half_disk_max'] / mib:.1f} | "
            f"{v['first_window_rss_mean'] / mib:.0f} | {v['last_half_rss_mean'] / mib:.0f} / "
            f"{v['last_half_rss_max'] / mib:.0f} | {v['last_half_rss_slope_bytes_per_s'] / 1024:.2f} | "
            f"{'yes' if v['disk_flat'] else 'NO'} | {'yes' if v['rss_flat'] else 'NO'} |")
    lines += ["", "Samples (t s: disk MiB / RSS MiB):", ""]
    for r in doc["soak"]:
        pts = r["samples"][:: max(1, len(r["samples"]) // 20)]
        lines.append(f"- {r['backend']}: " + ", ".join(
            f"{p['t']:.0f}: {p['disk'] / mib:.1f}/{p['rss'] / mib:.0f}" for p in pts))
    lines += [
        "",
        "## Bytes per request and per event",
        "",
        "`kvfabric demo` (vLLM's real Scheduler, simulated model, the plugin streaming to a real collector) into a "
        "fresh store; requests = `prefix_lookup` rows, events = every row (counted in the demo's Parquet export). "
        "Net = minus the bytes of the empty store (schema, catalog tables).",
        "",
        "| backend | requests | events | store bytes (data + catalog) | empty store | bytes / request | "
        "bytes / event | net bytes / request | net bytes / event |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for b in doc["bytes"]:
        lines.append(
            f"| {b['backend']} | {b['requests']:,} | {b['events']:,} | {b['store_bytes']:,} ({b['data_bytes']:,} + "
            f"{b['catalog_bytes']:,}) | {b['empty_store_bytes']:,} | {b['bytes_per_request']:,.0f} | "
            f"{b['bytes_per_event']:.1f} | {b['net_bytes_per_request']:,.0f} | {b['net_bytes_per_event']:.1f} |")
    if png_path is not None and png_path.exists():
        lines += ["", f"![disk and RSS over time]({png_path.name})"]
    md_path.write_text("\n".join(lines) + "\n")


def plot(doc: dict[str, Any], png_path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    kick = doc["args"]["retain"] + doc["args"]["interval"]
    for r in doc["soak"]:
        t = [p["t"] for p in r["samples"]]
        axes[0].plot(t, [p["disk"] / 2**20 for p in r["samples"]], label=r["backend"])
        axes[1].plot(t, [p["rss"] / 2**20 for p in r["samples"]], label=r["backend"])
    for ax, title in zip(axes, ("store bytes on disk (MiB)", "collector RSS (MiB)"), strict=True):
        ax.axvline(kick, color="grey", linestyle=":", label="retention kicks in")
        ax.set_title(title)
        ax.set_xlabel("seconds")
        ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=90)
    return True


# ---------------------------------------------------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default="file,lake", help="comma-separated: file, lake (default: %(default)s)")
    ap.add_argument("--duration", type=float, default=240.0, help="soak seconds per backend (default: %(default)s)")
    ap.add_argument("--retain", type=float, default=60.0, help="collector --retain, seconds (default: %(default)s)")
    ap.add_argument("--interval", type=float, default=10.0,
                    help="collector --maintenance-interval, seconds (default: %(default)s)")
    ap.add_argument("--rate", type=int, default=5000, help="events per second (default: %(default)s)")
    ap.add_argument("--sample", type=float, default=5.0, help="seconds between samples (default: %(default)s)")
    ap.add_argument("--tolerance", type=float, default=0.10, help="flatness tolerance (default: %(default)s)")
    ap.add_argument("--skip-bytes", action="store_true", help="skip the demo's bytes per request / event")
    ap.add_argument("--json", default=str(RESULTS / "retention.json"))
    ap.add_argument("--md", default=str(RESULTS / "retention.md"))
    ap.add_argument("--png", default=str(RESULTS / "retention.png"))
    ap.add_argument("--render-only", action="store_true", help="re-render the markdown and PNG from --json")
    args = ap.parse_args()
    json_path, md_path, png_path = Path(args.json), Path(args.md), Path(args.png)
    if not args.render_only:
        kinds = [k.strip() for k in args.backends.split(",") if k.strip()]
        pg = None
        try:
            if "lake" in kinds:
                from support.lake_testkit import PostgresServer

                pg = PostgresServer()
                pg.start()
            doc: dict[str, Any] = {
                "command": "python benchmarks/bench_retention.py " + " ".join(sys.argv[1:]),
                "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
                "date": time.strftime("%Y-%m-%d"),
                "args": {k: getattr(args, k) for k in ("duration", "retain", "interval", "rate", "sample",
                                                       "tolerance")},
                "soak": [], "bytes": [],
            }
            for kind in kinds:
                result = soak(kind, args, pg)
                result["verdict"] = verdict(result, args)
                say(f"{kind}: {result['verdict']}")
                doc["soak"].append(result)
            if not args.skip_bytes:
                for kind in kinds:
                    doc["bytes"].append(per_request(kind, pg))
        finally:
            if pg is not None:
                pg.close()
        json_path.write_text(json.dumps(doc, indent=1) + "\n")
    doc = json.loads(json_path.read_text())
    has_png = plot(doc, png_path)
    render(doc, md_path, png_path if has_png else None)
    say(f"wrote {json_path}, {md_path}" + (f", {png_path}" if has_png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
