"""``kvfabric demo``: the whole stack on one CPU machine, on embedded defaults.

A real collector process (Unix socket ingest, DuckDB file, REST) is started; vLLM's real Scheduler runs a
built-in workload with memory pressure through a simulated model, with the KVFabric plugin loaded through vLLM's
own ``vllm.general_plugins`` mechanism; the hook streams events to the collector; the report is read back over
REST, the events are exported to Parquet and counted back with DuckDB. With ``--serve`` the same collector keeps
serving afterwards (its ``/metrics`` counters are the ones ingest advanced), on the port printed at the start.

With ``--kv-events`` the engine runs without the plugin and publishes vLLM's own KV events (``--kv-events-config``:
a ZMQ publisher and its replay socket on free ports), the collector subscribes with ``--kv-events``, and the same
report marks what those events cannot tell (docs/kv-events.md). Its evictions and rebuilt-from-eviction equal the
plugin's on the same workload and seed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import urllib.error
import urllib.request
from datetime import datetime
from pathlib import Path
from typing import Any

import duckdb

from kvfabric.argtypes import int_range, port
from kvfabric.collector import CollectorConfig, CollectorProcess
from kvfabric.collector.export import export_parquet
from kvfabric.ingest import defaults as D
from kvfabric.lake import LakeLocation
from kvfabric.policies import POLICY_NAMES
from kvfabric.queries import availability as A
from kvfabric.queries.sources import lake_from_args
from kvfabric.sim.demo_engine import run_with_kv_events, run_with_plugin
from kvfabric.sim.publisher import Published
from kvfabric.sim.workload import DEMO_NUM_BLOCKS, demo_workload
from kvfabric.usage import UsageError

#: The largest KV pool the demo takes (blocks of 16 tokens; the default 640 is what makes the pressure).
MAX_NUM_BLOCKS = 262_144


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--db", default="kvfabric.duckdb", help="DuckDB file to write (default: ./kvfabric.duckdb)")
    parser.add_argument("--lake", default=None, metavar="CATALOG",
                        help="write the run to this DuckLake lake instead of --db (as `kvfabric collector --lake` "
                        "takes it; needs --data)")
    parser.add_argument("--data", default=None, metavar="PATH", help="the lake's data path (folder or s3://...)")
    parser.add_argument("--policy", default="lru", choices=POLICY_NAMES, help="eviction policy (default: lru)")
    parser.add_argument("--serve", action="store_true",
                        help="keep the collector that ingested the run serving its REST API, /docs and /metrics "
                             "after the report, on the same port (Ctrl-C stops it)")
    parser.add_argument("--port", type=port, default=None,
                        help=f"HTTP port of the collector (default: {D.HTTP_PORT}, or a free one if another "
                             f"program listens there; a port given here must be free; 0: any free one)")
    parser.add_argument("--parquet", default="kvfabric-parquet", help="Parquet export directory")
    parser.add_argument("--run-id", default=None, help="run label (default: demo-<policy>-<time>)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (same seed, same run)")
    parser.add_argument("--num-blocks", type=int_range(1, MAX_NUM_BLOCKS), default=None,
                        help="KV pool size in blocks of 16 tokens (default: 640, which puts the workload under "
                             "memory pressure; at least what its longest request needs, which the error names)")
    parser.add_argument("--json", action="store_true", help="print the run summary as JSON at the end")
    parser.add_argument("--kv-events", action="store_true",
                        help="observe the engine through vLLM's own KV-event publisher (--kv-events-config) instead "
                             "of the plugin; the collector subscribes with --kv-events, and the report marks what "
                             "those events cannot tell (no lookups); the engine runs vLLM's own LRU")


# ---- small helpers ---------------------------------------------------------------------------------------------


def _can_bind(port_number: int) -> int | None:
    """The port bound on loopback as the collector binds it (``SO_REUSEADDR``: a port in TIME-WAIT after an earlier
    run is free), or None if another socket holds it. Port 0 gives a free ephemeral port."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((D.HTTP_HOST, port_number))
        except OSError:
            return None
        return int(s.getsockname()[1])


def choose_port(requested: int | None) -> tuple[int, str | None]:
    """The collector's port and, when it is not the one asked for, a note saying why.

    ``requested`` None: :data:`D.HTTP_PORT`, or a free port if another program listens there. A port the user
    asked for is used or refused (:class:`UsageError` naming the address), never swapped silently.
    """
    if requested is not None:
        bound = _can_bind(requested)
        if bound is None:
            raise UsageError(f"--port {requested}: {D.HTTP_HOST}:{requested} is in use (another collector or "
                             f"demo?); pick another port, or 0 for any free one")
        return bound, None
    bound = _can_bind(D.HTTP_PORT)
    if bound is not None:
        return bound, None
    fallback = _can_bind(0)
    if fallback is None:
        raise UsageError(f"no free TCP port on {D.HTTP_HOST}")
    return fallback, f"port {D.HTTP_PORT} is in use (another collector?): this demo's collector uses {fallback}"


def check_num_blocks(num_blocks: int, items: list[Any], block_size: int = 16) -> None:
    """Raise :class:`UsageError` unless every request of ``items`` fits a pool of ``num_blocks`` (vLLM keeps one
    block as its null block)."""
    longest = max(-(-(len(prompt) + max_tokens) // block_size) for _, _, prompt, max_tokens, _ in items)
    if num_blocks < longest + 1:
        raise UsageError(f"--num-blocks {num_blocks}: the demo's longest request needs {longest} blocks of "
                         f"{block_size} tokens, plus vLLM's null block: give at least {longest + 1} (default 640)")


def get_json(url: str, timeout: float = 10.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def _say(msg: str) -> None:
    print(msg, flush=True)


def wait_ingested(url: str, run_id: str, rows: int, timeout: float = 60.0) -> int:
    """Poll the collector until it has stored ``rows`` rows of ``run_id``; returns what it has."""
    deadline = time.monotonic() + timeout
    have = -1
    while time.monotonic() < deadline:
        runs = get_json(f"{url}/api/v1/runs")
        items = runs["items"] if isinstance(runs, dict) else runs
        have = next((int(r["events"]) for r in items if r["run_id"] == run_id), 0)
        if have >= rows:
            return have
        time.sleep(0.2)
    return have


def wait_subscribed(url: str, engine: str, timeout: float = 30.0) -> None:
    """Until the collector's ``--kv-events`` subscriber for ``engine`` is connected to the publisher (its /healthz
    entry): from then on a batch it misses shows as a gap and the replay fills it."""
    deadline = time.monotonic() + timeout
    while True:
        entries = get_json(f"{url}/healthz").get("kv_events") or []
        if any(e["engine"] == engine and e["state"] == "connected" for e in entries):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the collector's kv-events subscriber did not connect within {timeout:.0f} s "
                               f"({entries})")
        time.sleep(0.1)


def wait_kv_events_stored(url: str, run_id: str, published: Published, timeout: float = 120.0) -> dict[str, int]:
    """Poll the collector until it has stored a ``block_sealed`` row for every block vLLM's publisher announced as
    stored and a ``block_evicted`` row for every removed one; returns its counts by event type. Raises
    RuntimeError naming what is missing after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    have: dict[str, int] = {}
    while True:
        try:
            have = get_json(f"{url}/api/v1/runs/{run_id}/summary")["events_by_type"]
        except urllib.error.HTTPError as e:
            if e.code != 404:  # 404: no batch of the run committed yet
                raise
        if (have.get("block_sealed", 0) >= published.stored_blocks
                and have.get("block_evicted", 0) >= published.removed_blocks):
            return have
        if time.monotonic() > deadline:
            raise RuntimeError(f"the collector stored {have.get('block_sealed', 0):,} of {published.stored_blocks:,} "
                               f"stored and {have.get('block_evicted', 0):,} of {published.removed_blocks:,} removed "
                               f"blocks vLLM published in {timeout:.0f} s")
        time.sleep(0.2)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _hit_rate_line(s: dict[str, Any]) -> str:
    if "prefix_hit_rate" in s["unavailable"]:
        return s["unavailable"]["prefix_hit_rate"]
    origin = f", {A.FROM_COUNTERS_TEXT}" if s["prefix_hit_rate_from"] == A.FROM_COUNTERS else ""
    return (f"{_pct(s['prefix_hit_rate'])}  ({s['prefix_hit_tokens']:,} of {s['prompt_tokens']:,} prompt tokens "
            f"from cache{origin})")


def print_report(summary: dict[str, Any], families: list[dict[str, Any]], policy: str) -> None:
    """The report: the run summary's contract numbers and the top families; a number the run's event source
    cannot give is printed as the reason instead (kvfabric.queries.availability)."""
    s = summary
    missing = s["unavailable"]
    kv_only = not A.has_lookups(s["sources"])
    shared = ("evicted blocks with 2+ children or stored 2+ times" if kv_only
              else "evicted blocks that 2+ requests had used")
    _say("")
    _say(f"Run {s['run_id']}  (policy {policy})")
    rows = [
        ("prefix hit rate", _hit_rate_line(s)),
        ("evicted blocks", f"{s['evicted_blocks']:,}"),
        ("shared-anchor eviction ratio", f"{_pct(s['shared_anchor_eviction_ratio'])}  ({shared})"),
        ("protected eviction ratio", _pct(s["protected_eviction_ratio"])),
        ("rebuilt from eviction", f"{s['rebuilt_from_eviction_blocks']:,} blocks (evicted, then prefilled again)"),
        ("regretful evictions", missing.get("regretful_evictions")
         or f"{s['regretful_evictions']:,} (evicted, then wanted within 60 s)"),
        ("wasted prefill tokens", f"{s['wasted_prefill_tokens']:,}"),
    ]
    if "evicted_tokens" in missing:
        rows.append(("miss attribution", missing["evicted_tokens"]))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        _say(f"  {k:<{width}}  {v}")
    if families:
        _say("")
        _say("Top families by wasted prefill")
        _say(f"  {'family':<20} {'requests':>8} {'hit rate':>9} {'evicted':>8} {'rebuilt':>8} {'wasted tok':>11}")
        for f in families[:8]:
            requests = "n/a" if f["requests"] is None else f"{f['requests']:,}"
            rate = "n/a" if "prefix_hit_rate" in f["unavailable"] else _pct(f.get("prefix_hit_rate"))
            _say(f"  {str(f['family'])[:20]:<20} {requests:>8} {rate:>9} "
                 f"{f['evicted_blocks']:>8,} {f['rebuilt_blocks']:>8,} {f['wasted_prefill_tokens']:>11,}")
        if any(f["unavailable"] for f in families[:8]):
            _say(f"  n/a: {A.NO_LOOKUPS}")


def export_and_count(db: str, out: str, run_id: str, lake: LakeLocation | None = None) -> dict[str, int]:
    """Export to hive-partitioned Parquet and count the run's events back with DuckDB."""

    if os.path.isdir(out):
        shutil.rmtree(out)
    export_parquet(db, out, run=run_id if lake is not None else None, lake=lake)
    con = duckdb.connect()
    try:
        rows = con.execute(
            "SELECT event, count(*) FROM read_parquet(?, hive_partitioning=true) WHERE run_id = ? GROUP BY 1",
            [os.path.join(out, "events", "**", "*.parquet"), run_id],
        ).fetchall()
    finally:
        con.close()
    return {str(k): int(v) for k, v in rows}


def _stop_on_sigterm() -> None:
    """``kill`` (SIGTERM) stops the demo as Ctrl-C does: through ``finally``, which stops the collector. Without
    this, SIGTERM would end the demo on the spot and leave its collector running, holding the database's lock."""

    def interrupt(_signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    with contextlib.suppress(ValueError):  # not the main thread (an embedding caller): its own signals stand
        signal.signal(signal.SIGTERM, interrupt)


def snapshot_database(db: str, into: str, attempts: int = 40) -> str:
    """A consistent copy of ``db`` (and its WAL) in directory ``into``, taken while a collector holds the file but
    writes nothing; returns the copy's path.

    DuckDB lets one process open a file, so the export cannot read the live database; the copy, opened read-only,
    replays the WAL in memory. Consistent because nothing is being written (the demo's run is fully ingested and
    its socket is private); to be sure, a copy is kept only if neither file changed while it was taken.
    """
    copy = os.path.join(into, "snapshot.duckdb")
    sources = (db, f"{db}.wal")

    def state() -> tuple[tuple[int, int] | None, ...]:
        out = []
        for path in sources:
            try:
                st = os.stat(path)
                out.append((st.st_size, st.st_mtime_ns))
            except FileNotFoundError:
                out.append(None)
        return tuple(out)

    for _ in range(attempts):
        before = state()
        for path, target in zip(sources, (copy, f"{copy}.wal"), strict=True):
            with contextlib.suppress(FileNotFoundError):
                os.remove(target)
            with contextlib.suppress(FileNotFoundError):  # the WAL may be checkpointed away meanwhile
                shutil.copyfile(path, target)
        if state() == before:
            return copy
        time.sleep(0.25)
    raise RuntimeError(f"{db} kept changing while it was copied for the Parquet export")


def _free_port(host: str) -> int:
    """A TCP port nothing listens on at ``host`` ('' = every interface), as ZMQ binds it."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class KvEventsWiring:
    """Where the kv-events demo's publisher binds and what the collector subscribes to.

    vLLM 0.33 binds its publishing socket only for a wildcard host (``tcp://*:PORT``: every interface, for the
    demo's few seconds; the events are the demo's synthetic tokens) and connects for any other; the replay socket it
    binds wherever told, here loopback only."""

    ENGINE = "demo-kv-events"

    def __init__(self, run_id: str) -> None:
        pub, replay = _free_port(""), _free_port(D.HTTP_HOST)
        self.vllm_endpoint = f"tcp://*:{pub}"
        self.vllm_replay = f"tcp://{D.HTTP_HOST}:{replay}"
        self.spec = (f"tcp://{D.HTTP_HOST}:{pub},replay={self.vllm_replay},engine={self.ENGINE},run={run_id}")


def _run_engine(args: argparse.Namespace, collector: CollectorProcess, sock: str, run_id: str, items: list[Any],
                blocks: int, wiring: KvEventsWiring | None) -> tuple[dict[str, Any], str]:
    """Run the engine (plugin or kv-events) until the collector has stored the run; returns the stats and the
    line saying what was sent and stored."""
    store = "the lake" if args.lake else "DuckDB"
    if wiring is None:
        stats = run_with_plugin(sock, run_id, args.policy, items, blocks, _say)
        stored = wait_ingested(collector.http_url, run_id, stats["rows_sent"])
        return stats, (f"  events: {stats['events_emitted']:,} emitted, {stats['rows_sent']:,} sent, "
                       f"{stats['events_lost']:,} lost; {stored:,} rows stored in {store}")
    stats = run_with_kv_events(
        wiring.vllm_endpoint, wiring.vllm_replay, items, blocks, _say,
        on_ready=lambda _: wait_subscribed(collector.http_url, wiring.ENGINE),
        wait_stored=lambda published: wait_kv_events_stored(collector.http_url, run_id, published),
    )
    published = stats["published"]
    stored = wait_ingested(collector.http_url, run_id, 1)
    return stats, (f"  events: vLLM published {published['batches']:,} KV-event batches "
                   f"({published['stored_blocks']:,} blocks stored, {published['removed_blocks']:,} removed); "
                   f"{stored:,} rows stored in {store}")


def run(args: argparse.Namespace) -> int:
    _stop_on_sigterm()
    if args.kv_events and args.policy != "lru":
        raise UsageError(f"--kv-events with --policy {args.policy}: without the plugin vLLM evicts by its own LRU; "
                         "leave out --policy")
    if args.kv_events and args.lake is not None:
        raise UsageError("--kv-events with --lake: the kv-events demo writes a DuckDB file (leave out --lake)")
    items = demo_workload(args.seed)
    blocks = DEMO_NUM_BLOCKS if args.num_blocks is None else args.num_blocks
    check_num_blocks(blocks, items)  # before anything starts: a bad value leaves nothing behind
    lake = lake_from_args(args)  # checked before anything starts
    if args.serve and lake is not None and lake.catalog_kind != "postgres":
        raise UsageError("--serve with a lake catalogued in a local file: the serving collector holds the file's "
                         "lock, so the export could not read it; use a postgres: catalog, or leave out --serve")
    port_number, port_note = choose_port(args.port)
    db = os.path.abspath(args.db)
    label = "kv-events" if args.kv_events else args.policy
    run_id = args.run_id or f"demo-{label}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    workdir = tempfile.mkdtemp(prefix="kvfabric-demo-")
    sock = os.path.join(workdir, "kvfabric.sock")
    log_path = os.path.join(workdir, "collector.log")
    collector: CollectorProcess | None = None
    wiring = KvEventsWiring(run_id) if args.kv_events else None
    if wiring is None:
        _say("KVFabric demo: vLLM's real scheduler on CPU with a simulated model; the hook streams to a real collector")
    else:
        _say("KVFabric demo: vLLM's real scheduler on CPU with a simulated model, without the plugin; vLLM's own "
             "KV-event publisher streams to a real collector (--kv-events)")
    t_start = time.monotonic()
    try:
        config = CollectorConfig(db_path=db, socket_path=sock, port=port_number, lake=args.lake, data=args.data,
                                 kv_events=() if wiring is None else (wiring.spec,))
        collector = CollectorProcess(config, log_path=log_path, ready_timeout=60.0)
        if port_note:
            _say(f"  {port_note}")
        where = lake.describe() if lake is not None else f"db {db}"
        _say(f"  collector: {where}, socket {sock}, {collector.http_url}")
        if wiring is not None:
            _say(f"  collector subscribed with --kv-events {wiring.spec}")
        collector.start()
        stats, sent = _run_engine(args, collector, sock, run_id, items, blocks, wiring)
        _say(sent)
        summary = get_json(f"{collector.http_url}/api/v1/runs/{run_id}/summary")
        fams = get_json(f"{collector.http_url}/api/v1/families?run={run_id}")
        families = fams["items"] if isinstance(fams, dict) else fams
        print_report(summary, families, "vLLM's own LRU, seen through its KV events" if wiring else args.policy)
        if lake is not None and lake.catalog_kind == "postgres":
            source = db  # a catalog in PostgreSQL takes readers beside its writers: the export reads it directly
        elif args.serve:
            # The collector that ingested keeps serving (its /metrics counters were advanced by this run's ingest):
            # the export reads a copy, since DuckDB lets one process open the file.
            source = snapshot_database(db, workdir)
        else:
            collector.stop()  # DuckDB has one writer: the export reads the file once the collector has flushed it
            source = db
        counts = export_and_count(source, os.path.abspath(args.parquet), run_id, lake)
        _say("")
        _say(f"Parquet: {sum(counts.values()):,} events of this run read back from {os.path.abspath(args.parquet)} "
             f"({len(counts)} event types)")
        if lake is not None:
            _say(f"Lake: {lake.describe()}")
            _say(f"  CLI:  kvfabric query run_summary --lake '{args.lake}' --data '{args.data}' --run {run_id}")
            _say(f"        kvfabric fleet --lake '{args.lake}' --data '{args.data}'")
        else:
            _say(f"Database: {db}")
            _say(f"  SQL:  python -c \"import duckdb; duckdb.connect('{db}', read_only=True).sql("
                 f"\\\"SELECT event, count(*) FROM events WHERE run_id = '{run_id}' GROUP BY 1\\\").show()\"")
            _say(f"  CLI:  kvfabric query run_summary --db {db} --run {run_id}")
        if args.json:
            _say(json.dumps({"summary": summary, "parquet_counts": counts, "stats": stats}, default=str))
        _say(f"Done in {time.monotonic() - t_start:.0f} s.")
        if args.serve:
            _say(f"API: {collector.http_url}/api/v1/runs/{run_id}/summary   docs: {collector.http_url}/docs   "
                 f"metrics: {collector.http_url}/metrics   (Ctrl-C to stop)")
            assert collector.proc is not None
            code = collector.proc.wait()
            print(f"kvfabric demo: the collector stopped by itself (exit code {code}); log: {log_path}",
                  file=sys.stderr)
            return 1
        store = f"--lake '{args.lake}' --data '{args.data}'" if lake is not None else f"--db {db}"
        _say(f"API: run `kvfabric demo --serve` or `kvfabric collector {store}` and open "
             f"http://{D.HTTP_HOST}:{D.HTTP_PORT}/api/v1/runs/{run_id}/summary")
        return 0
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        print(f"kvfabric demo: {exc}", file=sys.stderr)
        if Path(log_path).exists():
            tail = Path(log_path).read_text(errors="replace").splitlines()[-15:]
            print("collector log (last lines):\n  " + "\n  ".join(tail), file=sys.stderr)
        return 1
    finally:
        if collector is not None and collector.proc is not None:
            collector.stop()
        shutil.rmtree(workdir, ignore_errors=True)
