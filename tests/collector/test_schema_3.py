"""Schema version 3 (``host``, ``dp_rank``, ``tenant``, ``lora``) at the collector: a schema-2 file is upgraded in
place (the four columns appended, in order, old rows null; ``streams`` gains ``host`` and ``dp_rank``), and the
stream metadata's optional ``kvfabric.host`` / ``kvfabric.dp_rank`` are parsed, absent or not."""

from __future__ import annotations

from pathlib import Path

import duckdb
import pytest
from support.collector_testkit import meta

from kvfabric.contract import schema as S
from kvfabric.ingest.errors import BadStream
from kvfabric.ingest.store import STREAMS_SCHEMA, load_streams, open_database, quote
from kvfabric.ingest.validate import parse_stream_meta

NEW = ("host", "dp_rank", "tenant", "lora")
TYPES = {"int64": "BIGINT", "int32": "INTEGER", "string": "VARCHAR", "double": "DOUBLE", "bool": "BOOLEAN"}


def schema_2_file(path: str) -> None:
    """A file as a schema-2 collector left it: events up to ``reason``, streams without host and rank."""
    con = duckdb.connect(path)
    old_events = [f for f in S.EVENT_SCHEMA if f.name not in NEW]
    assert [f.name for f in old_events] == list(S.COLUMNS[:S.COLUMNS.index("reason") + 1])
    con.execute("CREATE TABLE kvfabric_meta (key VARCHAR, value VARCHAR)")
    con.execute("INSERT INTO kvfabric_meta VALUES ('schema_version', '2')")
    con.execute("CREATE TABLE events (" + ", ".join(
        f"{quote(f.name)} {TYPES[str(f.type)]}{'' if f.nullable else ' NOT NULL'}" for f in old_events) + ")")
    con.execute("INSERT INTO events (seq, ts_ns, event, run_id, engine, block_hash, reason) "
                "VALUES (0, 1, 'block_evicted', 'old', 'e', 7, 'pressure')")
    old_streams = [f for f in STREAMS_SCHEMA if f.name not in ("host", "dp_rank", "source")]
    con.execute("CREATE TABLE streams (" + ", ".join(f"{quote(f.name)} {TYPES[str(f.type)]}" for f in old_streams)
                + ")")
    con.execute("INSERT INTO streams (stream_id, run_id, engine, block_size, num_blocks, policy, schema_version, "
                "peer, first_seen_ns, last_seen_ns, connections, batches, rows, last_seq, gaps, seq_resets, "
                "duplicates, refused_batches, refused_rows) "
                "VALUES ('s', 'old', 'e', 16, 100, 'lru', 2, 'p', 1, 2, 1, 1, 1, 0, 0, 0, 0, 0, 0)")
    con.close()


def test_a_schema_2_file_is_upgraded_in_place(tmp_path: Path) -> None:
    path = str(tmp_path / "v2.duckdb")
    schema_2_file(path)
    con = open_database(path)
    try:
        assert [r[0] for r in con.execute("DESCRIBE events").fetchall()] == list(S.COLUMNS)  # appended, in order
        described = {r[0]: r[1] for r in con.execute("DESCRIBE events").fetchall()}
        assert [described[c] for c in NEW] == ["VARCHAR", "INTEGER", "VARCHAR", "VARCHAR"]
        assert con.execute("SELECT value FROM kvfabric_meta").fetchall() == [(str(S.SCHEMA_VERSION),)]
        assert S.SCHEMA_VERSION == 3
        assert con.execute("SELECT block_hash, reason, host, dp_rank, tenant, lora FROM events").fetchall() == [
            (7, "pressure", None, None, None, None)]
        assert [r[0] for r in con.execute("DESCRIBE streams").fetchall()] == [f.name for f in STREAMS_SCHEMA]
        (state,) = load_streams(con).values()
        assert (state.stream_id, state.rows, state.host, state.dp_rank, state.source) == ("s", 1, None, None, "plugin")
        # The upgraded file takes schema-3 rows.
        con.execute("INSERT INTO events (seq, ts_ns, event, run_id, engine, host, dp_rank, tenant, lora) "
                    "VALUES (1, 2, 'prefix_lookup', 'new', 'e', 'node-a', 1, 'tenant-1', 'adapter-x')")
    finally:
        con.close()
    again = open_database(path)  # (opening an upgraded file again changes nothing)
    try:
        assert again.execute("SELECT host, dp_rank, tenant, lora FROM events WHERE seq = 1").fetchall() == [
            ("node-a", 1, "tenant-1", "adapter-x")]
    finally:
        again.close()


def test_stream_host_and_rank_are_optional_metadata() -> None:
    base = meta("s", "r", "e")
    assert S.META_HOST not in S.REQUIRED_META and S.META_DP_RANK not in S.REQUIRED_META
    older = parse_stream_meta(S.stream_schema(base))
    assert (older.host, older.dp_rank) == (None, None)
    newer = parse_stream_meta(S.stream_schema({**base, S.META_HOST: "node-a", S.META_DP_RANK: "3"}))
    assert (newer.host, newer.dp_rank) == ("node-a", 3)
    for bad in ("three", "-1", str(2**31)):
        with pytest.raises(BadStream, match=S.META_DP_RANK):
            parse_stream_meta(S.stream_schema({**base, S.META_DP_RANK: bad}))
