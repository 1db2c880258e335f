"""Fleet benchmark: several collectors writing one DuckLake lake, and queries on big lakes.

Part ``writers``: for N in 1, 2, 3 real collector processes (``python -m kvfabric.collector --lake ... --data ...``),
each with its own socket and HTTP port, all on one lake (PostgreSQL catalog; data in a local folder, and again on
moto's S3 server), each fed by its own load generator process (one stream, batches of real-schema Arrow rows sent
as fast as the socket takes them, the approach of benchmarks/bench_ingest.py). After a warm-up, a fixed window
is measured from the collectors' /metrics: committed rows/s (``kvfabric_ingest_rows_total``), commits
(``kvfabric_insert_duration_seconds_count``), lake commit conflicts (``kvfabric_lake_commit_conflicts_total``, one
retry each), storage errors, ingest lag p99 (``kvfabric_ingest_lag_seconds``, bucket upper bound), and the CPU of
every process (collectors, generators, PostgreSQL, moto). Configurations are interleaved (1,2,3,1,2,3,...) and
repeated; each trial gets a fresh lake. After each trial the lake is read back: count(*) of events must equal
sum(streams.rows). A coalescing sweep (N collectors, local data, several --coalesce-rows/--coalesce-ms) shows
commits/s against conflicts.

Part ``queries``: lakes of 1e8 and 1e9 rows (PostgreSQL catalog, local Parquet data) made through
``Backend(...).open()`` (the collector's own tables and partitioning), filled with ``INSERT INTO events SELECT ...
FROM range(...)`` in chunks (real schema, realistic event mix, 6 runs of unequal size, 4 engines, 40 families,
3 days), plus one ``streams`` row per run x engine (block size 16); and one DuckDB file of 1e8 rows made with
``kvfabric.ingest.store.open_database``. Then kvfabric's own ``QueryRunner`` times run_summary, families and the
first page of evictions for the largest run: cold (the data files dropped from the page cache with
posix_fadvise(DONTNEED); every QueryRunner call opens a fresh DuckDB instance anyway) and warm (median of
repeats). Data is deleted afterwards.

    .venv/bin/python benchmarks/bench_fleet.py                 # both parts (~45 min on 2 cores)
    .venv/bin/python benchmarks/bench_fleet.py --part writers  # or --part queries
    .venv/bin/python benchmarks/bench_fleet.py --render        # re-render fleet.md from fleet.json

Results: benchmarks/results/fleet.json (raw numbers, command line, machine) and benchmarks/results/fleet.md
(rendered from the JSON by this script).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import shutil
import socket
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import duckdb  # noqa: E402
import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from kvfabric.contract import schema as S  # noqa: E402

RESULTS = HERE / "results"
T0_NS = 1_735_689_600 * 10**9  # 2025-01-01 00:00 UTC: generated lakes span 3 days from here
SPAN_NS = 3 * 86_400 * 10**9
RUNS = [("run-0", 50), ("run-1", 10), ("run-2", 10), ("run-3", 10), ("run-4", 10), ("run-5", 10)]  # % of rows
ENGINES = 4
QUERY_RUN = "run-0"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def machine() -> dict[str, Any]:
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    mem = next((int(ln.split()[1]) for ln in open("/proc/meminfo") if ln.startswith("MemTotal")), 0)
    return {"cores": os.cpu_count(), "cpu": cpu, "ram_gib": round(mem / 1024 / 1024, 1),
            "python": platform.python_version(), "duckdb": duckdb.__version__, "pyarrow": pa.__version__,
            "platform": platform.platform()}


def med_range(xs: list[float]) -> dict[str, float]:
    xs = [x for x in xs if x == x]
    if not xs:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan"), "n": 0}
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


# ============================================================================================ part 1: writers

EVENT_MIX = [
    (S.BLOCK_TOUCHED, 0.25), (S.REF_COUNT_CHANGED, 0.2), (S.BLOCK_ALLOCATED, 0.12), (S.BLOCK_SEALED, 0.12),
    (S.BLOCK_FREED, 0.12), (S.BLOCK_EVICTED, 0.08), (S.PREFIX_LOOKUP, 0.05), (S.BLOCK_REBUILT, 0.03),
    (S.EVICTION_CANDIDATES_RANKED, 0.03),
]


def template(run_id: str, engine: str, rows: int, seed: int) -> dict[str, pa.Array]:
    """Columns of one realistic batch (seq and ts_ns replaced per send): bench_ingest.py's shape."""
    rng = np.random.default_rng(seed)
    names = np.array([e for e, _ in EVENT_MIX])
    p = np.array([w for _, w in EVENT_MIX])
    events = rng.choice(names, rows, p=p / p.sum())
    lookup = events == S.PREFIX_LOOKUP
    block = ~lookup & (events != S.EVICTION_CANDIDATES_RANKED)
    evicted = events == S.BLOCK_EVICTED
    aged = evicted | (events == S.BLOCK_REBUILT)
    counted = lookup | (events == S.EVICTION_CANDIDATES_RANKED)
    req = rng.integers(0, 400, rows)
    fam = rng.integers(0, 40, rows)

    def ints(lo: int, hi: int, typ: pa.DataType, valid: np.ndarray) -> pa.Array:
        return pa.array(rng.integers(lo, hi, rows), typ, mask=~valid)

    cols = {
        "step": pa.array(np.arange(rows) // 64, pa.int64()),
        "engine": pa.array([engine] * rows, pa.string()),
        "run_id": pa.array([run_id] * rows, pa.string()),
        "event": pa.array(events, pa.string()),
        "request_id": pa.array([f"cmpl-{seed:04d}{r:08x}-0" for r in req], pa.string()),
        "block_id": ints(0, 200_000, pa.int32(), block),
        "block_hash": ints(-(2**63), 2**63 - 1, pa.int64(), block),
        "parent_hash": ints(-(2**63), 2**63 - 1, pa.int64(), block),
        "family": pa.array([f"{f:016x}" for f in fam], pa.string()),
        "depth": ints(0, 256, pa.int32(), block),
        "ref_count": ints(0, 4, pa.int32(), block),
        "hit_count": ints(0, 8, pa.int32(), block),
        "share_degree": ints(0, 4, pa.int32(), block),
        "branch_factor": ints(0, 3, pa.int32(), block),
        "prompt_tokens": ints(100, 8000, pa.int32(), lookup),
        "hit_tokens": ints(0, 4000, pa.int32(), lookup),
        "retain_score": pa.array(rng.random(rows), mask=~block),
        "protected": pa.array(rng.random(rows) < 0.2, mask=~block),
        "policy": pa.array(["lru"] * rows, pa.string()),
        "count": ints(0, 64, pa.int64(), counted),
        "age_ns": ints(0, 10**10, pa.int64(), aged),
        "reason": pa.array(np.where(evicted, "pressure", None).tolist(), pa.string()),
        "host": pa.array(["bench-host"] * rows, pa.string()),
        "dp_rank": pa.array(np.zeros(rows, np.int32), pa.int32()),
        "tenant": pa.nulls(rows, pa.string()),
        "lora": pa.nulls(rows, pa.string()),
    }
    missing = set(S.COLUMNS) - set(cols) - {"seq", "ts_ns"}
    assert not missing, f"template lacks {missing}"
    return cols


def generator(sock_path: str, k: int, tag: str, rows: int, go: Any, stop_at: Any, sent: Any) -> None:
    """One load generator: one stream into one collector socket, unpaced, until ``stop_at`` (time.time())."""
    run_id, engine = "fleet", f"engine-{k}"
    cols = template(run_id, engine, rows, seed=k)
    meta = {
        S.META_SCHEMA_VERSION: str(S.SCHEMA_VERSION), S.META_STREAM_ID: f"fleet-{tag}-{k}",
        S.META_ENGINE: engine, S.META_RUN_ID: run_id, S.META_BLOCK_SIZE: "16", S.META_NUM_BLOCKS: "200000",
        S.META_POLICY: "lru",
    }
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(sock_path)
    f = s.makefile("wb", buffering=1 << 20)
    writer = pa.ipc.new_stream(f, S.stream_schema(meta))
    go.wait()
    seq = 0
    try:
        while time.time() < stop_at.value:
            now = time.time_ns()
            cols["seq"] = pa.array(np.full(rows, seq, np.int64))
            cols["ts_ns"] = pa.array(np.full(rows, now, np.int64))  # stamped at send: lag = send -> commit
            writer.write_batch(pa.RecordBatch.from_arrays([cols[c] for c in S.COLUMNS], schema=S.EVENT_SCHEMA))
            f.flush()
            seq += 1
            sent.value = seq
        writer.close()
        f.close()
    finally:
        s.close()


def scrape(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, Any] = {"lag": []}
    sums: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            sums[smp.name] = sums.get(smp.name, 0.0) + smp.value
            if smp.name == "kvfabric_ingest_lag_seconds_bucket":
                out["lag"].append((float(smp.labels["le"]), smp.value))
    out["sums"] = sums
    return out


def lag_quantile(before: list[list[tuple[float, float]]], after: list[list[tuple[float, float]]],
                 q: float) -> float:
    """Upper bound of the bucket holding quantile ``q`` of all collectors' observations between two scrapes."""
    les = [le for le, _ in after[0]]
    delta = [0.0] * len(les)
    for b, a in zip(before, after, strict=True):
        for i, ((_, nb), (_, na)) in enumerate(zip(b, a, strict=True)):
            delta[i] += na - nb
    total = delta[-1]
    if total <= 0:
        return float("nan")
    for le, n in zip(les, delta, strict=True):
        if n >= q * total:
            return le
    return float("inf")


def cpu_s(pids: list[int]) -> float:
    """User+system CPU seconds of ``pids`` and their children (PostgreSQL backends are children)."""
    import psutil

    total = 0.0
    for pid in pids:
        try:
            p = psutil.Process(pid)
            procs = [p, *p.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for q in procs:
            try:
                t = q.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
    return total


class Servers:
    """PostgreSQL (catalog) for the whole run; moto S3 started per S3 trial (it keeps objects in memory)."""

    def __init__(self) -> None:
        from support.lake_testkit import PostgresServer

        self.pg = PostgresServer()
        self.pg.start()
        self.n = 0

    def postmaster_pid(self) -> int:
        return int((self.pg.data_dir / "postmaster.pid").read_text().split()[0])

    def catalog(self, prefix: str) -> str:
        self.n += 1
        return self.pg.create_database(f"{prefix}_{self.n}")

    def close(self) -> None:
        self.pg.close()


def lake_readback(catalog: str, data: str) -> tuple[int, int]:
    from kvfabric.lake import LakeLocation, connect_lake

    con = connect_lake(LakeLocation.parse(catalog, data), read_only=True)
    try:
        events = con.execute("SELECT count(*) FROM events").fetchone()[0]
        rows = con.execute("SELECT coalesce(sum(rows), 0) FROM streams").fetchone()[0]
    finally:
        con.close()
    return int(events), int(rows)


def writer_trial(servers: Servers, root: str, backend: str, n: int, tag: str, args: argparse.Namespace,
                 coalesce: tuple[int, int] | None = None) -> dict[str, Any]:
    from kvfabric.collector import CollectorConfig, CollectorProcess

    trial_dir = tempfile.mkdtemp(prefix=f"{tag}-", dir=root)
    moto = None
    env = dict(os.environ)
    saved_env = dict(os.environ)
    if backend == "s3":
        from support.lake_testkit import MotoS3

        moto = MotoS3()
        bucket = moto.create_bucket("fleet")
        data = f"s3://{bucket}/lake/"
        env.update(moto.env())
        os.environ.update(moto.env())  # this process reads the lake back afterwards
    else:
        data = os.path.join(trial_dir, "data")
    catalog = servers.catalog("w")
    rows, ms = coalesce or (args.coalesce_rows, args.coalesce_ms)
    colls: list[Any] = []
    gens: list[Any] = []
    ctx = mp.get_context("spawn")
    result: dict[str, Any] = {"backend": backend, "collectors": n, "coalesce_rows": rows, "coalesce_ms": ms}
    try:
        for k in range(n):
            cfg = CollectorConfig(db_path=os.path.join(trial_dir, f"unused{k}.duckdb"),
                                  socket_path=os.path.join(trial_dir, f"c{k}.sock"), port=free_port(),
                                  lake=catalog, data=data, coalesce_rows=rows, coalesce_ms=ms)
            c = CollectorProcess(cfg, log_path=os.path.join(trial_dir, f"collector{k}.log"), env=env,
                                 python=sys.executable, ready_timeout=60)
            c.start()
            colls.append(c)
        go = ctx.Event()
        stop_at = ctx.Value("d", time.time() + 3600)
        sent = [ctx.Value("q", 0) for _ in range(n)]
        for k in range(n):
            p = ctx.Process(target=generator, args=(colls[k].config.socket_path, k, tag, args.batch_rows, go,
                                                    stop_at, sent[k]))
            p.start()
            gens.append(p)
        time.sleep(2.0)  # spawn + connect + handshake, outside every window
        urls = [c.http_url for c in colls]
        go.set()
        stop_at.value = time.time() + args.warmup + args.duration + 0.5
        time.sleep(args.warmup)
        pg_pid = servers.postmaster_pid()
        groups = {"collectors": [c.proc.pid for c in colls], "generators": [g.pid for g in gens],
                  "postgres": [pg_pid]}
        if moto is not None and moto._proc is not None:
            groups["moto"] = [moto._proc.pid]
        import psutil

        load0 = os.getloadavg()[0]
        sys0 = psutil.cpu_times()
        cpu0 = {g: cpu_s(p) for g, p in groups.items()}
        m0 = [scrape(u) for u in urls]
        t0 = time.perf_counter()
        time.sleep(args.duration)
        try:
            m1 = [scrape(u) for u in urls]
        except OSError as e:
            time.sleep(1)
            rcs = [c.proc.poll() for c in colls]
            tails = []
            for k in range(n):
                try:
                    tails.append(Path(trial_dir, f"collector{k}.log").read_text(errors="replace")
                                 .strip().splitlines()[-1][:200])
                except (OSError, IndexError):
                    tails.append("")
            raise RuntimeError(f"/metrics unreachable ({e}); collector exit codes {rcs}; last log lines {tails}") from e
        t1 = time.perf_counter()
        cpu1 = {g: cpu_s(p) for g, p in groups.items()}
        sys1 = psutil.cpu_times()
        window = t1 - t0
        for p in gens:
            p.join(60)
        rcs = [c.stop(timeout=120) for c in colls]
        colls = []

        def delta(name: str) -> float:
            return sum(b["sums"].get(name, 0.0) for b in m1) - sum(a["sums"].get(name, 0.0) for a in m0)

        committed = delta("kvfabric_ingest_rows_total")
        commits = delta("kvfabric_insert_duration_seconds_count")
        busy = sum(getattr(sys1, f) - getattr(sys0, f) for f in ("user", "system", "nice", "irq", "softirq", "steal"))
        idle = (sys1.idle - sys0.idle) + (getattr(sys1, "iowait", 0) - getattr(sys0, "iowait", 0))
        steal = getattr(sys1, "steal", 0) - getattr(sys0, "steal", 0)
        events, stream_rows = lake_readback(catalog, data)
        result.update({
            "window_s": window,
            "events_per_s": committed / window,
            "commits": commits,
            "commits_per_s": commits / window,
            "rows_per_commit": committed / commits if commits else float("nan"),
            "conflicts": delta("kvfabric_lake_commit_conflicts_total"),
            "storage_errors": delta("kvfabric_storage_errors_total"),
            "lag_p50_le": lag_quantile([a["lag"] for a in m0], [b["lag"] for b in m1], 0.5),
            "lag_p99_le": lag_quantile([a["lag"] for a in m0], [b["lag"] for b in m1], 0.99),
            "cpu_cores": {g: (cpu1[g] - cpu0[g]) / window for g in groups},
            "machine_busy_cores": busy / window,
            "machine_idle_cores": idle / window,
            "steal_cores": steal / window,
            "other_processes_cores": busy / window - sum((cpu1[g] - cpu0[g]) / window for g in groups),
            "loadavg_1m_at_start": load0,
            "lake_events_after_stop": events,
            "streams_rows_after_stop": stream_rows,
            "readback_ok": events == stream_rows and events >= committed,
            "batches_sent": sum(s.value for s in sent),
            "collector_exit_codes": rcs,
        })
        conflicts_in_logs = 0
        for k in range(n):
            try:
                text = Path(trial_dir, f"collector{k}.log").read_text(errors="replace")
            except OSError:
                continue
            conflicts_in_logs += text.count("storage failing")
        result["storage_failing_log_lines"] = conflicts_in_logs
    finally:
        for p in gens:
            if p.is_alive():
                p.kill()
        for c in colls:
            c.kill()
        if moto is not None:
            moto.close()
        os.environ.clear()
        os.environ.update(saved_env)
        if not args.keep:
            shutil.rmtree(trial_dir, ignore_errors=True)
    return result


def part_writers(args: argparse.Namespace, out: dict[str, Any]) -> None:
    counts = [int(x) for x in args.writers.split(",")]
    backends = [b for b in args.backends.split(",") if b]
    root = tempfile.mkdtemp(prefix="kvf-fleet-w-", dir=args.work_dir)
    servers = Servers()
    trials: list[dict[str, Any]] = out.setdefault("writer_trials", [])
    sweep: list[dict[str, Any]] = out.setdefault("coalesce_trials", [])
    settings = [tuple(int(v) for v in s.split(":")) for s in args.coalesce_sweep.split(",") if s]
    plan: list[tuple[str, int, int, tuple[int, int] | None]] = []
    for rep in range(args.reps):
        for backend in backends:
            for n in counts:
                plan.append((backend, n, rep, None))
    for rep in range(args.sweep_reps):
        for st in settings:
            plan.append(("local", args.sweep_collectors, rep, st))
    try:
        for i, (backend, n, rep, st) in enumerate(plan, 1):
            label = (f"{backend} N={n} rep {rep + 1}" if st is None
                     else f"coalesce {st[0]} rows/{st[1]} ms, local N={n} rep {rep + 1}")
            log(f"writers [{i}/{len(plan)}] {label} ...")
            try:
                r = writer_trial(servers, root, backend, n, f"t{i}", args, st)
            except Exception as e:  # a collector died mid-trial: recorded, the other trials still run
                msg = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
                log(f"   trial FAILED: {msg}")
                out.setdefault("failed_trials", []).append({"backend": backend, "collectors": n, "rep": rep,
                                                            "coalesce": st, "error": msg})
                save(out, args)
                continue
            r["rep"] = rep
            (trials if st is None else sweep).append(r)
            cc = r["cpu_cores"]
            log(f"   {r['events_per_s'] / 1e6:.3f} M events/s, {r['commits_per_s']:.2f} commits/s, "
                f"{r['conflicts']:.0f} conflicts, lag p99 <= {r['lag_p99_le']:g} s; CPU cores: "
                + ", ".join(f"{g} {v:.2f}" for g, v in cc.items())
                + f", machine busy {r['machine_busy_cores']:.2f}; readback "
                + ("ok" if r["readback_ok"] else f"MISMATCH events {r['lake_events_after_stop']} "
                   f"streams.rows {r['streams_rows_after_stop']}"))
            save(out, args)
    finally:
        servers.close()
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


# ============================================================================================ part 2: queries

def gen_select(a: int, b: int, n_total: int) -> str:
    """Rows a..b-1 of an n_total-row lake: every EVENT_SCHEMA column, deterministic from the row number."""
    ev_cases = []
    acc = 0
    for name, w in EVENT_MIX:
        acc += round(w * 1000)
        ev_cases.append(f"WHEN u < {acc} THEN '{name}'")
    ev = "CASE " + " ".join(ev_cases[:-1]) + f" ELSE '{EVENT_MIX[-1][0]}' END"
    run_cases = []
    acc = 0
    for name, pct in RUNS[:-1]:
        acc += pct
        run_cases.append(f"WHEN h % 100 < {acc} THEN '{name}'")
    run = "CASE " + " ".join(run_cases) + f" ELSE '{RUNS[-1][0]}' END"
    blk = "(i // 16)"  # a block's events (allocated, sealed, touched, ..., evicted) share its hash
    return f"""
WITH base AS (
    SELECT i, h, ((h >> 8) % 1000)::INTEGER AS u FROM (SELECT range AS i, hash(range) AS h FROM range({a}, {b}))
), r AS (SELECT *, {ev} AS event FROM base)
SELECT
    (i // 4096)::BIGINT AS seq,
    ({T0_NS} + i * {max(1, SPAN_NS // n_total)})::BIGINT AS ts_ns,
    (i // 64)::BIGINT AS step,
    'engine-' || (i % {ENGINES}) AS engine,
    {run} AS run_id,
    event,
    'cmpl-' || lpad(to_hex(i // 20), 12, '0') || '-0' AS request_id,
    CASE WHEN event NOT IN ('prefix_lookup', 'eviction_candidates_ranked') THEN ((h >> 20) % 200000)::INTEGER END
        AS block_id,
    CASE WHEN event NOT IN ('prefix_lookup', 'eviction_candidates_ranked')
        THEN ((hash({blk}) >> 1)::BIGINT - 4611686018427387904) END AS block_hash,
    CASE WHEN event NOT IN ('prefix_lookup', 'eviction_candidates_ranked') AND {blk} % 32 <> 0
        THEN ((hash({blk} - 1) >> 1)::BIGINT - 4611686018427387904) END AS parent_hash,
    lpad(to_hex((h >> 44) % 40), 16, '0') AS family,
    CASE WHEN event NOT IN ('prefix_lookup', 'eviction_candidates_ranked') THEN ({blk} % 32)::INTEGER END AS depth,
    CASE WHEN event NOT IN ('prefix_lookup', 'eviction_candidates_ranked') THEN ((h >> 30) % 4)::INTEGER END
        AS ref_count,
    CASE WHEN event NOT IN ('prefix_lookup', 'eviction_candidates_ranked') THEN ((h >> 33) % 8)::INTEGER END
        AS hit_count,
    CASE WHEN event NOT IN ('prefix_lookup', 'eviction_candidates_ranked') THEN ((h >> 36) % 4)::INTEGER END
        AS share_degree,
    CASE WHEN event NOT IN ('prefix_lookup', 'eviction_candidates_ranked') THEN ((h >> 39) % 3)::INTEGER END
        AS branch_factor,
    CASE WHEN event = 'prefix_lookup' THEN (100 + (h >> 12) % 7900)::INTEGER END AS prompt_tokens,
    CASE WHEN event = 'prefix_lookup' THEN least(100 + (h >> 12) % 7900, (h >> 26) % 4000)::INTEGER END
        AS hit_tokens,
    CASE WHEN event NOT IN ('prefix_lookup', 'eviction_candidates_ranked') THEN ((h >> 16) % 1000000) / 1e6 END
        AS retain_score,
    CASE WHEN event NOT IN ('prefix_lookup', 'eviction_candidates_ranked') THEN (h >> 50) % 5 = 0 END AS protected,
    'lru' AS policy,
    CASE WHEN event IN ('prefix_lookup', 'eviction_candidates_ranked') THEN ((h >> 52) % 64)::BIGINT END AS "count",
    CASE WHEN event IN ('block_evicted', 'block_rebuilt') THEN ((h >> 10) % 10000000000)::BIGINT END AS age_ns,
    CASE WHEN event = 'block_evicted' THEN (CASE WHEN (h >> 55) % 100 < 94 THEN 'pressure'
        WHEN (h >> 55) % 100 < 99 THEN 'connector' ELSE 'reset' END) END AS reason,
    'host-' || (i % {ENGINES}) AS host,
    0::INTEGER AS dp_rank,
    NULL::VARCHAR AS tenant,
    NULL::VARCHAR AS lora
FROM r
"""


def streams_rows() -> Any:
    from kvfabric.ingest.store import StreamState, streams_table

    states = []
    for run, _ in RUNS:
        for e in range(ENGINES):
            states.append(StreamState(
                stream_id=f"{run}/engine-{e}", run_id=run, engine=f"engine-{e}", vllm_version=None, block_size=16,
                num_blocks=200_000, policy="lru", settings=None, schema_version=S.SCHEMA_VERSION, peer="bench_fleet",
                first_seen_ns=T0_NS, last_seen_ns=T0_NS + SPAN_NS, connections=1, first_ts_ns=T0_NS,
                last_ts_ns=T0_NS + SPAN_NS, host=f"host-{e}", dp_rank=0,
            ))
    return streams_table(states)


def free_gb(path: str) -> float:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize / 1e9


def generate(con: duckdb.DuckDBPyConnection, lake: bool, n_total: int, chunk: int, budget_s: float,
             label: str, data_dir: str, min_free_gb: float) -> dict[str, Any]:
    """Fill ``events`` with n_total rows in chunks, each its own transaction; stops early (honestly reported)
    when the time budget or the disk would run out."""
    from kvfabric.ingest.backend import DAY_SQL

    cols = ", ".join(f'"{c}"' for c in S.COLUMNS)
    t0 = time.perf_counter()
    done = 0
    stopped = None
    while done < n_total:
        b = min(n_total, done + chunk)
        sel = gen_select(done, b, n_total)
        if lake:
            sql = f"INSERT INTO events ({cols}, day) SELECT {cols}, {DAY_SQL} FROM ({sel})"
        else:
            sql = f"INSERT INTO events ({cols}) SELECT {cols} FROM ({sel})"
        con.execute(sql)
        done = b
        el = time.perf_counter() - t0
        rate = done / el
        log(f"   {label}: {done:,}/{n_total:,} rows ({100 * done / n_total:.0f}%), {rate / 1e6:.2f} M rows/s, "
            f"ETA {(n_total - done) / rate:.0f} s, {free_gb(data_dir):.1f} GB free")
        if done < n_total:
            if el + chunk / rate > budget_s:
                stopped = f"time budget {budget_s:.0f} s would be exceeded by the next chunk"
                break
            per_row = (du_bytes(data_dir) / done) if done else 0
            if free_gb(data_dir) - per_row * chunk * 1.3 / 1e9 < min_free_gb:
                stopped = f"disk: the next chunk would leave < {min_free_gb:g} GB free"
                break
    tbl = streams_rows()
    con.register("_kvf_streams", tbl)
    # A lake's ``streams`` is a view over the append-only ``stream_log`` (kvfabric.ingest.backend, since 45a3ea4).
    con.execute(f"INSERT INTO {'stream_log' if lake else 'streams'} SELECT * FROM _kvf_streams")
    con.unregister("_kvf_streams")
    if not lake:
        con.execute("CHECKPOINT")
    return {"rows": done, "target_rows": n_total, "gen_s": time.perf_counter() - t0, "stopped_early": stopped}


def copy_from_lake(con: duckdb.DuckDBPyConnection, lake: Any, label: str) -> dict[str, Any]:
    """The DuckDB file gets the very rows of the lake of the same size (read in the lake's file order, so the
    file's rows are grouped by run/engine/day partition rather than interleaved as a live collector writes them)."""
    from kvfabric.lake import load_extensions

    t0 = time.perf_counter()
    load_extensions(con, lake.extensions())
    con.execute(lake.attach_sql(read_only=True).replace(" AS lake ", " AS src "))
    cols = ", ".join(f'"{c}"' for c in S.COLUMNS)
    con.execute(f"INSERT INTO events ({cols}) SELECT {cols} FROM src.events")
    con.execute("INSERT INTO streams SELECT * FROM src.streams")
    con.execute("DETACH src")
    con.execute("CHECKPOINT")
    n = con.execute("SELECT count(*) FROM events").fetchone()[0]
    log(f"   {label}: copied {n:,} rows from the lake in {time.perf_counter() - t0:.0f} s")
    return {"rows": int(n), "target_rows": int(n), "gen_s": time.perf_counter() - t0, "stopped_early": None,
            "filled_from": "the lake of the same size (INSERT ... SELECT FROM the attached lake)"}


def du_bytes(path: str) -> int:
    total = 0
    if os.path.isfile(path):
        return os.path.getsize(path)
    for dp, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(dp, f))
            except OSError:
                pass
    return total


def drop_page_cache(path: str) -> int:
    """posix_fadvise(DONTNEED) on every file under ``path`` (or the file): the next read comes from disk."""
    files = [path] if os.path.isfile(path) else [os.path.join(dp, f) for dp, _, fs in os.walk(path) for f in fs]
    n = 0
    for p in files:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fdatasync(fd)
        except OSError:
            pass
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            n += 1
        finally:
            os.close(fd)
    return n


def time_queries(runner: Any, drop_path: str, reps: int, evict_run: str) -> dict[str, Any]:
    queries = {
        "run_summary": lambda: runner.run_summary(QUERY_RUN),
        "families": lambda: runner.families(QUERY_RUN),
        "evictions": lambda: runner.evictions(evict_run, limit=1000),
    }
    out: dict[str, Any] = {}
    for name, fn in queries.items():
        drop_page_cache(drop_path)
        t = time.perf_counter()
        try:
            res = fn()
            cold = time.perf_counter() - t
            err = None
        except Exception as e:  # recorded, not fatal: the other queries still run
            cold, res, err = time.perf_counter() - t, None, f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        n_warm = 0 if err else (reps if cold < 10 else 2 if cold < 60 else 1)
        warm = []
        for _ in range(n_warm):
            t = time.perf_counter()
            fn()
            warm.append(time.perf_counter() - t)
        shape = None
        if isinstance(res, list):
            shape = f"{len(res)} rows"
        elif isinstance(res, dict) and "items" in res:
            shape = f"{len(res['items'])} items"
        elif isinstance(res, dict):
            shape = f"events {res.get('events')}"
        out[name] = {"cold_s": cold, "warm": med_range(warm), "warm_all": warm, "error": err, "result": shape}
        log(f"   {name}: cold {cold:.2f} s, warm median {out[name]['warm']['median']:.2f} s "
            f"({len(warm)} reps){'; ' + err if err else ''}; {shape}")
    return out


def part_queries(args: argparse.Namespace, out: dict[str, Any]) -> None:
    from kvfabric.ingest.backend import Backend
    from kvfabric.ingest.store import open_database
    from kvfabric.lake import LakeLocation
    from kvfabric.queries.runner import QueryRunner
    from kvfabric.queries.sources import connector

    root = tempfile.mkdtemp(prefix="kvf-fleet-q-", dir=args.work_dir)
    res: dict[str, Any] = out.setdefault("queries", {})
    res["free_gb_at_start"] = free_gb(root)
    res["query_run"] = QUERY_RUN
    res["runs"] = RUNS
    res["engines"] = ENGINES
    log(f"queries: {res['free_gb_at_start']:.1f} GB free under {root}")
    servers = Servers() if args.lake_sizes else None
    try:
        # Smallest lake first; the DuckDB file is then filled from the lake of the same size (same rows; generating
        # it with the SQL generator runs at ~0.2 M rows/s here), before that lake is deleted; then bigger lakes.
        sizes = sorted(int(float(x)) for x in args.lake_sizes.split(",") if x)
        fsize = int(float(args.file_size)) if args.file_size else None
        targets: list[tuple[str, int]] = []
        for n in sizes:
            targets.append(("lake", n))
            if fsize == n:
                targets.append(("file", n))
        if fsize is not None and fsize not in sizes:
            targets.insert(0, ("file", fsize))
        source_lake: dict[int, tuple[Any, str]] = {}
        for kind, n in targets:
            key = f"{kind}_{n:.0e}".replace("+", "")
            log(f"queries: {kind} of {n:,} rows: generating ...")
            path = os.path.join(root, key)
            if kind == "file":
                db = path + ".duckdb"
                con = open_database(db)
                if n in source_lake:
                    gen = copy_from_lake(con, source_lake[n][0], key)
                else:
                    gen = generate(con, False, n, args.chunk_rows, args.gen_budget_s, key, root, args.min_free_gb)
                con.close()
                lake = None
                drop_path = db
            else:
                assert servers is not None
                catalog = servers.catalog("q")
                lake = LakeLocation.parse(catalog, path)
                con = Backend(db_path="", lake=lake).open()
                gen = generate(con, True, n, args.chunk_rows, args.gen_budget_s, key, root, args.min_free_gb)
                nfiles = con.execute("SELECT count(*) FROM ducklake_list_files('lake', 'events')").fetchone()[0]
                gen["data_files"] = int(nfiles)
                con.close()
                db = ""
                drop_path = path
            gen["bytes"] = du_bytes(drop_path)
            gen["bytes_per_row"] = gen["bytes"] / max(1, gen["rows"])
            log(f"   generated {gen['rows']:,} rows in {gen['gen_s']:.0f} s, {gen['bytes'] / 1e9:.1f} GB"
                + (f"; stopped early: {gen['stopped_early']}" if gen["stopped_early"] else ""))
            runner = QueryRunner(connector(db, lake), timeout_s=args.query_timeout)
            c = connector(db, lake)()
            try:
                gen["query_run_rows"] = int(c.execute("SELECT count(*) FROM events WHERE run_id = ?",
                                                      [QUERY_RUN]).fetchone()[0])
                gen["query_run_evictions"] = int(c.execute(
                    "SELECT count(*) FROM events WHERE run_id = ? AND event = 'block_evicted'",
                    [QUERY_RUN]).fetchone()[0])
            finally:
                c.close()
            log(f"   {QUERY_RUN} holds {gen['query_run_rows']:,} rows; timing queries ...")
            timings = time_queries(runner, drop_path, args.query_reps, QUERY_RUN)
            res[key] = {"kind": kind, "catalog": "postgres" if kind == "lake" else None, **gen, "timings": timings}
            save(out, args)
            if kind == "lake" and fsize == n:
                source_lake[n] = (lake, path)
                continue  # deleted once the file has been filled from it
            if kind == "file" and n in source_lake and not args.keep:
                shutil.rmtree(source_lake.pop(n)[1], ignore_errors=True)
            if not args.keep:
                shutil.rmtree(path, ignore_errors=True)
                for p in (path + ".duckdb", path + ".duckdb.wal"):
                    if os.path.exists(p):
                        os.remove(p)
    finally:
        if servers is not None:
            servers.close()
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


# ============================================================================================ report

def save(out: dict[str, Any], args: argparse.Namespace) -> None:
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    Path(args.md).write_text(render(out))


def fmt(x: float, spec: str = ".2f") -> str:
    return "-" if x is None or x != x else format(x, spec)


def rng_txt(d: dict[str, float], scale: float = 1.0, spec: str = ".2f") -> str:
    if not d or d.get("n", 0) == 0:
        return "-"
    return f"{fmt(d['median'] * scale, spec)} ({fmt(d['min'] * scale, spec)}-{fmt(d['max'] * scale, spec)})"


def summarize_writers(trials: list[dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for backend in sorted({t["backend"] for t in trials}):
        by_n: dict[int, list[dict[str, Any]]] = {}
        for t in trials:
            if t["backend"] == backend:
                by_n.setdefault(t["collectors"], []).append(t)
        rows = {}
        for n, ts in sorted(by_n.items()):
            rows[n] = {
                "events_per_s": med_range([t["events_per_s"] for t in ts]),
                "commits_per_s": med_range([t["commits_per_s"] for t in ts]),
                "conflicts_per_s": med_range([t["conflicts"] / t["window_s"] for t in ts]),
                "conflicts": med_range([t["conflicts"] for t in ts]),
                "conflicts_per_commit": med_range([t["conflicts"] / t["commits"] if t["commits"] else float("nan")
                                                   for t in ts]),
                "storage_errors": sum(t["storage_errors"] for t in ts),
                "lag_p99_le": med_range([t["lag_p99_le"] for t in ts]),
                "collector_cores": med_range([t["cpu_cores"]["collectors"] for t in ts]),
                "generator_cores": med_range([t["cpu_cores"]["generators"] for t in ts]),
                "postgres_cores": med_range([t["cpu_cores"]["postgres"] for t in ts]),
                "moto_cores": med_range([t["cpu_cores"].get("moto", float("nan")) for t in ts]),
                "machine_busy_cores": med_range([t["machine_busy_cores"] for t in ts]),
                "cpu_s_per_m_rows": med_range([t["cpu_cores"]["collectors"] / t["events_per_s"] * 1e6
                                               if t["events_per_s"] else float("nan") for t in ts]),
                "readback_ok": all(t["readback_ok"] for t in ts),
                "reps": len(ts),
            }
        ratio = None
        if 1 in by_n and 3 in by_n:
            one = [t["events_per_s"] for t in by_n[1]]
            three = [t["events_per_s"] for t in by_n[3]]
            # Pair each rep's 3-writer result with the 1-writer result of the same rep (interleaved, so they ran
            # next to each other); the spread is min/max over those pairs, and over all cross pairs.
            reps1 = {t["rep"]: t["events_per_s"] for t in by_n[1]}
            paired = [t["events_per_s"] / reps1[t["rep"]] for t in by_n[3] if reps1.get(t["rep"])]
            cross = [b / a for a in one for b in three if a]
            r = med_range(paired)
            lo, hi = min(cross), max(cross)
            verdict = ("met" if lo >= 2.5 else "not met" if hi < 2.5 else "undecided")
            ratio = {"paired": r, "cross_min": lo, "cross_max": hi,
                     "median_ratio": statistics.median(three) / statistics.median(one), "verdict": verdict}
        summary[backend] = {"by_n": rows, "ratio_3_over_1": ratio}
    return summary


def render(out: dict[str, Any]) -> str:
    m = out.get("machine", {})
    lines = [
        "# Fleet benchmark: collectors writing one lake, queries on big lakes",
        "",
        "Rendered by `benchmarks/bench_fleet.py` from `benchmarks/results/fleet.json`; do not edit by hand.",
        "",
        f"Command: `{out.get('command', '?')}`  ",
        f"Machine: {m.get('cores')} cores ({m.get('cpu')}), {m.get('ram_gib')} GiB RAM, Python {m.get('python')}, "
        f"DuckDB {m.get('duckdb')}, pyarrow {m.get('pyarrow')}, {m.get('platform')}  ",
        f"Started {out.get('started', '?')}, finished {out.get('finished', '(running)')}.",
        "",
    ]
    p = out.get("params", {})
    trials = out.get("writer_trials", [])
    if trials:
        summ = summarize_writers(trials)
        out["writer_summary"] = summ
        lines += [
            "## Writers: N collectors, one lake (PostgreSQL catalog)",
            "",
            f"Each collector has its own socket and its own load generator process (one stream, {p.get('batch_rows')}"
            f"-row batches of the real schema, unpaced); collector defaults except the lake "
            f"(coalesce {p.get('coalesce_rows')} rows / {p.get('coalesce_ms')} ms). Per trial: fresh lake, "
            f"{p.get('warmup')} s warm-up, then a {p.get('duration')} s window measured from /metrics. "
            f"Configurations interleaved (1,2,3,1,2,3,...), {p.get('reps')} reps; median (min-max). "
            "CPU in cores (1.00 = one core busy for the whole window); PostgreSQL includes its backends.",
            "",
            "| data | N | M events/s committed | commits/s | rows/commit (M) | conflicts (retries) per s | "
            "conflicts / commit | lag p99 (bucket <=, s) | collectors CPU | generators CPU | PostgreSQL CPU | "
            "moto CPU | machine busy | collector CPU s / M rows | readback |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for backend, s in summ.items():
            for n, r in s["by_n"].items():
                rpc = med_range([t["rows_per_commit"] for t in trials
                                 if t["backend"] == backend and t["collectors"] == n])
                lines.append(
                    f"| {backend} | {n} | {rng_txt(r['events_per_s'], 1e-6, '.3f')} | {rng_txt(r['commits_per_s'])} | "
                    f"{rng_txt(rpc, 1e-6, '.3f')} | {rng_txt(r['conflicts_per_s'])} | "
                    f"{rng_txt(r['conflicts_per_commit'])} | {rng_txt(r['lag_p99_le'], 1, 'g')} | "
                    f"{rng_txt(r['collector_cores'])} | {rng_txt(r['generator_cores'])} | "
                    f"{rng_txt(r['postgres_cores'])} | {rng_txt(r['moto_cores'])} | "
                    f"{rng_txt(r['machine_busy_cores'])} | {rng_txt(r['cpu_s_per_m_rows'])} | "
                    f"{'ok' if r['readback_ok'] else 'MISMATCH'} |")
        lines += ["", "Scaling, 3 collectors / 1 collector (target >= 2.5x):", ""]
        for backend, s in summ.items():
            r = s["ratio_3_over_1"]
            if r:
                lines.append(
                    f"- {backend}: {r['median_ratio']:.2f}x (ratio of medians); per rep {rng_txt(r['paired'])}; "
                    f"over all 1x3 pairs {r['cross_min']:.2f}-{r['cross_max']:.2f}x: target **{r['verdict']}**.")
        others = med_range([t.get("other_processes_cores", float("nan")) for t in trials])
        lines += ["", "CPU taken by processes outside this benchmark (other work on the shared machine) during the "
                  f"windows: {rng_txt(others)} cores, median (min-max) over all trials."]
        for f in out.get("failed_trials", []):
            lines.append(f"\nFailed trial: {f['backend']} N={f['collectors']} rep {f['rep'] + 1}"
                         f"{' coalesce ' + str(f['coalesce']) if f.get('coalesce') else ''}: {f['error']}")
        errs = sum(t["storage_errors"] for t in trials)
        lines += ["", f"Storage errors (a commit that exhausted its conflict retries) over all trials: {errs:.0f}."]
        lines += ["", "Every trial, per run (M events/s, conflicts, lag p99 <=):", ""]
        for t in trials:
            lines.append(f"- {t['backend']} N={t['collectors']} rep {t['rep'] + 1}: {t['events_per_s'] / 1e6:.3f}, "
                         f"{t['conflicts']:.0f}, {fmt(t['lag_p99_le'], 'g')} s")
    sweep = out.get("coalesce_trials", [])
    if sweep:
        lines += [
            "",
            f"## Coalescing: --coalesce-rows / --coalesce-ms with {sweep[0]['collectors']} collectors, local data",
            "",
            "| coalesce rows | coalesce ms | M events/s | commits/s | conflicts per s | conflicts / commit | "
            "lag p99 (<=, s) | collectors CPU | PostgreSQL CPU |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        keys = sorted({(t["coalesce_rows"], t["coalesce_ms"]) for t in sweep})
        for cr, cm in keys:
            ts = [t for t in sweep if (t["coalesce_rows"], t["coalesce_ms"]) == (cr, cm)]
            lines.append(
                f"| {cr} | {cm} | {rng_txt(med_range([t['events_per_s'] for t in ts]), 1e-6, '.3f')} | "
                f"{rng_txt(med_range([t['commits_per_s'] for t in ts]))} | "
                f"{rng_txt(med_range([t['conflicts'] / t['window_s'] for t in ts]))} | "
                f"{rng_txt(med_range([t['conflicts'] / t['commits'] if t['commits'] else float('nan') for t in ts]))}"
                f" | {rng_txt(med_range([t['lag_p99_le'] for t in ts]), 1, 'g')} | "
                f"{rng_txt(med_range([t['cpu_cores']['collectors'] for t in ts]))} | "
                f"{rng_txt(med_range([t['cpu_cores']['postgres'] for t in ts]))} |")
    q = out.get("queries")
    if q:
        lines += [
            "",
            "## Queries through kvfabric's QueryRunner",
            "",
            f"Generated with the real schema: {len(q.get('runs', []))} runs "
            f"({', '.join(f'{r} {pct}%' for r, pct in q.get('runs', []))} of the rows), {q.get('engines')} engines, "
            "40 families, 3 days; event mix as the ingest benchmark (block events ~89%, prefix_lookup 5%, "
            "block_evicted 8%, block_rebuilt 3%); a block's events share its hash. Lakes: PostgreSQL catalog, "
            "local Parquet data, made through `Backend(...).open()`. Queries ask for the largest run, "
            f"`{q.get('query_run')}`. Cold: data files dropped from the page cache (posix_fadvise DONTNEED) "
            "before the call (every QueryRunner call opens a fresh DuckDB instance, so no DuckDB cache survives "
            "either); warm: median (min-max) of the repeats. Targets: run summary and families <= 2 s at 1e8, "
            "<= 10 s at 1e9 rows.",
            "",
            "| store | rows (target) | rows of the run | GB on disk | bytes/row | files | generation s | "
            "run_summary cold / warm s | families cold / warm s | evictions page 1 cold / warm s |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for d in q.values():
            if not isinstance(d, dict) or "timings" not in d:
                continue

            def cell(name: str, tm: dict[str, Any] = d["timings"]) -> str:
                x = tm.get(name, {})
                if x.get("error"):
                    return f"{fmt(x['cold_s'])} FAILED: {x['error'][:80]}"
                return f"{fmt(x['cold_s'])} / {rng_txt(x['warm'])}"

            label = "DuckDB file" if d["kind"] == "file" else "lake (PostgreSQL catalog, local data)"
            lines.append(
                f"| {label} | {d['rows']:,} ({d['target_rows']:.0e}) | {d.get('query_run_rows', 0):,} | "
                f"{d['bytes'] / 1e9:.1f} | {d['bytes_per_row']:.1f} | {d.get('data_files', '-')} | "
                f"{d['gen_s']:.0f} | {cell('run_summary')} | {cell('families')} | {cell('evictions')} |")
            if d.get("stopped_early"):
                lines.append(f"|  | generation stopped early: {d['stopped_early']} | | | | | | | | |")
        lines += [""]
        verdicts = query_verdicts(q)
        for v in verdicts:
            lines.append(f"- {v}")
    notes = out.get("notes")
    if notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    lines.append("")
    return "\n".join(lines)


def query_verdicts(q: dict[str, Any]) -> list[str]:
    out = []
    for d in q.values():
        if not isinstance(d, dict) or "timings" not in d or d["kind"] != "lake":
            continue
        limit = 2.0 if d["target_rows"] <= 1e8 else 10.0
        for name in ("run_summary", "families"):
            x = d["timings"][name]
            warm = x["warm"]["median"] if x["warm"].get("n") else float("nan")
            worst = max(x["cold_s"], warm) if warm == warm else x["cold_s"]
            ok = x["error"] is None and worst <= limit
            out.append(f"lake {d['rows']:,} rows, {name}: cold {fmt(x['cold_s'])} s, warm {fmt(warm)} s vs "
                       f"<= {limit:g} s: target **{'met' if ok else 'not met'}**"
                       + (f" (only {d['rows']:,} of {d['target_rows']:,} rows generated)"
                          if d["rows"] < d["target_rows"] else ""))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=("writers", "queries", "both"), default="both")
    g = ap.add_argument_group("writers")
    g.add_argument("--writers", default="1,2,3", help="collector counts (default: %(default)s)")
    g.add_argument("--backends", default="local,s3",
                   help="lake data: local folder and/or moto S3 (default: %(default)s)")
    g.add_argument("--reps", type=int, default=3,
                   help="repeats of each configuration, interleaved (default: %(default)s)")
    g.add_argument("--warmup", type=float, default=4.0, help="seconds before the window (default: %(default)s)")
    g.add_argument("--duration", type=float, default=15.0, help="measured window, seconds (default: %(default)s)")
    g.add_argument("--batch-rows", type=int, default=4096, help="rows per generator batch (default: %(default)s)")
    g.add_argument("--coalesce-rows", type=int, default=245_760,
                   help="collectors' --coalesce-rows (default: %(default)s)")
    g.add_argument("--coalesce-ms", type=int, default=100, help="collectors' --coalesce-ms (default: %(default)s)")
    g.add_argument("--coalesce-sweep", default="61440:25,245760:100,983040:1000",
                   help="ROWS:MS settings for the coalescing sweep, '' to skip (default: %(default)s)")
    g.add_argument("--sweep-collectors", type=int, default=3, help="collectors in the sweep (default: %(default)s)")
    g.add_argument("--sweep-reps", type=int, default=1, help="repeats of each sweep setting (default: %(default)s)")
    g = ap.add_argument_group("queries")
    g.add_argument("--lake-sizes", default="1e8,1e9", help="rows of the generated lakes (default: %(default)s)")
    g.add_argument("--file-size", default="1e8", help="rows of the DuckDB file, '' to skip (default: %(default)s)")
    g.add_argument("--chunk-rows", type=int, default=25_000_000, help="rows per INSERT (default: %(default)s)")
    g.add_argument("--gen-budget-s", type=float, default=1500,
                   help="generation time cap per store (default: %(default)s)")
    g.add_argument("--min-free-gb", type=float, default=8.0, help="stop generating before free disk drops below")
    g.add_argument("--query-reps", type=int, default=5, help="warm repeats per query (default: %(default)s)")
    g.add_argument("--query-timeout", type=float, default=300, help="QueryRunner timeout, s (default: %(default)s)")
    ap.add_argument("--work-dir", default=os.environ.get("KVF_BENCH_DIR", "/tmp"),
                    help="temp data (default: %(default)s)")
    ap.add_argument("--keep", action="store_true", help="keep temp data (debugging)")
    ap.add_argument("--json", default=str(RESULTS / "fleet.json"))
    ap.add_argument("--md", default=str(RESULTS / "fleet.md"))
    ap.add_argument("--render", action="store_true", help="only re-render --md from --json")
    ap.add_argument("--note", action="append", default=[], help="a note to print under the tables (repeatable)")
    args = ap.parse_args()

    if args.render:
        out = json.loads(Path(args.json).read_text())
        if args.note:
            out["notes"] = args.note
            Path(args.json).write_text(json.dumps(out, indent=1, default=str))
        Path(args.md).write_text(render(out))
        print(f"wrote {args.md}")
        return 0
    command = "python benchmarks/bench_fleet.py " + " ".join(sys.argv[1:])
    previous: dict[str, Any] = {}
    if args.part != "both" and Path(args.json).exists():  # one part re-run: keep the other part's results
        previous = json.loads(Path(args.json).read_text())
    out: dict[str, Any] = {
        "command": command,
        "machine": machine(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "params": {k: v for k, v in vars(args).items() if k not in ("json", "md", "render")},
        "notes": args.note,
    }
    keep = {"writers": ("queries", "command_queries", "params_queries"),
            "queries": ("writer_trials", "coalesce_trials", "failed_trials", "writer_summary", "command_writers",
                        "params_writers")}.get(args.part, ())
    for k in keep:
        if k in previous:
            out[k] = previous[k]
    if args.part != "both":
        out[f"command_{args.part}"] = command
        out[f"params_{args.part}"] = out["params"]
        out["command"] = " ; ".join(out[k] for k in ("command_writers", "command_queries") if k in out)
    if args.part in ("writers", "both"):
        part_writers(args, out)
    if args.part in ("queries", "both"):
        part_queries(args, out)
    out["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    save(out, args)
    log(f"wrote {args.json} and {args.md}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
