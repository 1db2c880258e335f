"""An engine's prefix-cache counters (``--engine-metrics``) become ``prefix_cache_counters`` rows: increases between
reads, summed over label sets, a reset counted from zero, a failed read skipped without losing or doubling
anything; served by a real HTTP server, read by the scraper, queued for (and stored by) a real collector."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import duckdb
import httpx
import pytest
from prometheus_client import generate_latest
from support.collector_testkit import collector_files, free_port, metric, scrape, wait_until

from kvfabric.contract import schema as S
from kvfabric.ingest.metrics import CollectorMetrics
from kvfabric.ingest.queue import BatchQueue, BatchReceived, StreamOpened
from kvfabric.kvevents.engine_metrics import EngineMetricsScraper, counter_rows, parse_counters
from kvfabric.kvevents.spec import EngineMetricsSpec
from kvfabric.kvevents.stream import SubscriberContext


def exposition(queries: tuple[float, ...], hits: tuple[float, ...], started: float | None = None) -> str:
    """vLLM's /metrics as it looks: one series per engine index, plus other families."""
    lines = ["# HELP vllm:prefix_cache_queries Prefix cache queries, in terms of number of queried tokens.",
             "# TYPE vllm:prefix_cache_queries counter"]
    lines += [f'vllm:prefix_cache_queries_total{{engine="{i}",model_name="m"}} {q}' for i, q in enumerate(queries)]
    lines += ["# TYPE vllm:prefix_cache_hits counter"]
    lines += [f'vllm:prefix_cache_hits_total{{engine="{i}",model_name="m"}} {h}' for i, h in enumerate(hits)]
    lines += ["# TYPE vllm:num_requests_running gauge", 'vllm:num_requests_running{engine="0"} 3.0']
    if started is not None:
        lines += ["# TYPE process_start_time_seconds gauge", f"process_start_time_seconds {started}"]
    return "\n".join(lines) + "\n"


@contextmanager
def endpoint(text: str) -> Iterator[dict[str, str | int]]:
    """A real HTTP server answering ``page["text"]`` (or ``page["status"]``) at /metrics."""
    page: dict[str, str | int] = {"text": text, "status": 200}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = str(page["text"]).encode()
            self.send_response(int(page["status"]))
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    page["url"] = f"http://127.0.0.1:{server.server_address[1]}/metrics"
    try:
        yield page
    finally:
        server.shutdown()
        server.server_close()


def test_counters_are_summed_over_label_sets() -> None:
    c = parse_counters(exposition((100.0, 20.0), (40.0, 5.0), started=1234.5))
    assert c is not None and (c.queries, c.hits, c.start_time_s) == (120.0, 45.0, 1234.5)
    assert parse_counters("# TYPE x counter\nx_total 1\n") is None


def test_an_increase_over_int32_is_split_over_rows() -> None:
    rows = counter_rows("e", "r", "h", 7, 2**31 + 5, 3)
    col = {n: i for i, n in enumerate(S.EMIT_COLUMNS)}
    assert [(r[col["prompt_tokens"]], r[col["hit_tokens"]]) for r in rows] == [(2**31 - 1, 3), (6, 0)]
    assert {(r[col["event"]], r[col["ts_ns"]], r[col["engine"]], r[col["host"]]) for r in rows} == {
        (S.PREFIX_CACHE_COUNTERS, 7, "e", "h")}


def _scraper(url: str, queue: BatchQueue, metrics: CollectorMetrics) -> EngineMetricsScraper:
    ctx = SubscriberContext(queue=queue, metrics=metrics, max_string_bytes=4096,
                            committed_streams=lambda _e, _r: [], resume_seq=lambda _sid: 6)
    return EngineMetricsScraper(EngineMetricsSpec(url=url, engine="e0", run_id="r", host="n"), ctx)


def _deltas(queue: BatchQueue) -> list[tuple[int, int, int]]:
    items = queue.get_many(10**9, 0.0, timeout=0) or []
    out = []
    for item in items:
        if isinstance(item, BatchReceived):
            d = item.batch.to_pydict()
            out += [(s, q, h) for s, q, h in zip(d["seq"], d["prompt_tokens"], d["hit_tokens"], strict=True)]
        else:
            assert isinstance(item, StreamOpened) and item.meta.source == "kv_events"
            assert item.meta.stream_id == "kv-events:e0:metrics"
    return out


def test_reads_become_increases_a_reset_counts_from_zero_and_a_failed_read_loses_nothing() -> None:
    queue, metrics = BatchQueue(10**6, 10**9), CollectorMetrics(max_label_runs=8)
    with endpoint(exposition((100.0, 20.0), (40.0, 0.0), started=time.time() - 3600)) as page:
        scraper = _scraper(str(page["url"]), queue, metrics)
        scraper.scrape_once()  # the engine ran before: a baseline
        assert _deltas(queue) == []
        page["text"] = exposition((130.0, 40.0), (50.0, 10.0))
        scraper.scrape_once()
        assert _deltas(queue) == [(7, 50, 20)]  # numbered on after the committed seq 6
        page["status"] = 500
        scraper.scrape_once()
        page["status"], page["text"] = 200, "# TYPE other counter\nother_total 5\n"
        scraper.scrape_once()  # counters absent: a failed read too
        page["text"] = exposition((150.0, 60.0), (70.0, 15.0))
        scraper.scrape_once()
        assert _deltas(queue) == [(8, 40, 25)]  # from the last good read
        page["text"] = exposition((0.0, 12.0), (0.0, 4.0))  # the engine restarted
        scraper.scrape_once()
        scraper.scrape_once()  # nothing moved: no row
        assert _deltas(queue) == [(9, 12, 4)]
    m = scrape(generate_latest(metrics.registry).decode())
    assert metric(m, "kvfabric_engine_metrics_scrapes_total", engine="e0", outcome="ok") == 5
    assert metric(m, "kvfabric_engine_metrics_scrapes_total", engine="e0", outcome="failed") == 2
    assert metric(m, "kvfabric_engine_metrics_counter_resets_total", engine="e0") == 1
    assert (scraper.reads, scraper.failures, scraper.resets) == (5, 2, 1)


def test_an_engine_started_after_the_collector_counts_from_its_first_read() -> None:
    queue, metrics = BatchQueue(10**6, 10**9), CollectorMetrics(max_label_runs=8)
    with endpoint(exposition((30.0,), (12.0,), started=time.time() + 5)) as page:
        scraper = _scraper(str(page["url"]), queue, metrics)
        scraper.scrape_once()
    assert _deltas(queue) == [(7, 30, 12)]


@pytest.mark.parametrize("token", [None, "t0ken"])
def test_a_collector_stores_the_rows_and_shows_addresses_only_with_the_token(token: str | None) -> None:
    with endpoint(exposition((64.0,), (16.0,), started=time.time() + 5)) as page, collector_files() as files:
        spec = f"tcp://127.0.0.1:{free_port()},engine=e0,run=r9,metrics={page['url']}"
        with files.process(kv_events=(spec,), token=token):
            def health() -> dict | None:
                body = httpx.get(files.http_url + "/healthz").json()
                return body if body["engine_metrics"][0]["reads"] >= 1 and body["writer_queue_rows"] == 0 else None

            body = wait_until(health, 15, "a read committed")
            # Addresses map the network: only a caller with the token sees them (without a token, nobody does).
            assert "url" not in body["engine_metrics"][0] and "endpoint" not in body["kv_events"][0]
            if token is not None:
                shown = httpx.get(files.http_url + "/healthz", headers={"Authorization": f"Bearer {token}"}).json()
                assert shown["engine_metrics"][0]["url"] == page["url"]
            assert body["kv_events"][0]["state"] == "waiting"  # no publisher there: waiting, the collector is ok
            assert body["status"] == "ok"
        with duckdb.connect(files.db_path, read_only=True) as con:
            rows = con.execute("SELECT seq, event, engine, run_id, prompt_tokens, hit_tokens FROM events").fetchall()
            (source,) = con.execute("SELECT source FROM streams WHERE stream_id = 'kv-events:e0:metrics'").fetchone()
    assert rows[0] == (0, S.PREFIX_CACHE_COUNTERS, "e0", "r9", 64, 16) and source == "kv_events"
