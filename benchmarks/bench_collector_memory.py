#!/usr/bin/env python3
"""The collector's memory against the rows it has stored, with and without DuckDB's memory limit.

Appends event rows (the collector's schema, 4,096-row Arrow batches, one transaction each, as the writer does)
into a fresh DuckDB file opened the way the collector opens it, and records the process's RSS every 600k rows,
for each ``--limits`` value in its own process (``none`` = DuckDB's default, 80 % of RAM).

    python benchmarks/bench_collector_memory.py [--rows 3000000] [--limits none,128MB,256MB]

Writes ``benchmarks/results/collector_memory.md`` (``--out``) and, next to it, ``collector_memory.json``: each
limit's RSS points and insert seconds, with the command, machine, date (UTC) and the 1-minute load average before
and after each limit's process (the machine is shared: the load says what else ran).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BATCH = 4096


def _rss_mib() -> float:
    from kvfabric.bench.servers import process_stats

    stats = process_stats(os.getpid())
    return int(stats["rss_bytes"]) / 2**20 if stats is not None else 0.0


def child(limit: str, rows: int) -> None:
    import pyarrow as pa

    from kvfabric.contract import schema as S
    from kvfabric.ingest.store import open_database

    rng = random.Random(0)
    cols = []
    for f in S.EVENT_SCHEMA:
        if f.name == "event":
            cols.append(pa.array([S.BLOCK_ALLOCATED] * BATCH))
        elif f.name in ("run_id", "engine"):
            cols.append(pa.array(["r"] * BATCH))
        elif pa.types.is_integer(f.type):
            cols.append(pa.array([rng.randrange(1 << (f.type.bit_width - 2)) for _ in range(BATCH)], f.type))
        elif pa.types.is_string(f.type):
            cols.append(pa.array([f"req-{rng.randrange(10**6)}" for _ in range(BATCH)]))
        else:
            cols.append(pa.nulls(BATCH, f.type))
    table = pa.table(cols, schema=S.EVENT_SCHEMA)
    with tempfile.TemporaryDirectory() as d:
        con = open_database(os.path.join(d, "m.duckdb"), None, None if limit == "none" else limit)
        points = [(0, round(_rss_mib(), 1))]
        t0 = time.perf_counter()
        every = max(1, 600_000 // BATCH)
        for i in range(1, rows // BATCH + 1):
            con.execute("BEGIN")
            con.register("b", table)
            con.execute("INSERT INTO events SELECT * FROM b")
            con.unregister("b")
            con.execute("COMMIT")
            if i % every == 0:
                points.append((i * BATCH, round(_rss_mib(), 1)))
        secs = time.perf_counter() - t0
        con.close()
    print(json.dumps({"limit": limit, "points": points, "seconds": round(secs, 1)}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=3_000_000)
    ap.add_argument("--limits", default="none,128MB,256MB")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "collector_memory.md"))
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.rows)
        return 0
    command = "python benchmarks/bench_collector_memory.py " + " ".join(sys.argv[1:])
    loads = [round(os.getloadavg()[0], 2)]
    results = []
    for limit in args.limits.split(","):
        out = subprocess.run([sys.executable, __file__, "--child", limit, "--rows", str(args.rows)],
                             capture_output=True, text=True, check=True, cwd=ROOT)
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
        loads.append(round(os.getloadavg()[0], 2))
        print(f"{limit}: {results[-1]['points'][-1]}", file=sys.stderr)
    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    marks = [p[0] for p in results[0]["points"]]
    lines = [
        "# Collector memory against stored rows, with and without DuckDB's memory limit",
        "",
        f"Command: `{command.strip()}`  ",
        f"Machine: {machine}, {date}; 1-minute load average {min(loads):.2f}-{max(loads):.2f} (before and after "
        "each limit's process)",
        "",
        "RSS (MiB) of a process appending event rows to DuckDB as the collector's writer does (4,096-row batches, one",
        "transaction each); `none` = DuckDB's default limit (80 % of RAM). The collector's default is",
        "`--memory-limit 256MB`.",
        "",
        "| rows stored | " + " | ".join(r["limit"] for r in results) + " |",
        "|---|" + "---|" * len(results),
    ]
    for k, mark in enumerate(marks):
        lines.append(f"| {mark:,} | " + " | ".join(f"{r['points'][k][1]:.0f}" for r in results) + " |")
    lines.append("| insert seconds | " + " | ".join(f"{r['seconds']:.1f}" for r in results) + " |")
    Path(args.out).write_text("\n".join(lines) + "\n")
    data = {"command": command.strip(), "machine": machine, "date": date, "load_average_1m": loads,
            "rows": args.rows, "batch_rows": BATCH, "rss_unit": "MiB",
            "limits": [{"limit": r["limit"], "points": r["points"], "insert_seconds": r["seconds"]} for r in results]}
    json_out = Path(args.out).with_suffix(".json")
    json_out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {args.out} and {json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
