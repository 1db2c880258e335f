"""Bad input against a real collector process: each kind of bad stream is refused with one log line naming the
peer/stream and the reason, counted in kvfabric_bad_streams_total{reason}, and confined to its connection:
batches accepted before stay stored, and the collector keeps accepting good streams. A batch whose content is bad
(invalid UTF-8, a value over the string cap, an unknown event type) is refused alone, counted in
kvfabric_refused_batches_total{reason}, and the stream goes on."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import httpx
import pyarrow as pa
import pytest
from support.collector_testkit import (
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

from kvfabric.contract import schema as S


@pytest.fixture(scope="module")
def live() -> Iterator[CollectorFiles]:
    with collector_files() as files:
        proc = files.process(handshake_timeout_s=1.0, max_batch_rows=1000, max_batch_bytes=1 << 20, coalesce_ms=20)
        with proc:
            yield files


def bad_count(files: CollectorFiles, reason: str) -> float:
    text = httpx.get(files.http_url + "/metrics").text
    return metric(scrape(text), "kvfabric_bad_streams_total", reason=reason)


def refused_batches(files: CollectorFiles, reason: str) -> float:
    text = httpx.get(files.http_url + "/metrics").text
    return metric(scrape(text), "kvfabric_refused_batches_total", reason=reason)


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


def test_unknown_event_type_refuses_that_batch_only(live: CollectorFiles) -> None:
    before = refused_batches(live, "schema_mismatch")
    good = bulk_batches("run-event", "e0", 2, 10)
    bad = batch([{"ts_ns": 1, "event": "block_exploded", "run_id": "run-event", "engine": "e0"}], seq=2)
    after = bulk_batches("run-event", "e0", 1, 10, first_seq=3)
    send_stream(live.socket_path, meta("ev1", "run-event", "e0"), [*good, bad, *after])
    wait_until(lambda: refused_batches(live, "schema_mismatch") == before + 1, what="refused batch counted")
    assert "unknown event types ['block_exploded']" in files_log_lines(live, "refused batch seq 2")[-1]
    wait_until(lambda: committed(live, "run-event") == 30, what="the batches before and after the bad one")


def files_log_lines(files: CollectorFiles, needle: str) -> list[str]:
    return [line for line in files.log().splitlines() if needle in line]


def _with_bytes(b: pa.RecordBatch, column: str, raw: bytes) -> pa.RecordBatch:
    i = S.COLUMNS.index(column)
    values = pa.array([raw] * b.num_rows, pa.binary()).view(pa.string())
    return b.set_column(i, S.EVENT_SCHEMA.field(i), values)


@pytest.mark.parametrize("column", ["event", "run_id", "request_id", "family"])
def test_invalid_utf8_refuses_only_its_batch_with_a_clear_cause(live: CollectorFiles, column: str) -> None:
    """Issue #9 defect 5: invalid UTF-8 in ``event``/``run_id`` raised an uncaught UnicodeDecodeError in the
    connection thread; in ``request_id``/``family`` DuckDB refused the insert and the whole coalesced window was
    lost behind a misleading "Current transaction is aborted". Now: that batch alone is refused, counted, logged
    with its cause, and every other batch (before and after, same stream and others) is stored."""
    run = f"run-utf8-{column}"
    before = refused_batches(live, "invalid_utf8")
    rows = bulk_batches(run, "e0", 4, 25)
    bad = _with_bytes(rows[2], column, b"req-\xff\xfe")
    other = meta(f"utf8-other-{column}", run, "e1")
    # Both streams in flight together: the bad batch must not take the other stream's rows with it.
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as a, socket.socket(socket.AF_UNIX) as b:
        a.connect(live.socket_path)
        b.connect(live.socket_path)
        a.sendall(stream_bytes(meta(f"utf8-{column}", run, "e0"), [rows[0], rows[1], bad, rows[3]]))
        b.sendall(stream_bytes(other, bulk_batches(run, "e1", 3, 25)))
    wait_until(lambda: refused_batches(live, "invalid_utf8") == before + 1, what="refusal counted")
    wait_until(lambda: committed(live, run) == 3 * 25 + 3 * 25, what="every other batch stored")
    line = files_log_lines(live, f"utf8-{column}")
    refusal = [x for x in line if "refused batch seq 2" in x]
    assert refusal and "invalid_utf8" in refusal[-1] and f"column {column} holds invalid UTF-8" in refusal[-1]
    log = live.log()
    assert "Traceback" not in log and "UnicodeDecodeError" not in log and "transaction is aborted" not in log
    with httpx.Client(base_url=live.http_url) as c:
        assert c.get("/healthz").status_code == 200


def test_invalid_utf8_in_metadata_refuses_the_stream(live: CollectorFiles) -> None:
    before = bad_count(live, "invalid_utf8")
    m = meta("utf8-meta", "run-utf8-meta", "e0")
    schema = S.EVENT_SCHEMA.with_metadata({**{k.encode(): v.encode() for k, v in m.items()},
                                           S.META_POLICY.encode(): b"lr\xffu"})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema) as w:
        w.write_batch(bulk_batches("run-utf8-meta", "e0", 1, 5)[0])
    send_bytes(live.socket_path, sink.getvalue().to_pybytes(), refused_ok=True)
    wait_refused(live, "invalid_utf8", before)
    assert "not valid UTF-8" in refusal_lines(live, "invalid_utf8")[-1]
    assert "Traceback" not in live.log()


def test_a_string_value_over_the_cap_is_refused(live: CollectorFiles) -> None:
    """A 100 MiB request_id was stored; now one value is capped (here 4096 bytes, the default)."""
    before = refused_batches(live, "value_too_long")
    ok = bulk_batches("run-long", "e0", 1, 10)
    fat = batch([{"ts_ns": 1, "event": "cache_reset", "run_id": "run-long", "engine": "e0",
                  "request_id": "x" * 100_000}], seq=1)
    send_stream(live.socket_path, meta("long1", "run-long", "e0"), [ok[0], fat])
    wait_until(lambda: refused_batches(live, "value_too_long") == before + 1, what="refusal counted")
    wait_until(lambda: committed(live, "run-long") == 10, what="the good batch")
    line = files_log_lines(live, "refused batch seq 1 of stream 'long1'")[-1]
    assert "holds a value of 100000 bytes (limit 4096)" in line


def test_refusal_log_lines_are_rate_limited_and_counted(live: CollectorFiles) -> None:
    """One log line per refused connection let a peer flood the log: now at most 5 per reason per 10 s, the rest
    counted in kvfabric_log_lines_suppressed_total (every refusal still counted in its own metric)."""
    before_lines = len(refusal_lines(live, "garbage"))
    before = bad_count(live, "garbage")
    text = httpx.get(live.http_url + "/metrics").text
    suppressed = metric(scrape(text), "kvfabric_log_lines_suppressed_total")
    for _ in range(40):
        send_bytes(live.socket_path, b"NOT ARROW AT ALL", refused_ok=True)
    wait_until(lambda: bad_count(live, "garbage") == before + 40, what="every refusal counted")
    text = httpx.get(live.http_url + "/metrics").text
    assert len(refusal_lines(live, "garbage")) - before_lines <= 5
    assert metric(scrape(text), "kvfabric_log_lines_suppressed_total") - suppressed >= 35
