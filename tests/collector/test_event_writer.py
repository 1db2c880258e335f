"""The ingest side's one writer, :class:`~kvfabric.ingest.writer.EventWriter`, on its own: checked batches in
through the bounded queue, rows committed to DuckDB in order, a resent batch stored once, nothing left at stop."""

from __future__ import annotations

from pathlib import Path

from support.collector_testkit import batch, meta

from kvfabric.contract import schema as S
from kvfabric.ingest.metrics import CollectorMetrics
from kvfabric.ingest.queue import BatchQueue, BatchReceived, StreamOpened
from kvfabric.ingest.store import open_database
from kvfabric.ingest.validate import BatchLimits, check_batch, parse_stream_meta
from kvfabric.ingest.writer import EventWriter


def _rows(n: int, first_ts: int) -> list[dict]:
    return [{"ts_ns": first_ts + i, "step": i, "engine": "e0", "run_id": "r", "event": S.BLOCK_ALLOCATED,
             "block_id": i, "ref_count": 1, "policy": "lru"} for i in range(n)]


def test_the_writer_commits_every_batch_once_in_order(tmp_path: Path) -> None:
    stream_meta = parse_stream_meta(S.stream_schema(meta("s1", "r", "e0")))
    checked = [check_batch(batch(_rows(3, 100 * seq), seq), BatchLimits(), stream_meta) for seq in range(3)]
    con = open_database(str(tmp_path / "w.duckdb"))
    queue = BatchQueue(10**6, 1 << 30)
    writer = EventWriter(con, queue, CollectorMetrics())
    queue.put(StreamOpened(meta=stream_meta, peer="test"))
    writer.start()
    for b, info in [*checked, checked[1]]:  # (the second batch again: a resend after a lost acknowledgement)
        queue.put(BatchReceived("s1", b, info))
    report = writer.stop()
    assert report.clean
    stored = con.execute("SELECT seq, ts_ns, block_id FROM events ORDER BY seq, ts_ns").fetchall()
    assert stored == [(seq, 100 * seq + i, i) for seq in range(3) for i in range(3)]
    con.close()
