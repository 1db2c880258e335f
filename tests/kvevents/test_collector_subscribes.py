"""vLLM 0.33's real ``ZmqEventPublisher`` publishing into a real collector process (``--kv-events``) that stores a
real DuckDB file: what is stored is exactly what was published (every batch once, every row the conversion
gives), history published before the collector listened is replayed, and a restarted engine is a new stream."""

from __future__ import annotations

import httpx
import pytest
from support.collector_testkit import collector_files, metric, scrape, wait_until
from support.kv_events_testkit import (
    expected_rows,
    kv_health,
    publisher,
    stored_rows,
    streams,
    wait_placed,
    workload,
)

from kvfabric.contract import schema as S

pytestmark = pytest.mark.vllm

ENGINE = "e0"


def test_stored_equals_published_including_history_before_the_collector_started() -> None:
    with publisher() as pub, collector_files() as files:
        before = workload(30, seed=1, reset_every=25)
        pub.publish(before)  # nobody listens yet: only the replay buffer has them
        pub.drained()
        spec = f"{pub.endpoint},replay={pub.replay},engine={ENGINE},run=r1"
        with files.process(kv_events=(spec,)):
            wait_placed(files.http_url, 29)
            pub.publish(workload(70, seed=2, t0=before[-1].ts + 1, reset_every=30))
            entry = wait_placed(files.http_url, 99)
            text = httpx.get(files.http_url + "/metrics").text
        assert entry["lost"] == 0 and entry["decode_errors"] == 0 and entry["restarts"] == 0
        assert entry["state"] == "connected"
        stored = stored_rows(files.db_path, ENGINE)
        want = expected_rows(pub.payloads(), [range(100)], engine=ENGINE, run_id="r1")
        assert stored == want
        events = {e for _, *row in stored for e in [row[S.EMIT_COLUMNS.index("event")]]}
        assert {S.BLOCK_SEALED, S.BLOCK_EVICTED, S.BLOCK_REBUILT, S.CACHE_RESET} <= events  # the workload has each
        (st,) = streams(files.db_path)
        assert st["source"] == "kv_events" and st["stream_id"].startswith(f"kv-events:{ENGINE}:")
        assert (st["last_seq"], st["batches"], st["gaps"], st["duplicates"], st["rows"]) == (99, 100, 0, 0, len(want))
        assert (st["block_size"], st["policy"], st["run_id"]) == (16, "unknown", "r1")
        m = scrape(text)
        placed = metric(m, "kvfabric_kv_events_batches_total", engine=ENGINE, via="live") + metric(
            m, "kvfabric_kv_events_batches_total", engine=ENGINE, via="replay")
        assert placed == 100
        assert metric(m, "kvfabric_kv_events_batches_total", engine=ENGINE, via="replay") >= 30
        assert sum(metric(m, "kvfabric_kv_events_lost_batches_total", engine=ENGINE, reason=r)
                   for r in ("gap", "replay_unavailable", "joined_late")) == 0


def test_a_restarted_engine_is_a_new_stream_and_nothing_is_lost() -> None:
    with collector_files() as files:
        with publisher() as first:
            ports = (first.port, first.replay_port)
            spec = f"{first.endpoint},replay={first.replay},engine={ENGINE}"
            with files.process(kv_events=(spec,)):
                wait_until(lambda: kv_health(files.http_url)["state"] == "connected", 10, "connected")
                first.publish(workload(40, seed=3))
                old = wait_placed(files.http_url, 39)["stream_id"]
                first.shutdown()
                wait_until(lambda: kv_health(files.http_url)["state"] == "disconnected", 10, "publisher gone")
                with publisher(ports=ports) as second:  # the engine restarted: same ports, seq from 0
                    second.publish(workload(25, seed=4))
                    second.drained()
                    entry = wait_until(lambda: (e := kv_health(files.http_url)).get("stream_id") != old
                                       and e.get("last_seq") == 24 and e, 20, "the new stream placed")
                    assert entry["restarts"] == 1 and entry["lost"] == 0 and entry["reconnects"] == 1
        rows = stored_rows(files.db_path, ENGINE)
        old_rows = expected_rows(first.payloads(), [range(40)], engine=ENGINE)
        new_rows = expected_rows(second.payloads(), [range(25)], engine=ENGINE)
        assert rows == old_rows + new_rows
        a, b = streams(files.db_path)
        assert (a["stream_id"], a["last_seq"], a["gaps"]) == (old, 39, 0)
        assert (b["stream_id"], b["last_seq"], b["gaps"], b["source"]) == (entry["stream_id"], 24, 0, "kv_events")
