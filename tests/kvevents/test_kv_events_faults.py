"""Faults between vLLM's real publisher and a real collector process: a dropped range (a ZMQ proxy drops messages;
the replay fills the hole: nothing lost, nothing twice), a replay that no longer holds the range (an exact, counted
loss), garbage, truncated and foreign messages (counted, the subscriber goes on), a stalled collector (the
publisher never blocks; what it dropped is counted, exactly), and a collector killed with SIGKILL and restarted
(it resumes through the replay: every batch stored exactly once)."""

from __future__ import annotations

import os
import re
import signal
import time

import httpx
import pytest
from support.collector_testkit import collector_files, metric, scrape, wait_until
from support.kv_events_testkit import (
    Proxy,
    Publisher,
    expected_rows,
    kv_health,
    publisher,
    stored_rows,
    streams,
    wait_placed,
    workload,
)

pytestmark = pytest.mark.vllm

ENGINE = "e0"


def _metrics(url: str) -> dict:
    return scrape(httpx.get(url + "/metrics", timeout=5).text)


def _connected(url: str) -> None:
    wait_until(lambda: kv_health(url)["state"] == "connected", 15, "subscriber connected")
    time.sleep(0.2)  # (the subscription reaching the PUB side)


def test_a_dropped_range_is_filled_by_the_replay_nothing_lost_nothing_twice() -> None:
    holes = set(range(10, 20)) | {41}
    with publisher() as pub, collector_files() as files:
        with Proxy(pub.endpoint, drop=lambda seq: seq in holes) as proxy:
            time.sleep(0.3)
            with files.process(kv_events=(f"{proxy.endpoint},replay={pub.replay},engine={ENGINE}",)):
                _connected(files.http_url)
                pub.publish(workload(60, seed=5))
                entry = wait_placed(files.http_url, 59)
                m = _metrics(files.http_url)
        assert sorted(proxy.dropped) == sorted(holes)
        assert entry["lost"] == 0 and entry["decode_errors"] == 0
        assert metric(m, "kvfabric_kv_events_batches_total", engine=ENGINE, via="replay") >= len(holes)
        assert stored_rows(files.db_path, ENGINE) == expected_rows(pub.payloads(), [range(60)], engine=ENGINE)
        (st,) = streams(files.db_path)
        assert (st["last_seq"], st["batches"], st["gaps"], st["duplicates"]) == (59, 60, 0, 0)


def test_a_replay_that_no_longer_holds_the_range_is_an_exact_counted_loss() -> None:
    holes = range(10, 30)
    with publisher(buffer_steps=5) as pub, collector_files() as files:
        def hold_back(seq: int, frames: list[bytes]) -> list[bytes]:
            if seq == 30:  # the collector sees the hole only once the publisher's buffer has moved past it
                pub.drained()
            return frames

        with Proxy(pub.endpoint, drop=lambda seq: seq in holes, mangle=hold_back) as proxy:
            time.sleep(0.3)
            with files.process(kv_events=(f"{proxy.endpoint},replay={pub.replay},engine={ENGINE}",)):
                _connected(files.http_url)
                pub.publish(workload(60, seed=6))
                entry = wait_placed(files.http_url, 59)
                m = _metrics(files.http_url)
        kept = [s for s in range(60) if s not in holes]
        assert entry["lost_by_reason"] == {"gap": 0, "replay_unavailable": 20, "joined_late": 0}
        assert _lost(m, "replay_unavailable") == 20
        assert stored_rows(files.db_path, ENGINE) == expected_rows(pub.payloads(), [kept], engine=ENGINE)
        (st,) = streams(files.db_path)
        assert (st["last_seq"], st["batches"], st["gaps"], st["duplicates"]) == (59, 40, 20, 0)


def _paced(pub: Publisher, batches: list) -> None:
    for b in batches:
        pub.publish([b])
        time.sleep(0.02)


def _lost(m: dict, reason: str) -> float:
    return metric(m, "kvfabric_kv_events_lost_batches_total", engine=ENGINE, reason=reason)


def _seq(n: int) -> bytes:
    return n.to_bytes(8, "big")


def test_garbage_truncated_and_foreign_messages_are_counted_and_the_stream_goes_on() -> None:
    with publisher(topic="kv") as pub, collector_files() as files:
        proxy: Proxy

        def mangle(seq: int, frames: list[bytes]) -> list[bytes]:
            topic, seq_frame, payload = frames
            if seq == 5:
                return [topic, seq_frame, payload[: len(payload) // 2]]  # truncated msgpack
            if seq == 8:
                return [topic, seq_frame, b"\xc1\xc1 not msgpack"]
            if seq == 12:  # foreign messages before it: none may move the stream
                proxy.inject([b"kv-other", _seq(12), payload])  # (ZMQ's prefix match lets it through)
                proxy.inject([b"zz", _seq(12), payload])  # (filtered by the subscription)
                proxy.inject([b"kv", b"\x00\x01", payload])  # a seq frame of 2 bytes
                proxy.inject([b"kv"])  # one frame
                proxy.inject([b"kv", _seq(10**12), b"\xc1 garbage at a far seq"])
                proxy.inject([b"kv", _seq(13), b"\x92\xcb"])  # garbage ahead of its time: not placed
            return frames

        with Proxy(pub.endpoint, mangle=mangle) as proxy:
            time.sleep(0.3)
            spec = f"{proxy.endpoint},replay={pub.replay},engine={ENGINE},topic=kv"
            with files.process(kv_events=(spec,)):
                _connected(files.http_url)
                pub.publish(workload(30, seed=7))
                entry = wait_placed(files.http_url, 29)
                m = _metrics(files.http_url)
        kept = [s for s in range(30) if s not in (5, 8)]
        assert stored_rows(files.db_path, ENGINE) == expected_rows(pub.payloads(), [kept], engine=ENGINE)
        assert entry["state"] == "connected" and entry["lost"] == 0
        errors = {r: metric(m, "kvfabric_kv_events_decode_errors_total", engine=ENGINE, reason=r)
                  for r in ("frames", "garbage", "truncated", "shape", "topic")}
        assert errors == {"frames": 2, "garbage": 2, "truncated": 2, "shape": 0, "topic": 1}
        assert metric(m, "kvfabric_refused_batches_total", reason="undecodable") == 2
        (st,) = streams(files.db_path)
        assert (st["last_seq"], st["batches"], st["refused_batches"], st["gaps"]) == (29, 28, 2, 0)


def test_a_stalled_collector_never_blocks_the_publisher_and_its_loss_is_counted_exactly() -> None:
    with publisher(hwm=10, buffer_steps=4) as pub, collector_files() as files:
        spec = f"{pub.endpoint},replay={pub.replay},engine={ENGINE},hwm=10"
        with files.process(kv_events=(spec,)) as collector:
            _connected(files.http_url)
            batches = workload(2030, seed=8, capacity=4000, families=100_000, blocks=64)  # ~4 KB each
            _paced(pub, batches[:20])  # (a SUB socket past its high-water mark drops too: keep under it here)
            wait_placed(files.http_url, 19)
            assert collector.proc is not None
            os.kill(collector.proc.pid, signal.SIGSTOP)  # stalled: reads nothing
            try:
                t0 = time.monotonic()
                pub.publish(batches[20:2020])
                pub.drained(timeout=20)
                stalled_publish_s = time.monotonic() - t0
            finally:
                os.kill(collector.proc.pid, signal.SIGCONT)
            time.sleep(1.0)
            _paced(pub, batches[2020:])  # live batches after the hole: the collector sees where it ends
            entry = wait_placed(files.http_url, 2029, timeout=60)
            m = _metrics(files.http_url)
        assert stalled_publish_s < 5.0  # the PUB socket dropped instead of waiting for the stalled collector
        (st,) = streams(files.db_path)
        lost = entry["lost_by_reason"]["replay_unavailable"]
        assert lost > 0 and lost == 2030 - st["batches"] == st["gaps"] == _lost(m, "replay_unavailable")
        assert entry["lost"] == lost
        stored = stored_rows(files.db_path, ENGINE)
        kept = sorted({row[0] for row in stored})  # (every batch of the workload has rows)
        assert len(kept) == st["batches"]
        assert stored == expected_rows(pub.payloads(), [kept], engine=ENGINE)


def test_a_collector_killed_and_restarted_resumes_through_the_replay_exactly_once() -> None:
    with publisher() as pub, collector_files() as files:
        spec = f"{pub.endpoint},replay={pub.replay},engine={ENGINE}"
        batches = workload(130, seed=9)
        first = files.process(kv_events=(spec,)).start()
        try:
            _connected(files.http_url)
            pub.publish(batches[:50])
            wait_placed(files.http_url, 49)
            pub.publish(batches[50:100])
            time.sleep(0.05)  # (some placed, some committed, some neither)
        finally:
            first.kill()  # SIGKILL: nothing flushed
        pub.publish(batches[100:])  # published while no collector listens
        pub.drained()
        with files.process(kv_events=(spec,)):
            entry = wait_placed(files.http_url, 129)
        assert entry["lost"] == 0 and entry["restarts"] == 0
        resumed = re.findall(r"continuing stream '[^']+' after seq (\d+)", files.log())
        assert len(resumed) == 1
        k = int(resumed[0])
        assert 49 <= k <= 129
        # The converter's state starts empty in the new process: its rows are those of a fresh conversion from k+1.
        want = expected_rows(pub.payloads(), [range(k + 1), range(k + 1, 130)], engine=ENGINE)
        assert stored_rows(files.db_path, ENGINE) == want
        (st,) = streams(files.db_path)
        assert (st["last_seq"], st["batches"], st["gaps"], st["duplicates"], st["connections"]) == (129, 130, 0, 0, 2)
