"""The fleet overview (sql/fleet.sql, ``GET /api/v1/fleet``, ``kvfabric fleet``) over what a real collector stored:
two hosts x two engines, each stream with its host and data-parallel rank in its metadata and on its rows, written
out event by event so every expected number below is plain arithmetic. Once on a DuckDB file, once on a lake
(DuckLake catalogued in a throwaway PostgreSQL, data in a local folder or on moto's S3: support.lake_testkit).

Each event is early (T0 + 1 s ...) or late (T0 + 100 s ...); the window [T0 + 50 s, ...) keeps the late ones.

engine      host  dp  block  lookups (prompt, hit)             evicted share_degree   rebuilt   sink_dropped  seq
hA/dp0      hA    0   16     early (100,50) (200,100), late    early 1,2,3, late 2    early 2,  early 4
                             (300,0)                                                  late 1
hA/dp1      hA    1   16     early (64,32)                     late 1                 late 1
hB/dp0      hB    0   32     late (128,64) (128,128)           early 2,2              -
hB/dp1      hB    1   32     early (50,0)                      -                      early 3   late 7        0, 2
                                                                                                            (1 lost)
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import duckdb
import httpx
import pyarrow as pa
import pytest
from support.collector_testkit import NS, T0, batch, collector_files, meta, stream_bytes, wait_until
from support.lake_testkit import LakeLocation as KitLocation

from kvfabric.cli import main as kvfabric_main
from kvfabric.collector import CollectorProcess
from kvfabric.ingest.store import open_database
from kvfabric.lake import LakeLocation
from kvfabric.queries import QueryRunner
from kvfabric.queries.sources import connector

RUN = "fleet"
LATE = T0 + 50 * NS
ENGINES = (("hA", "hA/dp0", 0, 16), ("hA", "hA/dp1", 1, 16), ("hB", "hB/dp0", 0, 32), ("hB", "hB/dp1", 1, 32))
COUNTS = ("requests", "prompt_tokens", "hit_tokens", "evicted_blocks", "shared_anchor_evictions", "rebuilt_blocks",
          "wasted_prefill_tokens", "events", "sink_dropped_events", "sequence_gaps")


def _rows(engine: str) -> list[tuple[bool, dict[str, Any]]]:
    """(late, row) of one engine, in emission order."""
    lookups = {"hA/dp0": [(False, 100, 50), (False, 200, 100), (True, 300, 0)], "hA/dp1": [(False, 64, 32)],
               "hB/dp0": [(True, 128, 64), (True, 128, 128)], "hB/dp1": [(False, 50, 0)]}[engine]
    evictions = {"hA/dp0": [(False, 1), (False, 2), (False, 3), (True, 2)], "hA/dp1": [(True, 1)],
                 "hB/dp0": [(False, 2), (False, 2)], "hB/dp1": []}[engine]
    rebuilt = {"hA/dp0": [False, False, True], "hA/dp1": [True], "hB/dp0": [], "hB/dp1": [False] * 3}[engine]
    dropped = {"hA/dp0": [(False, 4)], "hB/dp1": [(True, 7)]}.get(engine, [])
    out: list[tuple[bool, dict[str, Any]]] = []
    out += [(late, {"event": "prefix_lookup", "request_id": f"r{i}", "prompt_tokens": p, "hit_tokens": h, "count": 0})
            for i, (late, p, h) in enumerate(lookups)]
    out += [(late, {"event": "block_evicted", "block_hash": 100 + i, "share_degree": sd, "age_ns": NS})
            for i, (late, sd) in enumerate(evictions)]
    out += [(late, {"event": "block_rebuilt", "block_hash": 100 + i, "age_ns": NS}) for i, late in enumerate(rebuilt)]
    out += [(late, {"event": "sink_dropped", "count": n}) for late, n in dropped]
    return out


def stream_of(host: str, engine: str, dp_rank: int, block_size: int) -> bytes:
    """The engine's whole Arrow stream: early rows in batch seq 0, late rows in the next batch (seq 2 for hB/dp1, so
    the collector counts one batch lost)."""
    rows: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    for k, (late, row) in enumerate(_rows(engine)):
        ts = (LATE + 50 * NS if late else T0 + NS) + k * 1000
        rows[late].append({"ts_ns": ts, "run_id": RUN, "engine": engine, "host": host, "dp_rank": dp_rank,
                           "policy": "lru", **row})
    batches = [batch(rows[False], 0), batch(rows[True], 2 if engine == "hB/dp1" else 1)]
    m = meta(f"s-{engine}", RUN, engine, block_size=block_size, host=host, dp_rank=dp_rank)
    return stream_bytes(m, [b for b in batches if b.num_rows])


EXPECTED_ALL = {  # engine -> COUNTS
    "hA/dp0": (3, 600, 150, 4, 3, 3, 48, 11, 4, 0),
    "hA/dp1": (1, 64, 32, 1, 0, 1, 16, 3, 0, 0),
    "hB/dp0": (2, 256, 192, 2, 2, 0, 0, 4, 0, 0),
    "hB/dp1": (1, 50, 0, 0, 0, 3, 96, 5, 7, 1),
}
EXPECTED_LATE = {  # since_ns = LATE; sequence_gaps: every stream has late events, so all its gaps count
    "hA/dp0": (1, 300, 0, 1, 1, 1, 16, 3, 0, 0),
    "hA/dp1": (0, 0, 0, 1, 0, 1, 16, 2, 0, 0),
    "hB/dp0": (2, 256, 192, 0, 0, 0, 0, 2, 0, 0),
    "hB/dp1": (0, 0, 0, 0, 0, 0, 0, 1, 7, 1),
}


def _send_all(socket_path: str) -> int:
    total = 0
    for host, engine, dp, bs in ENGINES:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(socket_path)
            s.sendall(stream_of(host, engine, dp, bs))
        total += len(_rows(engine))
    return total


def _settled(url: str, total: int) -> dict[str, Any]:
    """GET /api/v1/fleet once every row is committed and two answers in a row agree."""
    last: list[Any] = [None]

    def ready() -> dict[str, Any] | None:
        body = httpx.get(url + "/api/v1/fleet", params={"run": RUN}, timeout=10).json()
        if body.get("totals", {}).get("events") != total or body != last[0]:
            last[0] = body
            return None
        return body

    return wait_until(ready, timeout=60, what="the fleet's rows committed")


def _check(overview: dict[str, Any], expected: dict[str, tuple[int, ...]]) -> None:
    got = {e["engine"]: e for e in overview["engines"]}
    assert [(e["host"], e["engine"], e["dp_rank"]) for e in overview["engines"]] == [
        (h, e, dp) for h, e, dp, _ in ENGINES]
    for engine, numbers in expected.items():
        e = got[engine]
        assert tuple(e[k] for k in COUNTS) == numbers, engine
        assert e["runs"] == [RUN]
        assert e["prefix_hit_rate"] == pytest.approx(e["hit_tokens"] / e["prompt_tokens"] if e["prompt_tokens"] else 0)
        assert e["shared_anchor_eviction_ratio"] == pytest.approx(
            e["shared_anchor_evictions"] / e["evicted_blocks"] if e["evicted_blocks"] else 0)
        assert e["ingest_lag_s"] is not None and e["ingest_lag_s"] > 0  # stored events are from 2023
    t = overview["totals"]
    for k in COUNTS:  # the overview is the sum of its engines
        assert t[k] == sum(e[k] for e in overview["engines"]), k
        assert t[k] == sum(n[COUNTS.index(k)] for n in expected.values()), k
    assert t["prefix_hit_rate"] == pytest.approx(t["hit_tokens"] / t["prompt_tokens"])
    assert t["shared_anchor_eviction_ratio"] == pytest.approx(t["shared_anchor_evictions"] / t["evicted_blocks"])
    assert t["ingest_lag_s"] == max(e["ingest_lag_s"] for e in overview["engines"])
    assert (t["hosts"], t["engines"], t["runs"]) == (2, 4, [RUN])
    assert t["first_ts_ns"] == min(e["first_ts_ns"] for e in overview["engines"])
    assert t["last_ts_ns"] == max(e["last_ts_ns"] for e in overview["engines"])


def _check_windows(q: QueryRunner) -> None:
    whole = q.fleet(run=RUN)
    _check(whole, EXPECTED_ALL)
    assert (whole["since_ns"], whole["until_ns"]) == (None, None)
    assert whole["totals"]["events"] == 23 and whole["totals"]["wasted_prefill_tokens"] == 160
    late = q.fleet(since_ns=LATE, run=RUN)
    _check(late, EXPECTED_LATE)
    early = q.fleet(until_ns=LATE, run=RUN)
    assert early["until_ns"] == LATE
    # the window cuts: early + late == whole, engine by engine, for every count but the streams' gaps
    for a, b, w in zip(early["engines"], late["engines"], whole["engines"], strict=True):
        for k in COUNTS[:-1]:
            assert a[k] + b[k] == w[k], (w["engine"], k)
        assert a["last_ts_ns"] < LATE <= b["first_ts_ns"]
    assert early["totals"]["events"] == 23 - late["totals"]["events"] == 15
    assert q.fleet(since_ns=T0 + 10**6 * NS)["engines"] == []  # nothing that late: no engine
    assert q.fleet(run=RUN) == q.fleet()  # one run stored: the same answer


def _cli_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert kvfabric_main(["fleet", *argv, "--format", "json"]) == 0
    out = capsys.readouterr().out
    assert len(out.strip().splitlines()) == 1  # one JSON object on one line
    return json.loads(out)


def _cli_table(capsys: pytest.CaptureFixture[str], *argv: str) -> list[str]:
    assert kvfabric_main(["fleet", *argv]) == 0
    return capsys.readouterr().out.splitlines()


def test_fleet_on_a_file_rest_and_cli_agree(capsys: pytest.CaptureFixture[str]) -> None:
    with collector_files() as files:
        with files.process():
            total = _send_all(files.socket_path)
            rest = _settled(files.http_url, total)
            late_rest = httpx.get(files.http_url + "/api/v1/fleet", params={"since_ns": LATE}).json()
            bad = httpx.get(files.http_url + "/api/v1/fleet", params={"since": "1h"})
            assert bad.status_code == 422 and "since_ns" in bad.json()["detail"]
        _check(rest, EXPECTED_ALL)
        q = QueryRunner.for_path(files.db_path)
        _check_windows(q)
        assert rest == q.fleet(run=RUN)  # REST returns exactly what the runner does
        assert late_rest == q.fleet(since_ns=LATE)
        assert _cli_json(capsys, "--db", files.db_path, "--run", RUN) == rest
        assert _cli_json(capsys, "--db", files.db_path, "--since-ns", str(LATE)) == late_rest
        lines = _cli_table(capsys, "--db", files.db_path)
        assert lines[0] == "fleet: every run, every stored event"
        header, *rows = lines[1:]
        assert header.split()[:3] == ["HOST", "ENGINE", "DP"] and len(rows) == 5
        assert [r.split()[:2] for r in rows[:4]] == [[h, e] for h, e, _, _ in ENGINES]
        assert rows[4].startswith("TOTAL (2 hosts)") and "4 engines" in rows[4]
        assert rows[4].split()[5:7] == ["7", "970"]  # requests, prompt tokens: the sums
        # kvfabric query fleet is the same query
        assert kvfabric_main(["query", "fleet", "--db", files.db_path, "--format", "json"]) == 0
        assert json.loads(capsys.readouterr().out) == rest
        # a --since in the future of every event (they are from 2023): no engine
        assert _cli_json(capsys, "--db", files.db_path, "--since", "1h")["engines"] == []
        assert kvfabric_main(["fleet", "--db", files.db_path, "--run", "nope"]) == 2
        assert "unknown run 'nope'" in capsys.readouterr().err


def test_fleet_on_a_lake_rest_and_cli_agree(lake_location: KitLocation, capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in lake_location.env.items():  # (this process reads the lake too: kvfabric fleet in-process)
        monkeypatch.setenv(name, value)
    with collector_files() as files:
        config = files.config(lake=lake_location.catalog, data=lake_location.data, coalesce_ms=50)
        with CollectorProcess(config, log_path=files.log_path, env={**os.environ}, ready_timeout=60.0):
            total = _send_all(files.socket_path)
            rest = _settled(files.http_url, total)
            # a lake has any number of readers beside its writers: the CLI reads it while the collector runs
            location = LakeLocation.parse(lake_location.catalog, lake_location.data)
            q = QueryRunner(connector("", location))
            assert rest == q.fleet(run=RUN)
            assert _cli_json(capsys, "--lake", lake_location.catalog, "--data", lake_location.data) == rest
        _check(rest, EXPECTED_ALL)
        _check_windows(q)


def test_events_of_older_files_without_a_host_take_their_streams(tmp_path: Path) -> None:
    """Rows without a host (files older than schema 3) group under the host their stream declared, else ''."""
    path = str(tmp_path / "old.duckdb")
    open_database(path).close()
    con = duckdb.connect(path)
    con.execute("INSERT INTO streams (stream_id, run_id, engine, block_size, host, gaps, first_seen_ns, last_seen_ns, "
                "first_ts_ns, last_ts_ns) VALUES ('s1', 'r', 'e1', 16, 'declared', 0, 1, 5, 1, 3), "
                "('s2', 'r', 'e2', 16, NULL, 2, 1, 9, 1, 4)")
    table = pa.Table.from_batches([batch([
        {"ts_ns": 1, "run_id": "r", "engine": "e1", "event": "block_rebuilt"},
        {"ts_ns": 2, "run_id": "r", "engine": "e2", "event": "prefix_lookup", "prompt_tokens": 10, "hit_tokens": 5},
    ], 0)])
    con.register("t", table)
    con.execute("INSERT INTO events SELECT * FROM t")
    con.close()
    overview = QueryRunner.for_path(path).fleet()
    assert [(e["host"], e["engine"], e["wasted_prefill_tokens"], e["requests"], e["sequence_gaps"])
            for e in overview["engines"]] == [("", "e2", 0, 1, 2), ("declared", "e1", 16, 0, 0)]
    assert [e["ingest_lag_s"] for e in overview["engines"]] == [5e-9, 2e-9]
