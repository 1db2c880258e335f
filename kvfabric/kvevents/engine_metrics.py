"""An engine's own prefix-cache counters, read from its Prometheus endpoint: ``prefix_cache_counters`` rows.

The KV-event stream says nothing about lookups or hits. vLLM counts both on its ``/metrics``:
``vllm:prefix_cache_queries_total`` (prompt tokens looked up) and ``vllm:prefix_cache_hits_total`` (of them,
served from the cache), one series per label set (model, engine index). Every ``interval_s`` this thread reads
them, sums each over its label sets, and writes one row per read that saw them move: ``prompt_tokens`` = queries
since the previous read, ``hit_tokens`` = hits since then (a delta over 2^31 - 1 is split over several rows, the
columns being int32), ``ts_ns`` the read's time, into the stream ``kv-events:{engine}:metrics`` (``seq`` one per
row batch, resumed after a collector restart from the committed one).

Counter resets: a counter below its previous value means the engine restarted: the new value is all new (counted
from zero), and ``kvfabric_engine_metrics_counter_resets_total`` says so. The first read is a baseline (what the
engine counted before this collector listened is not this stream's), except when the endpoint's
``process_start_time_seconds`` says the engine started after this thread did: then everything it counted is new.
A failed read (engine down, timeout, counters absent) is counted (``kvfabric_engine_metrics_scrapes_total
{outcome="failed"}``) and the next read continues from the last good one, so nothing is counted twice or lost
while the counters keep running.
"""

from __future__ import annotations

import logging
import threading
import time
import urllib.request
from dataclasses import dataclass

import pyarrow as pa
from prometheus_client.parser import text_string_to_metric_families

from kvfabric.contract import schema as S
from kvfabric.ingest import defaults as D
from kvfabric.ingest.queue import QueueClosed
from kvfabric.kvevents.spec import EngineMetricsSpec
from kvfabric.kvevents.stream import KvStream, Labels, SubscriberContext, metrics_stream_id

log = logging.getLogger("kvfabric.kvevents")

QUERIES = "vllm:prefix_cache_queries_total"
HITS = "vllm:prefix_cache_hits_total"
START_TIME = "process_start_time_seconds"
INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class Counters:
    """One read of an engine's endpoint."""

    queries: float
    hits: float
    start_time_s: float | None


def parse_counters(text: str) -> Counters | None:
    """The two prefix-cache counters (each summed over its label sets) and the process start time, from
    Prometheus text; None when the counters are absent (not a vLLM endpoint, or prefix caching off)."""
    totals: dict[str, float] = {}
    start: float | None = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in (QUERIES, HITS):
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
            elif sample.name == START_TIME:
                start = sample.value
    if QUERIES not in totals or HITS not in totals:
        return None
    return Counters(totals[QUERIES], totals[HITS], start)


def counter_rows(engine: str, run_id: str, host: str | None, ts_ns: int, queries: int, hits: int) -> list[tuple]:
    """``prefix_cache_counters`` rows for one read's deltas, in EMIT_COLUMNS order (split to fit int32)."""
    rows = []
    while queries > 0 or hits > 0 or not rows:
        q, h = min(queries, INT32_MAX), min(hits, INT32_MAX)
        values = {"ts_ns": ts_ns, "engine": engine, "run_id": run_id, "event": S.PREFIX_CACHE_COUNTERS,
                  "prompt_tokens": q, "hit_tokens": h, "host": host}
        rows.append(tuple(values.get(name) for name in S.EMIT_COLUMNS))
        queries, hits = queries - q, hits - h
    return rows


def rows_batch(rows: list[tuple], seq: int) -> pa.RecordBatch:
    columns = list(zip(*rows, strict=True))
    arrays = [pa.array([seq] * len(rows), pa.int64())]
    arrays += [pa.array(list(col), f.type) for col, f in zip(columns, list(S.EVENT_SCHEMA)[1:], strict=True)]
    return pa.RecordBatch.from_arrays(arrays, schema=S.EVENT_SCHEMA)


class EngineMetricsScraper:
    """One engine's endpoint, read on its own thread (module docstring)."""

    def __init__(self, target: EngineMetricsSpec, ctx: SubscriberContext, *,
                 interval_s: float = D.ENGINE_METRICS_INTERVAL_S,
                 timeout_s: float = D.ENGINE_METRICS_TIMEOUT_S) -> None:
        self.target = target
        self.ctx = ctx
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started_s = time.time()
        self._previous: Counters | None = None
        self._seq = 0
        self.stream: KvStream | None = None
        # -- read by /healthz --
        self.reads = 0
        self.failures = 0
        self.resets = 0
        self.last_ok_ns: int | None = None
        self.problem: str | None = None

    def start(self) -> None:
        self.ctx.metrics.open_kv_events(self.target.engine, scraped=True)
        self._thread = threading.Thread(target=self._run, name=f"kvfabric-engine-metrics:{self.target.engine}",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def status(self, authorized: bool = False) -> dict[str, object]:
        body: dict[str, object] = {"engine": self.target.engine, "reads": self.reads, "failures": self.failures,
                                   "counter_resets": self.resets, "last_ok_ns": self.last_ok_ns}
        if self.problem is not None:
            body["problem"] = self.problem
        if authorized:
            body["url"] = self.target.url
        return body

    def _open_stream(self) -> KvStream:
        """The engine's counter stream, numbered on from its committed ``last_seq`` (a restarted collector)."""
        t = self.target
        sid = metrics_stream_id(t.engine)
        self._seq = self.ctx.resume_seq(sid) + 1
        self.stream = KvStream(self.ctx, sid, Labels(engine=t.engine, run_id=t.run_id, host=t.host,
                                                     settings={"source": "kv_events", "engine_metrics": t.url},
                                                     peer=f"engine-metrics {t.url}"), register=False)
        return self.stream

    def _run(self) -> None:
        t = self.target
        try:
            while True:
                self.scrape_once()
                if self._stop.wait(self.interval_s):
                    return
        except QueueClosed:
            return
        except Exception as e:
            self.problem = f"{type(e).__name__}: {e}"
            log.exception("engine-metrics %s: scraper died", t.engine)

    def scrape_once(self) -> None:
        """One read; queues a row batch when the counters moved."""
        engine = self.target.engine
        m = self.ctx.metrics
        now_ns = time.time_ns()
        try:
            with urllib.request.urlopen(self.target.url, timeout=self.timeout_s) as resp:
                text = resp.read().decode("utf-8", "replace")
            counters = parse_counters(text)
            if counters is None:
                raise ValueError(f"no {QUERIES} / {HITS} on {self.target.url}")
        except (OSError, ValueError) as e:
            self.failures += 1
            self.problem = str(e)[:300]
            m.engine_scrapes.labels(engine, "failed").inc()
            self.ctx.log(logging.WARNING, f"engine-metrics:{engine}", "engine-metrics %s: read of %s failed: %s",
                         engine, self.target.url, e)
            return
        self.reads += 1
        self.problem = None
        self.last_ok_ns = now_ns
        m.engine_scrapes.labels(engine, "ok").inc()
        previous, self._previous = self._previous, counters
        if previous is None:
            started_after = counters.start_time_s is not None and counters.start_time_s >= self._started_s
            if not started_after:
                return  # a baseline
            dq, dh = counters.queries, counters.hits
        else:
            dq, dh = counters.queries - previous.queries, counters.hits - previous.hits
            if dq < 0 or dh < 0:
                self.resets += 1
                m.engine_counter_resets.labels(engine).inc()
                dq, dh = counters.queries, counters.hits
        if dq <= 0 and dh <= 0:
            return
        rows = counter_rows(engine, self.target.run_id, self.target.host, now_ns, int(dq), int(dh))
        stream = self.stream or self._open_stream()
        stream.put(self._seq, rows_batch(rows, self._seq), now_ns, now_ns)
        self._seq += 1
