"""vLLM's KV-event stream into a real collector: throughput, lag and loss at a given rate of block events.

The engine side is this process: vLLM 0.33's own ``ZmqEventPublisher`` (its publisher thread msgpack-encodes and
sends each batch on a PUB socket, and keeps the replay buffer), fed one ``KVEventBatch`` per scheduler step the way
vLLM's EngineCore feeds it: ``BlockStored`` events of 32-block chains (half of them continuing the previous chain,
one in ten re-storing the blocks evicted last, so some are rebuilt) and one ``BlockRemoved`` per evicted block,
in a cache of ``--cache-blocks`` blocks (FIFO eviction). A block event is one hash of a ``BlockStored`` or of a
``BlockRemoved``. The collector is a real ``python -m kvfabric.collector --kv-events ...`` process writing a DuckDB
file, on the same machine (its CPU competes with the publisher's, as on an engine host).

Measured over the run (after ``--warmup`` seconds):
  * lag: the collector's histograms, as ``histogram_quantile`` reads them (linear inside a bucket):
    ``kvfabric_kv_events_lag_seconds`` (receive time - batch ts, live batches) and ``kvfabric_ingest_lag_seconds``
    (commit time - batch ts: the oldest row of each batch);
  * stored events/s: rows committed over the run (the collector's ``kvfabric_ingest_rows_total``), and every stored
    row checked against what was published (sealed = stored blocks, evicted = removed blocks, all seqs present);
  * loss: batches the collector counted lost, and published - stored;
  * CPU: seconds used by the collector process and by this one, per second of run.

    python benchmarks/bench_kv_events.py [--rate 200000] [--seconds 60] [--steps-per-s 100] [--warmup 5]
        [--out benchmarks/results/kv_events]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

import duckdb
import vllm
from prometheus_client.parser import text_string_to_metric_families
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher

from kvfabric.collector import CollectorConfig, CollectorProcess

CHAIN = 32
TOKENS = list(range(16 * CHAIN))  # (one list shared by every event: vLLM sends the tokens, the collector skips them)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Engine:
    """The published side of a cache of ``capacity`` blocks: one batch per step, ``per_step`` block events."""

    def __init__(self, capacity: int, per_step: int) -> None:
        self.capacity = capacity
        self.per_step = per_step
        self.live: deque[int] = deque()
        self.evicted: deque[int] = deque(maxlen=CHAIN * 4)
        self.next_hash = 1
        self.chains = 0
        self.stored = 0
        self.removed = 0

    def step(self) -> KVEventBatch:
        events: list[object] = []
        budget = self.per_step
        while budget > 0:
            n_removed = len(self.live) + CHAIN - self.capacity
            if n_removed > 0:  # get_new_blocks evicts: one BlockRemoved per block, as vLLM emits them
                n_removed = min(n_removed, budget)
                for _ in range(n_removed):
                    h = self.live.popleft()
                    self.evicted.append(h)
                    events.append(BlockRemoved(block_hashes=[h], medium="GPU"))
                self.removed += n_removed
                budget -= n_removed
                continue
            self.chains += 1
            if self.chains % 10 == 0 and len(self.evicted) >= CHAIN:  # the blocks evicted last come back
                hashes = [self.evicted.pop() for _ in range(CHAIN)][::-1]
                parent = None
            else:
                hashes = list(range(self.next_hash, self.next_hash + CHAIN))
                self.next_hash += CHAIN
                parent = self.live[-1] if self.live and self.chains % 2 else None
            events.append(BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=TOKENS,
                                      block_size=16, lora_id=None, medium="GPU", lora_name=None))
            self.live.extend(hashes)
            self.stored += CHAIN
            budget -= CHAIN
        return KVEventBatch(ts=time.time(), events=events)


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def health(url: str) -> dict:
    with urllib.request.urlopen(url + "/healthz", timeout=10) as r:
        return json.loads(r.read())


def quantile(q: float, before: dict, after: dict, name: str, labels: dict[str, str]) -> float | None:
    """``histogram_quantile(q, increase(name_bucket))`` between two scrapes (linear inside the bucket)."""
    buckets = []
    for (sample, lab), v in after.items():
        d = dict(lab)
        if sample != name + "_bucket" or any(d.get(k) != x for k, x in labels.items()):
            continue
        le = float(d["le"])
        buckets.append((le, v - before.get((sample, lab), 0.0)))
    buckets.sort()
    total = buckets[-1][1] if buckets else 0
    if total <= 0:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for le, cum in buckets:
        if cum >= rank:
            if le == float("inf"):
                return lower  # (beyond the last finite bucket: reported as its bound)
            return lower + (le - lower) * (rank - below) / max(cum - below, 1e-12)
        lower, below = le, cum
    return lower


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Result:
    command: str
    machine: dict[str, object]
    rate_target: int
    seconds: float
    steps_per_s: int
    block_events_per_step: int
    published_batches: int = 0
    published_block_events: int = 0
    published_rate: float = 0.0
    publisher_queue_max: int = 0
    stored_rows: int = 0
    stored_rows_per_s: float = 0.0
    stored_batches: int = 0
    lost_batches: int = 0
    lost_by_reason: dict[str, int] = field(default_factory=dict)
    missing_batches: int = 0
    rows_match_published: bool = False
    receive_lag_p50_s: float | None = None
    receive_lag_p99_s: float | None = None
    commit_lag_p50_s: float | None = None
    commit_lag_p99_s: float | None = None
    drain_after_last_s: float = 0.0
    collector_cpu_per_s: float = 0.0
    publisher_process_cpu_per_s: float = 0.0
    target_met: bool = False
    load_average: list[float] = field(default_factory=list)  # 1-minute load before and after (other work on the box)
    timeline: list[dict[str, float]] = field(default_factory=list)
    note: str = ""  # --note: what the numbers alone do not say (variance seen, the machine's other load)


def machine() -> dict[str, object]:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    mem = next(int(line.split()[1]) // 1024 for line in Path("/proc/meminfo").read_text().splitlines()
               if line.startswith("MemTotal"))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    return {"cpu": model, "cores": os.cpu_count(), "memory_mib": mem, "python": platform.python_version(),
            "vllm": vllm.__version__, "duckdb": duckdb.__version__, "kernel": platform.release(), "commit": commit}


def run(args: argparse.Namespace) -> Result:
    per_step = args.rate // args.steps_per_s
    res = Result(command="python " + " ".join(sys.argv), machine=machine(), rate_target=args.rate,
                 seconds=args.seconds, steps_per_s=args.steps_per_s, block_events_per_step=per_step)
    res.load_average.append(os.getloadavg()[0])
    root = tempfile.mkdtemp(prefix="kvf-bench-kv-", dir="/tmp")
    port, replay_port = free_port(), free_port()
    pub = ZmqEventPublisher(0, endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{replay_port}",
                            buffer_steps=args.buffer_steps)
    engine = Engine(args.cache_blocks, per_step)
    spec = f"tcp://127.0.0.1:{port},replay=tcp://127.0.0.1:{replay_port},engine=bench,run=bench"
    config = CollectorConfig(db_path=f"{root}/events.duckdb", socket_path=f"{root}/s/kvf.sock", port=free_port(),
                             kv_events=(spec,))
    collector = CollectorProcess(config, log_path=f"{root}/collector.log")
    try:
        collector.start()
        url = collector.http_url
        assert url is not None and collector.proc is not None
        while health(url)["kv_events"][0]["state"] != "connected":
            time.sleep(0.05)
        time.sleep(0.5)
        interval = 1.0 / args.steps_per_s
        total_steps = int((args.warmup + args.seconds) * args.steps_per_s)
        warm_steps = int(args.warmup * args.steps_per_s)
        start = time.monotonic()
        before: dict = {}
        cpu0 = my_cpu0 = t0 = 0.0
        stored0 = removed0 = 0
        next_sample = start + 1.0
        for i in range(total_steps):
            if i == warm_steps:
                before, t0 = scrape(url), time.monotonic()
                cpu0, my_cpu0 = cpu_seconds(collector.proc.pid), time.process_time()
                stored0, removed0 = engine.stored, engine.removed
            due = start + i * interval
            now = time.monotonic()
            if due > now:
                time.sleep(due - now)
            pub.publish(engine.step())
            res.publisher_queue_max = max(res.publisher_queue_max, pub._event_queue.qsize())
            if now >= next_sample:
                h = health(url)["kv_events"][0]
                res.timeline.append({"t_s": round(now - start, 2), "published_seq": i, "placed_seq": h["last_seq"],
                                     "receive_lag_s": h["lag_s"]})
                next_sample += 1.0
        t_end = time.monotonic()
        res.published_batches = total_steps
        res.published_block_events = engine.stored + engine.removed
        res.published_rate = ((engine.stored - stored0) + (engine.removed - removed0)) / (t_end - t0)
        while True:  # every batch placed and committed
            h = health(url)
            if h["kv_events"][0]["last_seq"] == total_steps - 1 and h["writer_queue_rows"] == 0:
                break
            if time.monotonic() - t_end > 120:
                break
            time.sleep(0.05)
        res.drain_after_last_s = time.monotonic() - t_end
        res.load_average.append(os.getloadavg()[0])
        after = scrape(url)
        res.collector_cpu_per_s = (cpu_seconds(collector.proc.pid) - cpu0) / (t_end - t0)
        res.publisher_process_cpu_per_s = (time.process_time() - my_cpu0) / (t_end - t0)
        lab = {"engine": "bench"}
        res.receive_lag_p50_s = quantile(0.5, before, after, "kvfabric_kv_events_lag_seconds", lab)
        res.receive_lag_p99_s = quantile(0.99, before, after, "kvfabric_kv_events_lag_seconds", lab)
        res.commit_lag_p50_s = quantile(0.5, before, after, "kvfabric_ingest_lag_seconds", {})
        res.commit_lag_p99_s = quantile(0.99, before, after, "kvfabric_ingest_lag_seconds", {})
        rows_key = ("kvfabric_ingest_rows_total", frozenset())
        res.stored_rows_per_s = (after[rows_key] - before[rows_key]) / (t_end - t0)
        for reason in ("gap", "replay_unavailable", "joined_late"):
            key = ("kvfabric_kv_events_lost_batches_total", frozenset({"engine": "bench", "reason": reason}.items()))
            res.lost_by_reason[reason] = int(after.get(key, 0))
        res.lost_batches = sum(res.lost_by_reason.values())
    finally:
        collector.stop()
        pub.shutdown()
    with duckdb.connect(config.db_path, read_only=True) as con:
        res.stored_rows = con.execute("SELECT count(*) FROM events").fetchone()[0]
        res.stored_batches = con.execute("SELECT count(DISTINCT seq) FROM events").fetchone()[0]
        counts = dict(con.execute("SELECT event, count(*) FROM events GROUP BY event").fetchall())
    res.missing_batches = res.published_batches - res.stored_batches
    res.rows_match_published = (res.missing_batches == 0 and counts.get("block_sealed") == engine.stored
                                and counts.get("block_evicted") == engine.removed)
    res.target_met = (res.receive_lag_p99_s is not None and res.commit_lag_p99_s is not None
                      and max(res.receive_lag_p99_s, res.commit_lag_p99_s) <= 1.0 and res.lost_batches == 0
                      and res.rows_match_published and res.published_rate >= 0.97 * args.rate)
    shutil.rmtree(root, ignore_errors=True)
    return res


def markdown(r: Result) -> str:
    def s(v: float | None) -> str:
        return "n/a" if v is None else f"{v * 1000:.0f} ms"

    m = r.machine
    lost = ", ".join(f"{k} {v}" for k, v in r.lost_by_reason.items())
    rows = [
        ("published", f"{r.published_rate:,.0f} block events/s ({r.published_batches:,} batches, "
                      f"{r.published_block_events:,} block events in all)"),
        ("stored", f"{r.stored_rows_per_s:,.0f} rows/s over the run; {r.stored_rows:,} rows, {r.stored_batches:,} "
                   "batches in all"),
        ("stored == published", f"{'yes' if r.rows_match_published else 'NO'} (sealed rows = stored blocks, evicted "
                                "rows = removed blocks, every seq present)"),
        ("lost", f"{r.lost_batches} batches ({lost}); {r.missing_batches} missing from the file"),
        ("receive lag (receive - batch ts)", f"p50 {s(r.receive_lag_p50_s)}, p99 {s(r.receive_lag_p99_s)}"),
        ("commit lag (commit - batch ts)", f"p50 {s(r.commit_lag_p50_s)}, p99 {s(r.commit_lag_p99_s)}"),
        ("drain after the last batch", f"{r.drain_after_last_s:.2f} s"),
        ("CPU", f"collector {r.collector_cpu_per_s:.2f} s/s; publisher process (event generation + vLLM's "
                f"publisher thread) {r.publisher_process_cpu_per_s:.2f} s/s"),
        ("publisher queue (vLLM's, in batches)", f"at most {r.publisher_queue_max}"),
        ("target (lag p99 <= 1 s, nothing lost, rate held)", "met" if r.target_met else "NOT met"),
    ]
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    return f"""# KV-event ingest: vLLM's ZmqEventPublisher -> collector (`--kv-events`)

Command: `{r.command}`

Machine: {m['cpu']}, {m['cores']} cores, {m['memory_mib']} MiB; Python {m['python']}, vLLM {m['vllm']}, DuckDB
{m['duckdb']}, kernel {m['kernel']}, commit {m['commit']}. Publisher (this process) and collector on the same
machine; 1-minute load average before and after: {', '.join(f'{v:.2f}' for v in r.load_average)}.

Load: {r.rate_target:,} block events/s target ({r.steps_per_s} batches/s, {r.block_events_per_step:,} block events
each: 32-block `BlockStored` chains and one `BlockRemoved` per evicted block) for {r.seconds:g} s after warm-up.

| measure | value |
|---|---|
{table}

Lag quantiles are read from the collector's histograms (`kvfabric_kv_events_lag_seconds`,
`kvfabric_ingest_lag_seconds`) the way Prometheus' `histogram_quantile` reads them: linear inside a bucket (bucket
bounds 5, 10, 25, 50, 100, 150, 200, 300, 500, 750, 1000 ms ...), so they are as precise as those bounds. The commit
lag includes the writer's coalescing window (`--coalesce-ms`, 100 ms by default).
{r.note and chr(10) + r.note + chr(10)}"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=int, default=200_000, help="block events per second")
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--warmup", type=float, default=5.0)
    p.add_argument("--steps-per-s", type=int, default=100, help="batches per second (vLLM: one per scheduler step)")
    p.add_argument("--cache-blocks", type=int, default=100_000)
    p.add_argument("--buffer-steps", type=int, default=10_000, help="the publisher's replay buffer")
    p.add_argument("--out", default="benchmarks/results/kv_events", help="writes OUT.json and OUT.md")
    p.add_argument("--note", default="", help="a paragraph added to the report")
    p.add_argument("--render", action="store_true", help="rewrite OUT.md from OUT.json (with --note) and stop")
    args = p.parse_args()
    if args.render:
        res = Result(**json.loads(Path(args.out + ".json").read_text()))
        res.note = args.note or res.note
    else:
        res = run(args)
        res.note = args.note
    Path(args.out + ".json").write_text(json.dumps(asdict(res), indent=1) + "\n")
    Path(args.out + ".md").write_text(markdown(res))
    print(markdown(res))


if __name__ == "__main__":
    main()
