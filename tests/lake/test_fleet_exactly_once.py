"""The fleet's guarantees end to end, on real parts: PostgreSQL (catalog), moto S3 or a local folder (data), real
collector processes (one per "host", each with its own socket) and the hook's own sink (protocol 2) on every
engine. A collector killed with ``kill -9`` and restarted, or a catalog that goes away and returns, loses nothing
and stores nothing twice: stored == emitted, exactly, per engine; the fleet overview is the sum of its engines."""

from __future__ import annotations

import os
import threading
import time
from contextlib import ExitStack
from typing import Any

import httpx
import pytest
from support.collector_testkit import (
    bulk_batches,
    collector_files,
    hook_row,
    hook_sink,
    meta,
    metric,
    scrape,
    send_stream,
    stored,
    wait_until,
)
from support.lake_testkit import LakeLocation as KitLocation

from kvfabric.collector import CollectorProcess
from kvfabric.contract import schema as S
from kvfabric.lake import LakeLocation
from kvfabric.queries import QueryRunner
from kvfabric.queries.sources import connector

pytestmark = pytest.mark.timeout(420)

RUN = "fleet-run"


@pytest.fixture(autouse=True)
def _lake_env(lake_location: KitLocation, monkeypatch: pytest.MonkeyPatch) -> None:
    """The S3 variables for this process's own reads of the lake (the collectors get them as children)."""
    for name, value in lake_location.env.items():
        monkeypatch.setenv(name, value)


class Producer:
    """Appends rows of one engine to its sink's buffer at a steady rate (as vLLM's scheduler would)."""

    def __init__(self, sink: Any, engine: str, rate: float, host: str, dp_rank: int) -> None:
        self.sink = sink
        self.engine = engine
        self.host = host
        self.dp_rank = dp_rank
        self.rate = rate
        self.emitted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        t0 = time.monotonic()
        append = self.sink.buffer.append
        while not self._stop.is_set():
            due = int((time.monotonic() - t0) * self.rate)
            while self.emitted < due:
                append(_row(self.emitted, self.engine, self.host, self.dp_rank))
                self.emitted += 1
            time.sleep(0.005)

    def start(self) -> Producer:
        self._thread.start()
        return self

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.emitted


_HOST, _DP_RANK = S.EMIT_COLUMNS.index("host"), S.EMIT_COLUMNS.index("dp_rank")


def _row(i: int, engine: str, host: str, dp_rank: int) -> tuple:
    """The hook's block_allocated row of block ``i``, stamped with its host and rank as the expander does."""
    values = list(hook_row(i, RUN, engine))
    values[_HOST], values[_DP_RANK] = host, dp_rank
    return tuple(values)


def _env(lake: KitLocation) -> dict[str, str]:
    return {**os.environ, **lake.env}


def _reader(lake: KitLocation) -> QueryRunner:
    """kvfabric's own runner on the lake, attached read-only (the tests set the S3 variables in this process)."""
    return QueryRunner(connector("", LakeLocation.parse(lake.catalog, lake.data)))


def _stored_per_engine(lake: KitLocation) -> dict[str, tuple[int, int, int, int, int]]:
    """engine -> (rows, distinct block ids, host values, gaps, duplicates) as committed in the lake."""
    runner = _reader(lake)
    with runner._connection() as con:  # the runner's own connection: the lake attached read-only
        rows = con.execute(
            "SELECT engine, count(*), count(DISTINCT block_id), count(DISTINCT host) FROM events "
            "WHERE run_id = ? AND event <> 'sink_dropped' GROUP BY engine", [RUN]).fetchall()
        accounting = dict((e, (g, d)) for e, g, d in con.execute(
            "SELECT engine, sum(gaps), sum(duplicates) FROM streams WHERE run_id = ? GROUP BY engine",
            [RUN]).fetchall())
    return {e: (n, d, h, *accounting.get(e, (0, 0))) for e, n, d, h in rows}


@pytest.mark.parametrize("lake_location", ["s3"], indirect=True)
def test_three_collectors_one_killed_store_every_event_once(lake_location: KitLocation) -> None:
    hosts = ("host-a", "host-b", "host-c")
    engines_per_host = 2
    with ExitStack() as stack:
        files = [stack.enter_context(collector_files()) for _ in hosts]

        def process(i: int) -> CollectorProcess:
            f = files[i]
            config = f.config(lake=lake_location.catalog, data=lake_location.data, coalesce_ms=200, retain_s=0)
            return CollectorProcess(config, log_path=f.log_path, env=_env(lake_location), ready_timeout=60.0)

        procs = [process(i).start() for i in range(len(hosts))]
        try:
            sinks: dict[str, Any] = {}
            producers: dict[str, Producer] = {}
            for i, host in enumerate(hosts):
                for k in range(engines_per_host):
                    engine = f"{host}/dp{k}"
                    sink = hook_sink(files[i].socket_path, RUN, engine, batch_events=200)
                    sinks[engine] = sink
                    producers[engine] = Producer(sink, engine, 1_500, host, k).start()
            victim = 1
            url = files[victim].http_url
            wait_until(lambda: _committed(url) > 5_000, timeout=60, what="host-b's collector committed rows")
            procs[victim].kill()  # SIGKILL: batches in flight are in nobody's lake
            time.sleep(1.0)
            procs[victim] = process(victim).start()  # a new process: it knows only what the lake says
            wait_until(lambda: _committed(url) > 5_000, timeout=60, what="the restarted collector committed")
            time.sleep(1.0)
            emitted = {e: p.stop() for e, p in producers.items()}
            for sink in sinks.values():
                sink.close(timeout=60)
            conflicts = sum(_conflicts(f.http_url) for f in files)
        finally:
            for p in procs:
                p.stop()
        logs = "\n".join(f.log()[-2000:] for f in files)

    got = _stored_per_engine(lake_location)
    assert set(got) == set(emitted), logs
    for engine, n in emitted.items():
        rows, distinct, hosts_seen, gaps, _dups = got[engine]
        assert sinks[engine].lost_events == 0
        assert (rows, distinct) == (n, n), f"{engine}: stored {rows} rows ({distinct} distinct) of {n} emitted"
        assert hosts_seen == 1 and gaps == 0
        assert n > 3_000
    assert sinks["host-b/dp0"].connects >= 2  # it really lost its collector and came back
    assert conflicts == 0  # appends of three collectors never conflict (no maintenance ran: its interval is 5 min)

    overview = _reader(lake_location).fleet(run=RUN)
    by_engine = {e["engine"]: e for e in overview["engines"]}
    assert {e: by_engine[e]["events"] for e in emitted} == emitted
    assert {by_engine[e]["host"] for e in emitted} == set(hosts)
    for field in ("requests", "prompt_tokens", "hit_tokens", "evicted_blocks", "rebuilt_blocks", "events"):
        assert overview["totals"][field] == sum(e[field] for e in overview["engines"])


def _committed(url: str) -> float:
    try:
        return metric(scrape(httpx.get(url + "/metrics", timeout=5).text), "kvfabric_ingest_rows_total")
    except httpx.HTTPError:
        return 0.0


def _conflicts(url: str) -> float:
    return metric(scrape(httpx.get(url + "/metrics", timeout=5).text), "kvfabric_lake_commit_conflicts_total")


@pytest.mark.parametrize("lake_location", ["local"], indirect=True)
def test_a_lost_catalog_holds_ingest_and_loses_nothing(lake_location: KitLocation, postgres: Any) -> None:
    with collector_files() as f:
        config = f.config(lake=lake_location.catalog, data=lake_location.data, coalesce_ms=200, retain_s=0)
        proc = CollectorProcess(config, log_path=f.log_path, env=_env(lake_location), ready_timeout=60.0).start()
        try:
            sink = hook_sink(f.socket_path, RUN, "solo/dp0", batch_events=200)
            producer = Producer(sink, "solo/dp0", 2_000, "solo", 0).start()
            wait_until(lambda: _committed(f.http_url) > 2_000, timeout=60, what="rows committed")
            postgres.stop()
            try:
                wait_until(lambda: httpx.get(f.http_url + "/healthz", timeout=5).status_code == 503, timeout=30,
                           what="the collector reported its storage failing")
                time.sleep(2.0)
            finally:
                postgres.start()
            wait_until(lambda: httpx.get(f.http_url + "/healthz", timeout=5).status_code == 200, timeout=60,
                       what="the collector recovered")
            time.sleep(1.0)
            emitted = producer.stop()
            sink.close(timeout=60)
            errors = metric(scrape(httpx.get(f.http_url + "/metrics", timeout=5).text),
                            "kvfabric_storage_errors_total")
        finally:
            proc.stop()
        log = f.log()
    rows, distinct, _hosts, gaps, _dups = _stored_per_engine(lake_location)["solo/dp0"]
    assert (rows, distinct, gaps) == (emitted, emitted, 0), log[-3000:]
    assert errors >= 1 and sink.lost_events == 0


@pytest.mark.parametrize("lake_location", ["local"], indirect=True)
def test_a_stream_that_moves_to_a_running_collector_is_not_stored_twice(lake_location: KitLocation) -> None:
    """Collector A starts first and loads the lake's streams; stream X then commits batches 0-9 through B; when X
    reconnects to A and resends 0-19 (a sink that never heard B's acknowledgements), A stores 10-19 only: it reads
    X's committed position from the lake, not from what it loaded at start."""
    batches = bulk_batches(RUN, "mover/dp0", 20, 50)
    stream = meta("stream-x", RUN, "mover/dp0")
    with collector_files() as fa, collector_files() as fb:
        def process(f: Any) -> CollectorProcess:
            config = f.config(lake=lake_location.catalog, data=lake_location.data, coalesce_ms=50, retain_s=0)
            return CollectorProcess(config, log_path=f.log_path, env=_env(lake_location), ready_timeout=60.0)

        with process(fa), process(fb):
            send_stream(fb.socket_path, stream, batches[:10])
            wait_until(lambda: stored(fb.http_url, RUN) == 500, timeout=30, what="B committed batches 0-9")
            send_stream(fa.socket_path, stream, batches)
            wait_until(lambda: stored(fa.http_url, RUN) == 1000, timeout=30, what="A committed batches 10-19")
            time.sleep(0.5)
            duplicates = metric(scrape(httpx.get(fa.http_url + "/metrics", timeout=5).text),
                                "kvfabric_duplicate_batches_total")
    rows, distinct, _hosts, gaps, dups = _stored_per_engine(lake_location)["mover/dp0"]
    assert (rows, gaps) == (1000, 0)
    assert distinct == 50  # (bulk rows reuse block ids 0-49 in every batch)
    assert duplicates == 10 and dups == 10
