"""Miss attribution and eviction causes (docs/design.md §5) on a hand-made, hook-shaped run whose answers are known
by hand, through a real collector process: REST, the CLI, the run summary, /metrics, the request story.

Run ``runM``, block size 4 (so C = (P - 1) // 4 blocks are cacheable), engine e0 unless said:

  t = 0 s   r1  fa  P 10  seals A0 A1                         novel 8, partial block 2
            r2  fa  P 12  hits A0 A1, seals A2                hit 8, A2 is the last-token block: uncacheable 4
            (r3's allocation evicts A2, A1: pressure)
            r3  fb  P  9  seals B0 B1                         novel 8, uncacheable 1
            r4  fa  P 14  hits A0, seals A1 A2                hit 4, evicted 8 (both by r3, pressure), unc. 2
            r15 fa  P  8  on engine e1: seals A0 A1           novel 4 (another engine's cache), last token 4
  t = 10 s  (a connector evicts A0)  r6 fa P 6 seals A0       evicted 4 (connector), uncacheable 2
            (reset: A0 A1 A2 B0 B1 evicted, reason reset)
            r5  fb  P  8  seals B0 B1                         evicted 4 (reset), last token 4
            r7  fc  P 13  seals C0; the gate refuses 2 blocks novel 4, uncacheable 9 (8 gate + 1 partial)
            r8  fc  P  3                                      uncacheable 3 (shorter than a block)
            (an eviction whose emitter gave no reason: unknown)
  t = 20 s  r9  fd  P 13  seals D0, later D1 D2               novel 12 (r10 sealed D1 D2 after r9's lookup)
            r10 fd  P 13  hits D0, seals D1 D2                hit 4, novel 8, uncacheable 1
            r11 fe  P  9  seals E0, preempted; E0 evicted     novel 4, uncacheable 5 (E1 never computed)
            r12 ff  P  8  seals F0 F1, decode F2; preempted   novel 4, last token 4
            r11 again: seals E0 E1                            evicted 4 (its own earlier E0), novel 4, unc. 1
            r12 again: hits F0 F1 F2 (12 tokens > P)           hit 8 (+4 past its prompt)
            r13 fg  P 12  seals G0 G1 G2; then G0 evicted     novel 8, last token 4
            r14 fg  P 13  seals G0 G1 G2                      evicted 12 (G0 evicted; G1 G2 behind it), unc. 1
Evictions: pressure 4 (A2 A1 E0 G0), connector 1, reset 5, unknown 1.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import duckdb
import httpx
import pytest
from support.collector_testkit import (
    NS,
    T0,
    EventScript,
    collector_files,
    metric,
    scrape,
    send_scripts,
    send_stream,
    wait_rows,
    wait_until,
)

from kvfabric.cli import main as kvfabric_main
from kvfabric.contract import schema as S
from kvfabric.ingest.store import IncompatibleDatabase, open_database, streams_ddl
from kvfabric.queries import QueryRunner, catalog

A = [1000, 1001, 1002]
B = [2000, 2001]
C = [3000, 3001, 3002]
D = [4000, 4001, 4002]
E = [5000, 5001]
F = [6000, 6001, 6002]
G = [7000, 7001, 7002]

# (request, admission) -> (family, P, hit, evicted, novel, uncacheable, hit past prompt)
EXPECTED: dict[tuple[str, int], tuple[str, int, int, int, int, int, int]] = {
    ("r1", 0): ("fa", 10, 0, 0, 8, 2, 0),
    ("r2", 0): ("fa", 12, 8, 0, 0, 4, 0),
    ("r3", 0): ("fb", 9, 0, 0, 8, 1, 0),
    ("r4", 0): ("fa", 14, 4, 8, 0, 2, 0),
    ("r15", 0): ("fa", 8, 0, 0, 4, 4, 0),
    ("r6", 0): ("fa", 6, 0, 4, 0, 2, 0),
    ("r5", 0): ("fb", 8, 0, 4, 0, 4, 0),
    ("r7", 0): ("fc", 13, 0, 0, 4, 9, 0),
    ("r8", 0): ("fc", 3, 0, 0, 0, 3, 0),
    ("r9", 0): ("fd", 13, 0, 0, 12, 1, 0),
    ("r10", 0): ("fd", 13, 4, 0, 8, 1, 0),
    ("r11", 0): ("fe", 9, 0, 0, 4, 5, 0),
    ("r12", 0): ("ff", 8, 0, 0, 4, 4, 0),
    ("r11", 1): ("fe", 9, 0, 4, 4, 1, 0),
    ("r12", 1): ("ff", 8, 8, 0, 0, 0, 4),
    ("r13", 0): ("fg", 12, 0, 0, 8, 4, 0),
    ("r14", 0): ("fg", 13, 0, 12, 0, 1, 0),
}
WINDOW_OF = {r: 0 for r in ("r1", "r2", "r3", "r4", "r15")} | {r: 1 for r in ("r6", "r5", "r7", "r8")} | {
    r: 2 for r in ("r9", "r10", "r11", "r12", "r13", "r14")}
FIELDS = ("prompt_tokens", "hit_tokens", "evicted_tokens", "novel_tokens", "uncacheable_tokens",
          "hit_tokens_past_prompt")


def _sum(keys: list[tuple[str, int]]) -> dict[str, int]:
    out = dict.fromkeys(("admissions", *FIELDS), 0)
    for k in keys:
        out["admissions"] += 1
        for f, v in zip(FIELDS, EXPECTED[k][1:], strict=True):
            out[f] += v
    return out


def scripts() -> list[EventScript]:
    e0 = EventScript("runM", "e0")
    e0.admit("r1", "fa", 10, A[:2])
    e0.free("r1", A, [0, 1])
    e0.step().admit("r2", "fa", 12, A, hit_blocks=2, seal=[2])
    e0.free("r2", A, [0, 1, 2])
    e0.step()
    e0.evict(A[2], "pressure", by="r3", family="fa", depth=2)
    e0.evict(A[1], "pressure", by="r3", family="fa", depth=1, share_degree=2)
    e0.admit("r3", "fb", 9, B)
    e0.free("r3", B, [0, 1])
    e0.step().admit("r4", "fa", 14, A, hit_blocks=1, seal=[1, 2])
    e0.free("r4", A, [0, 1, 2])

    e0.at(10.5).step()
    e0.evict(A[0], "connector", family="fa", depth=0, share_degree=3)
    e0.step().admit("r6", "fa", 6, A[:1])
    e0.free("r6", A, [0])
    e0.step().reset([A[0], A[1], A[2], B[0], B[1]])
    e0.step().admit("r5", "fb", 8, B)
    e0.free("r5", B, [0, 1])
    e0.step().admit("r7", "fc", 13, C, seal=[0], allocate=4, limited=2)
    e0.free("r7", C, [0])
    e0.step().admit("r8", "fc", 3, [], allocate=1)
    e0.evict(9999, None)

    e0.at(20.5).step().admit("r9", "fd", 13, D, seal=[0], allocate=1)
    e0.step().admit("r10", "fd", 13, D, hit_blocks=1, seal=[1, 2])
    e0.step().seal("r9", "fd", D, [1, 2])
    e0.free("r10", D, [0, 1, 2])
    e0.free("r9", D, [0, 1, 2])
    e0.step().admit("r11", "fe", 9, E, seal=[0], allocate=1)
    e0.step().free("r11", E, [0])
    e0.evict(E[0], "pressure", by="r12", family="fe", depth=0)
    e0.step().admit("r12", "ff", 8, F[:2])
    e0.step().seal("r12", "ff", F, [2])
    e0.step().free("r12", F, [0, 1, 2])
    e0.step().admit("r11", "fe", 9, E)
    e0.free("r11", E, [0, 1])
    e0.step().admit("r12", "ff", 8, F, hit_blocks=3, seal=[], allocate=1)
    e0.free("r12", F, [0, 1, 2])
    e0.step().admit("r13", "fg", 12, G)
    e0.step().free("r13", G, [0, 1, 2])
    e0.evict(G[0], "pressure", by="r14", family="fg", depth=0)
    e0.step().admit("r14", "fg", 13, G)

    e1 = EventScript("runM", "e1")
    e1.admit("r15", "fa", 8, A[:2])
    return [e0, e1]


@dataclass
class Recorded:
    db_path: str
    rest: dict[str, object]
    metrics: str
    refused_log: str


@pytest.fixture(scope="module")
def recorded() -> Iterator[Recorded]:
    with collector_files() as files:
        with files.process():
            rows = send_scripts(files.socket_path, [s.stream(f"m{i}") for i, s in enumerate(scripts())])
            wait_rows(files.http_url, "runM", rows)
            # A stream with an undocumented eviction reason is refused, and costs nothing else.
            bad = EventScript("runBad", "e0")
            bad.evict(1, "tired")
            send_stream(files.socket_path, bad.stream("bad").meta, bad.stream("bad").batches())
            wait_until(lambda: "unknown eviction reasons" in files.log(), what="refusal logged")
            rest: dict[str, object] = {}
            with httpx.Client(base_url=files.http_url, timeout=30) as c:
                rest["misses"] = c.get("/api/v1/runs/runM/misses", params={"bucket_s": 10}).json()
                rest["summary"] = c.get("/api/v1/runs/runM/summary").json()
                for rid in ("r4", "r7", "r11", "r14"):
                    rest[f"request:{rid}"] = c.get(f"/api/v1/requests/{rid}").json()
                rest["request:r5@runM"] = c.get("/api/v1/requests/r5", params={"run": "runM"}).json()
                rest["missing"] = (c.get("/api/v1/requests/nobody").status_code,
                                   c.get("/api/v1/runs/nope/misses").status_code,
                                   c.get("/api/v1/runs/runM/misses", params={"bucket_s": 0}).status_code,
                                   c.get("/api/v1/runs/runM/misses", params={"bucket_s": 0.001}).status_code)
                text = c.get("/metrics").text
                runs = {r["run_id"]: r["events"] for r in c.get("/api/v1/runs").json()}
                assert runs == {"runM": rows, "runBad": 0}, runs  # the refused batch stored nothing
        yield Recorded(files.db_path, rest, text, files.log())


@pytest.fixture(scope="module")
def q(recorded: Recorded) -> QueryRunner:
    return QueryRunner.for_path(recorded.db_path)


def test_every_admission_splits_exactly_as_defined(q: QueryRunner) -> None:
    got: dict[tuple[str, int], tuple] = {}
    seen: dict[str, int] = {}
    for a in q.admission_misses("runM"):
        n = seen[a["request_id"]] = seen.get(a["request_id"], -1) + 1
        got[(a["request_id"], n)] = (a["family"], *(a[f] for f in FIELDS))
        assert a["hit_tokens"] + a["evicted_tokens"] + a["novel_tokens"] + a["uncacheable_tokens"] == (
            a["prompt_tokens"])
    assert got == EXPECTED


def test_families_windows_and_run_totals(recorded: Recorded) -> None:
    m = recorded.rest["misses"]
    assert isinstance(m, dict)
    everything = _sum(list(EXPECTED))
    assert m["totals"] == everything
    families = sorted({v[0] for v in EXPECTED.values()})
    by_family = {i["family"]: {k: v for k, v in i.items() if k != "family"} for i in m["items"]}
    assert by_family == {f: _sum([k for k, v in EXPECTED.items() if v[0] == f]) for f in families}
    assert [i["evicted_tokens"] for i in m["items"]] == sorted((i["evicted_tokens"] for i in m["items"]),
                                                                reverse=True)
    start = T0 + 1000  # the run's first event
    windows = {(w["window_start_ns"] - start) // (10 * NS): {k: v for k, v in w.items() if k != "window_start_ns"}
               for w in m["windows"]}
    assert windows == {n: _sum([k for k in EXPECTED if WINDOW_OF[k[0]] == n]) for n in (0, 1, 2)}
    assert m["evictions_by_reason"] == {"pressure": 4, "connector": 1, "reset": 5, "unknown": 1}
    assert recorded.rest["missing"] == (404, 404, 422, 422)  # 0.001 s cuts 20 s into more than 10,000 windows


def test_run_summary_gains_the_split_and_the_reasons(recorded: Recorded) -> None:
    s = recorded.rest["summary"]
    assert isinstance(s, dict)
    t = _sum(list(EXPECTED))
    assert (s["prompt_tokens"], s["evicted_tokens"], s["novel_tokens"], s["uncacheable_tokens"],
            s["hit_tokens_past_prompt"]) == (t["prompt_tokens"], 32, 64, 48, 4)
    assert s["prefix_hit_tokens"] == 24 + 4  # prefix_lookup.hit_tokens as recorded (r12's resume hit 12)
    assert (s["prefix_hit_tokens"] - s["hit_tokens_past_prompt"] + s["evicted_tokens"] + s["novel_tokens"]
            + s["uncacheable_tokens"]) == s["prompt_tokens"] == 168
    assert s["evictions_by_reason"] == {"pressure": 4, "connector": 1, "reset": 5, "unknown": 1}
    assert s["evicted_blocks"] == 11


def test_metrics_count_evictions_by_reason(recorded: Recorded) -> None:
    m = scrape(recorded.metrics)
    got = {r: metric(m, "kvfabric_evicted_blocks_by_reason_total", run="runM", engine="e0", reason=r)
           for r in ("pressure", "connector", "reset", "unknown")}
    assert got == {"pressure": 4, "connector": 1, "reset": 5, "unknown": 1}
    total = metric(m, "kvfabric_evicted_blocks_total", run="runM", engine="e0", kind="shared_anchor") + metric(
        m, "kvfabric_evicted_blocks_total", run="runM", engine="e0", kind="private_tail")
    assert sum(got.values()) == total == 11
    # Series exist from the stream's start, at 0, for engines that never evicted.
    e1_reset = ("kvfabric_evicted_blocks_by_reason_total", frozenset({"run": "runM", "engine": "e1",
                                                                       "reason": "reset"}.items()))
    assert m[e1_reset] == 0
    assert "tired" not in recorded.metrics
    assert "unknown eviction reasons ['tired']" in recorded.refused_log


def _blocks(story: dict, admission: int = 0) -> list[tuple]:
    a = story["admissions"][admission]
    return [(b["depth"], b["tokens"], b["kind"], b["cause"], b["evicted_reason"], b["evicted_by_request"])
            for b in a["blocks"]]


def test_request_story_tells_why(recorded: Recorded) -> None:
    r4 = recorded.rest["request:r4"]
    assert isinstance(r4, dict) and r4["runs"] == ["runM"]
    assert _blocks(r4) == [
        (0, 4, "hit", None, None, None),
        (1, 4, "evicted", "evicted", "pressure", "r3"),
        (2, 4, "evicted", "evicted", "pressure", "r3"),
        (3, 2, "uncacheable", "partial_block", None, None),
    ]
    a = r4["admissions"][0]
    assert a["split"] == {"hit_tokens": 4, "evicted_tokens": 8, "novel_tokens": 0, "uncacheable_tokens": 2}
    assert (a["family"], a["prompt_tokens"], a["lookup_hit_tokens"], a["block_size"]) == ("fa", 14, 4, 4)
    b1 = a["blocks"][1]
    assert b1["block_hash"] == A[1] and b1["block_hash_hex"] == f"{A[1]:016x}"
    assert b1["first_cached_ns"] < b1["last_evicted_ns"] < a["lookup_ns"] <= b1["sealed_ns"] + 10_000
    assert b1["evicted_share_degree"] == 2 and b1["evicted_idle_ns"] == NS

    assert _blocks(recorded.rest["request:r7"]) == [
        (0, 4, "novel", None, None, None),
        (1, 4, "uncacheable", "admission_gate", None, None),
        (2, 4, "uncacheable", "admission_gate", None, None),
        (3, 1, "uncacheable", "partial_block", None, None),
    ]
    r11 = recorded.rest["request:r11"]
    assert [x["admission"] for x in r11["admissions"]] == [0, 1]
    assert _blocks(r11, 0) == [(0, 4, "novel", None, None, None), (1, 4, "uncacheable", "not_computed", None, None),
                               (2, 1, "uncacheable", "partial_block", None, None)]
    assert _blocks(r11, 1)[:2] == [(0, 4, "evicted", "evicted", "pressure", "r12"), (1, 4, "novel", None, None, None)]
    assert _blocks(recorded.rest["request:r14"])[:3] == [
        (0, 4, "evicted", "evicted", "pressure", "r14"),
        (1, 4, "evicted", "ancestor_evicted", None, None),
        (2, 4, "evicted", "ancestor_evicted", None, None),
    ]
    assert _blocks(recorded.rest["request:r5@runM"])[:2] == [(0, 4, "evicted", "evicted", "reset", None),
                                                             (1, 4, "uncacheable", "last_token", "reset", None)]


def test_story_agrees_with_the_run_wide_split_for_every_admission(q: QueryRunner) -> None:
    for (rid, n), exp in EXPECTED.items():
        story = q.request(rid, run="runM")
        a = story["admissions"][n]
        assert (a["split"]["hit_tokens"], a["split"]["evicted_tokens"], a["split"]["novel_tokens"],
                a["split"]["uncacheable_tokens"]) == exp[2:6], rid
        assert sum(b["tokens"] for b in a["blocks"]) == exp[1]


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = kvfabric_main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_answers_equal_rest(recorded: Recorded, capsys: pytest.CaptureFixture[str]) -> None:
    db = recorded.db_path
    rc, out, _ = _cli(capsys, "query", "misses", "--db", db, "--run", "runM", "--bucket-s", "10", "--format", "json")
    assert rc == 0 and json.loads(out) == recorded.rest["misses"]
    for rid in ("r4", "r7", "r11", "r14"):
        rc, out, _ = _cli(capsys, "query", "request", "--db", db, "--request-id", rid, "--format", "json")
        assert rc == 0 and json.loads(out) == recorded.rest[f"request:{rid}"], rid
    rc, out, _ = _cli(capsys, "query", "run_summary", "--db", db, "--run", "runM", "--format", "json")
    assert rc == 0 and json.loads(out) == recorded.rest["summary"]
    rc, out, _ = _cli(capsys, "query", "misses", "--db", db, "--run", "runM")  # the table form a person reads
    assert rc == 0 and "evicted_tokens" in out and "fa" in out
    rc, _, err = _cli(capsys, "query", "request", "--db", db, "--request-id", "nobody")
    assert rc == 2 and "has no admission" in err
    rc, _, err = _cli(capsys, "query", "misses", "--db", db, "--run", "runM", "--bucket-s", "-1")
    assert rc == 2 and "--bucket-s" in err
    rc, _, err = _cli(capsys, "query", "misses", "--db", db, "--run", "runM", "--bucket-s", "1e-12")
    assert rc == 2 and "bucket_s must be between" in err


def test_a_schema_1_file_is_upgraded_in_place(tmp_path: Path) -> None:
    path = str(tmp_path / "old.duckdb")
    con = duckdb.connect(path)
    old_columns = list(S.COLUMNS[:S.COLUMNS.index("reason")])  # (schema 1: the columns before reason)
    types = {f.name: {"int64": "BIGINT", "int32": "INTEGER", "string": "VARCHAR", "double": "DOUBLE",
                      "bool": "BOOLEAN"}[str(f.type)] for f in S.EVENT_SCHEMA}
    con.execute("CREATE TABLE kvfabric_meta (key VARCHAR, value VARCHAR)")
    con.execute("INSERT INTO kvfabric_meta VALUES ('schema_version', '1')")
    con.execute("CREATE TABLE events (" + ", ".join(f'"{c}" {types[c]}' for c in old_columns) + ")")
    con.execute("INSERT INTO events (seq, ts_ns, event, run_id, engine, block_hash) "
                "VALUES (0, 1, 'block_evicted', 'old', 'e', 7)")
    con.execute(streams_ddl())
    con.execute("INSERT INTO streams (stream_id, run_id, engine, block_size, num_blocks, policy) "
                "VALUES ('s', 'old', 'e', 16, 100, 'lru')")
    con.close()
    # Read-only, before the upgrade: a clear message, not a binder error.
    with pytest.raises(Exception, match="schema version 1"):
        QueryRunner.for_path(path).run_summary("old")
    upgraded = open_database(path)
    try:
        cols = [r[0] for r in upgraded.execute("DESCRIBE events").fetchall()]
        assert cols == list(S.COLUMNS)  # the new columns are last, in order, as in a new file
        assert upgraded.execute("SELECT value FROM kvfabric_meta").fetchall() == [(str(S.SCHEMA_VERSION),)]
        assert upgraded.execute("SELECT block_hash, reason FROM events").fetchall() == [(7, None)]
    finally:
        upgraded.close()
    newer = duckdb.connect(path)
    newer.execute("UPDATE kvfabric_meta SET value = '99'")
    newer.close()
    with pytest.raises(IncompatibleDatabase, match="schema version 99"):
        open_database(path)


def test_queries_include_their_shared_parts() -> None:
    """``-- @include PART`` lines are replaced by ``sql/parts/PART.sql`` (one CTE shared by two analytics); an unknown
    part is a clear error, and parts are not listed as queries."""
    for name in ("misses", "admission_chains"):
        text = catalog.sql(name)
        assert re.search(r"^-- @include", text, re.MULTILINE) is None
        assert "tagged AS (" in text and "OVER fwd AS next_lookup" in text
    assert "lookup_tagged" not in catalog.sql_names()
    with pytest.raises(ValueError, match="no_such_part"):
        catalog._INCLUDE.sub(catalog._part, "WITH\n-- @include no_such_part\nx AS (SELECT 1) SELECT * FROM x")
