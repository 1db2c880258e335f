"""The collector as a process: SIGTERM flush, restart + resume, sequence gaps, socket safety, locking, export."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys

import duckdb
import httpx
import pytest
from support.collector_testkit import (
    bulk_batches,
    collector_files,
    golden_streams,
    meta,
    metric,
    scrape,
    send_golden,
    send_stream,
    wait_until,
)
from support.sink_testkit import dropped_row, row

from kvfabric.collector import export_parquet, run_named_query
from kvfabric.queries import DatabaseUnavailable


def _metrics(url: str) -> dict:
    return scrape(httpx.get(url + "/metrics").text)


def test_sigterm_commits_everything_received_but_not_yet_written() -> None:
    with collector_files() as files:
        # A 20 s coalescing window: received rows wait in the writer queue, so SIGTERM must be what writes them.
        proc = files.process(coalesce_ms=20_000, coalesce_rows=10_000_000).start()
        for k in range(2):
            send_stream(files.socket_path, meta(f"flush{k}", "run-flush", f"e{k}"),
                        bulk_batches("run-flush", f"e{k}", 10, 1000))
        wait_until(lambda: metric(_metrics(files.http_url), "kvfabric_writer_queue_rows") == 20_000,
                   what="all rows received and still queued")
        assert metric(_metrics(files.http_url), "kvfabric_ingest_rows_total") == 0  # nothing committed yet
        assert proc.stop(timeout=30) == 0
        with duckdb.connect(files.db_path, read_only=True) as con:
            assert con.execute("SELECT count(*) FROM events").fetchone() == (20_000,)
            assert con.execute("SELECT sum(batches), sum(gaps) FROM streams").fetchone() == (20, 0)
        assert "kvfabric collector stopped" in files.log()


def test_restart_resumes_appending_and_gap_detection() -> None:
    with collector_files() as files:
        m = meta("resume", "run-resume", "e0")
        with files.process():
            send_stream(files.socket_path, m, bulk_batches("run-resume", "e0", 3, 10))  # seq 0..2
            wait_until(lambda: httpx.get(files.http_url + "/api/v1/runs").json(), what="first commit")
        with duckdb.connect(files.db_path, read_only=True) as con:
            assert con.execute("SELECT last_seq, gaps FROM streams").fetchone() == (2, 0)

        with files.process():  # same database: resumes
            send_stream(files.socket_path, m, bulk_batches("run-resume", "e0", 2, 10, first_seq=3))  # seq 3, 4
            # A sink reconnects only after its previous connection ended; wait until that one is stored, as the
            # kernel may still hold its bytes when the next connection's arrive (two reader threads).
            wait_until(lambda: httpx.get(files.http_url + "/api/v1/runs").json()[0]["events"] == 50,
                       what="second connection stored")
            send_stream(files.socket_path, m, bulk_batches("run-resume", "e0", 1, 10, first_seq=7))  # 5, 6 lost
            wait_until(lambda: metric(_metrics(files.http_url), "kvfabric_sequence_gaps_total") == 2,
                       what="gap counted")
            runs = httpx.get(files.http_url + "/api/v1/runs").json()
            assert [(r["run_id"], r["events"], r["sequence_gaps"]) for r in runs] == [("run-resume", 60, 2)]
        with duckdb.connect(files.db_path, read_only=True) as con:
            row = con.execute("SELECT batches, rows, last_seq, gaps, connections FROM streams").fetchone()
            assert row == (6, 60, 7, 2, 3)
            assert con.execute("SELECT count(*), count(DISTINCT seq) FROM events").fetchone() == (60, 6)
        assert "2 batch(es) missing (seq 5..6 never arrived)" in files.log()


def test_socket_is_private_stale_file_replaced_and_second_collector_refused() -> None:
    with collector_files() as files:
        os.makedirs(os.path.dirname(files.socket_path))
        stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stale.bind(files.socket_path)  # a crashed collector's leftover: a socket file nobody listens on
        stale.close()
        with files.process():
            mode = os.stat(files.socket_path).st_mode
            assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
            # Same socket, other database: refused, the running one untouched.
            other = [sys.executable, "-m", "kvfabric.collector", "--db", files.db_path + ".2", "--socket",
                     files.socket_path, "--no-http"]
            out = subprocess.run(other, capture_output=True, text=True, timeout=60)
            assert out.returncode == 2 and "is in use by another collector" in out.stderr
            # Same database, other socket: DuckDB's lock refuses it.
            other = [sys.executable, "-m", "kvfabric.collector", "--db", files.db_path, "--socket",
                     files.socket_path + ".2", "--no-http"]
            out = subprocess.run(other, capture_output=True, text=True, timeout=60)
            assert out.returncode == 2 and "lock" in out.stderr.lower()
            # Offline tools refuse a live database with a pointer to the REST API.
            with pytest.raises(DatabaseUnavailable, match="REST API"):
                run_named_query(files.db_path, "runs")
            assert httpx.get(files.http_url + "/healthz").json()["status"] == "ok"
        assert not os.path.exists(files.socket_path)  # removed on clean stop


def test_parquet_export_round_trip() -> None:
    with collector_files() as files:
        with files.process():
            total = send_golden(files.socket_path)
            wait_until(lambda: sum(r["events"] for r in httpx.get(files.http_url + "/api/v1/runs").json()) == total,
                       what="golden committed")
        out = os.path.join(files.root, "export")
        result = export_parquet(files.db_path, out)
        assert result["events_rows"] == total == sum(len(g.rows) for g in golden_streams())
        assert result["runs"] == {"runA": 21 + 9, "runB": 6}  # rows written out in collector_testkit
        assert result["streams_rows"] == 3
        assert os.path.isdir(os.path.join(out, "events", "run_id=runA"))
        con = duckdb.connect()
        back = dict(con.execute(
            "SELECT run_id, count(*) FROM read_parquet(?, hive_partitioning=true) GROUP BY run_id",
            [os.path.join(out, "events", "**", "*.parquet")],
        ).fetchall())
        assert back == result["runs"]
        with duckdb.connect(files.db_path, read_only=True) as db:
            stored = db.execute("SELECT sum(block_hash), sum(prompt_tokens) FROM events").fetchone()
        again = con.execute(
            "SELECT sum(block_hash), sum(prompt_tokens) FROM read_parquet(?, hive_partitioning=true)",
            [os.path.join(out, "events", "**", "*.parquet")],
        ).fetchone()
        assert again == stored
        assert con.execute("SELECT count(*) FROM read_parquet(?)", [result["streams_path"]]).fetchone() == (3,)
        # Exporting again replaces, never duplicates.
        assert export_parquet(files.db_path, out)["files"] == result["files"]
        assert con.execute("SELECT count(*) FROM read_parquet(?, hive_partitioning=true)",
                           [os.path.join(out, "events", "**", "*.parquet")]).fetchone() == (total,)


def test_the_hooks_own_unix_sink_streams_into_the_collector() -> None:
    """The contract between the two halves: the forwarder's sink -> this collector, nothing lost, seq in order."""
    from kvfabric.contract import schema as S
    from kvfabric.forwarder.buffer import EventBuffer
    from kvfabric.forwarder.sinks import UnixArrowSink

    with collector_files() as files:
        with files.process():
            m = {k: v for k, v in meta("ignored", "run-hook", "eng").items() if k != S.META_STREAM_ID}
            buffer = EventBuffer(capacity=10_000, wake_at=100)
            sink = UnixArrowSink(files.socket_path, buffer, m, dropped_row, batch_events=100, flush_ms=20)
            sink.start()
            for i in range(1000):
                buffer.append(row(i, engine="eng", run_id="run-hook"))
            sink.close()
            assert sink.lost_events == 0
            wait_until(lambda: httpx.get(files.http_url + "/api/v1/runs").json(), what="stream committed")
            wait_until(lambda: httpx.get(files.http_url + "/api/v1/runs").json()[0]["events"] == 1000,
                       what="all events")
        with duckdb.connect(files.db_path, read_only=True) as con:
            gaps, batches, next_seq = con.execute("SELECT gaps, batches, last_seq + 1 FROM streams").fetchone()
            assert gaps == 0 and batches == next_seq >= 10  # batches of <= 100 events, numbered without holes
            assert con.execute("SELECT count(DISTINCT block_id) FROM events").fetchone() == (1000,)
