"""Bad input against a real collector process: each kind of bad stream is refused with one log line naming the
peer/stream and the reason, counted in kvfabric_bad_streams_total{reason}, and confined to its connection:
batches accepted before stay stored, and the collector keeps accepting good streams."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import httpx
import pyarrow as pa
import pytest
from collector_testkit import (
    CollectorFiles,
    batch,
    bulk_batches,
    collector_files,
    meta,
    metric,
    scrape,
    send_bytes,
    send_stream,
    stream_bytes,
    wait_until,
)

from kvfabric import schema as S


@pytest.fixture(scope="module")
def live() -> Iterator[CollectorFiles]:
    with collector_files() as files:
        proc = files.process(handshake_timeout_s=1.0, max_batch_rows=1000, max_batch_bytes=1 << 20, coalesce_ms=20)
        with proc:
            yield files


def bad_count(files: CollectorFiles, reason: str) -> float:
    text = httpx.get(files.http_url + "/metrics").text
    return metric(scrape(text), "kvfabric_bad_streams_total", reason=reason)


def committed(files: CollectorFiles, run: str) -> int:
    runs = httpx.get(files.http_url + "/api/v1/runs").json()
    return next((r["events"] for r in runs if r["run_id"] == run), 0)


def wait_refused(files: CollectorFiles, reason: str, before: float) -> None:
    wait_until(lambda: bad_count(files, reason) == before + 1, what=f"bad_streams_total{{reason={reason}}}")


def refusal_lines(files: CollectorFiles, reason: str) -> list[str]:
    return [line for line in files.log().splitlines() if "refused" in line and f": {reason}: " in line]


def test_garbage_bytes_are_refused_and_nothing_else_is_affected(live: CollectorFiles) -> None:
    send_stream(live.socket_path, meta("g-before", "run-garbage", "e0"), bulk_batches("run-garbage", "e0", 3, 100))
    wait_until(lambda: committed(live, "run-garbage") == 300, what="first stream committed")
    before = bad_count(live, "garbage")

    send_bytes(live.socket_path, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" * 10)
    wait_refused(live, "garbage", before)
    lines = refusal_lines(live, "garbage")
    assert len(lines) == 1 and "conn#" in lines[0] and "Arrow IPC marker" in lines[0]

    # Stored data intact, and a later good stream is accepted next to it.
    send_stream(live.socket_path, meta("g-after", "run-garbage", "e1"), bulk_batches("run-garbage", "e1", 2, 50))
    wait_until(lambda: committed(live, "run-garbage") == 400, what="later stream committed")
    assert bad_count(live, "garbage") == before + 1


def test_wrong_schema_version_is_refused_naming_the_stream(live: CollectorFiles) -> None:
    before = bad_count(live, "schema_version")
    bad = stream_bytes(meta("v-wrong", "run-version", "e0", version=99), bulk_batches("run-version", "e0", 1, 10))
    send_bytes(live.socket_path, bad)
    wait_refused(live, "schema_version", before)
    line = refusal_lines(live, "schema_version")[-1]
    assert "'v-wrong'" in line and "schema version 99 is not supported" in line
    assert committed(live, "run-version") == 0
    assert httpx.get(live.http_url + "/api/v1/runs/run-version/summary").status_code == 404


def test_mismatched_columns_are_refused(live: CollectorFiles) -> None:
    before = bad_count(live, "schema_mismatch")
    schema = S.EVENT_SCHEMA.remove(S.COLUMNS.index("family")).with_metadata(meta("m1", "run-mismatch", "e0"))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema):
        pass
    send_bytes(live.socket_path, sink.getvalue().to_pybytes())
    wait_refused(live, "schema_mismatch", before)
    assert "missing ['family']" in refusal_lines(live, "schema_mismatch")[-1]


def test_truncated_stream_keeps_the_batches_accepted_before(live: CollectorFiles) -> None:
    before = bad_count(live, "truncated")
    batches = bulk_batches("run-trunc", "e0", 3, 100)
    whole = stream_bytes(meta("t1", "run-trunc", "e0"), batches, end=False)
    cut = len(whole) - batches[-1].nbytes // 2  # inside the third batch's body
    send_bytes(live.socket_path, whole[:cut])
    wait_refused(live, "truncated", before)
    wait_until(lambda: committed(live, "run-trunc") == 200, what="the two whole batches")
    time.sleep(0.2)
    assert committed(live, "run-trunc") == 200
    assert "2 batches, 200 rows accepted before are kept" in refusal_lines(live, "truncated")[-1]


def test_oversized_batches_are_refused_by_rows_and_by_bytes(live: CollectorFiles) -> None:
    before = bad_count(live, "oversized")
    ok = bulk_batches("run-big", "e0", 1, 10)
    too_many_rows = bulk_batches("run-big", "e0", 1, 1001, first_seq=1)  # limit is 1000 rows
    send_bytes(live.socket_path, stream_bytes(meta("big1", "run-big", "e0"), ok + too_many_rows), refused_ok=True)
    wait_refused(live, "oversized", before)
    assert "1001 rows exceeds the limit of 1000" in refusal_lines(live, "oversized")[-1]

    # 900 rows of 2 KiB strings: the message is refused from its header, before its body is read.
    fat = batch([{"ts_ns": 1, "event": "cache_reset", "run_id": "run-big", "engine": "e1", "request_id": "x" * 2048}]
                * 900, seq=0)
    send_bytes(live.socket_path, stream_bytes(meta("big2", "run-big", "e1"), [fat]), refused_ok=True)
    wait_refused(live, "oversized", before + 1)
    assert "exceeds the limit of 1048576" in refusal_lines(live, "oversized")[-1]
    assert committed(live, "run-big") == 10


def test_a_client_that_never_sends_its_schema_is_cut_after_the_handshake_timeout(live: CollectorFiles) -> None:
    before = bad_count(live, "handshake_timeout")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(live.socket_path)
        s.sendall(b"\xff\xff\xff\xff")  # a valid start, then silence
        s.settimeout(5.0)
        t0 = time.monotonic()
        assert s.recv(1) == b""  # the collector closed the connection
        assert 0.8 <= time.monotonic() - t0 < 4.0
    wait_refused(live, "handshake_timeout", before)


def test_unknown_event_type_refuses_the_batch_and_keeps_earlier_ones(live: CollectorFiles) -> None:
    before = bad_count(live, "schema_mismatch")
    good = bulk_batches("run-event", "e0", 2, 10)
    bad = batch([{"ts_ns": 1, "event": "block_exploded", "run_id": "run-event", "engine": "e0"}], seq=2)
    send_stream(live.socket_path, meta("ev1", "run-event", "e0"), [*good, bad])
    wait_refused(live, "schema_mismatch", before)
    assert "unknown event types ['block_exploded']" in refusal_lines(live, "schema_mismatch")[-1]
    wait_until(lambda: committed(live, "run-event") == 20, what="batches before the bad one")
