"""Issue 26: every user error of the CLI is one line that names the thing at fault, with exit status 2 and no
traceback; nothing the user passes is silently ignored; ``--version``; every ``--help`` shows the defaults.

Each case here failed before the fix (a traceback, exit status 1, a message naming no path or address, a flag
ignored, a value accepted that cannot work). In-process through ``kvfabric.cli.main`` where that is enough (fast);
in a subprocess where the proof is the process's own exit status and stderr.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path

import duckdb
import pyarrow.parquet as pq
import pytest
from support.collector_testkit import HASH_STORY, golden_streams

import kvfabric
from kvfabric.argtypes import shows_default
from kvfabric.cli import SUBCOMMANDS, build_parser
from kvfabric.cli import main as kvfabric_main
from kvfabric.collector.config import CollectorConfig
from kvfabric.collector.main import startup_os_error
from kvfabric.ingest.store import open_database


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = kvfabric_main(list(argv))
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture()
def empty_db(tmp_path: Path) -> str:
    path = str(tmp_path / "empty.duckdb")
    open_database(path).close()
    return path


@pytest.fixture()
def not_duckdb(tmp_path: Path) -> str:
    path = tmp_path / "notes.duckdb"
    path.write_text("not a database\n")
    return str(path)


# ----------------------------------------------------------------------------------------- values out of range


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["collector", "--memory-limit", "lots"], "--memory-limit"),
        (["collector", "--max-connections", "0"], "--max-connections"),
        (["collector", "--coalesce-ms", "-5"], "--coalesce-ms"),
        (["collector", "--port", "99999"], "--port"),
        (["collector", "--socket-mode", "777"], "--socket-mode"),
        (["collector", "--idle-timeout", "0"], "--idle-timeout"),
        (["collector", "--checkpoint-threshold", "soon"], "--checkpoint-threshold"),
        (["replay", "--trace", "t.jsonl", "--num-blocks", "0"], "--num-blocks"),
        (["replay", "--trace", "t.jsonl", "--num-blocks", "9", "--concurrency", "0"], "--concurrency"),
        (["replay", "--trace", "t.jsonl", "--num-blocks", "9", "--latency", "fast"], "--latency"),
        (["whatif", "--run", "r", "--num-blocks", "1"], "--num-blocks"),
        (["learn", "--trace", "t.jsonl", "--out", "m.json", "--skip", "-1"], "--skip"),
        (["bench", "--mode", "pressure", "--concurrency", "0"], "--concurrency"),
        (["bench", "--mode", "pressure", "--duration", "nan"], "--duration"),
        (["ab", "--scenario", "smoke", "--repeat", "0"], "--repeat"),
        (["ab", "--scenario", "smoke", "--port", "70000"], "--port"),
        (["query", "runs", "--limit", "0"], "--limit"),
        (["query", "misses", "--run", "r", "--bucket-s", "-1"], "--bucket-s"),
        (["query", "block_history", "--block-hash", "zz"], "--block-hash"),
        (["export", "--out", "x", "--block-tokens", "0"], "--block-tokens"),
    ],
)
def test_impossible_values_are_refused_on_one_line(argv: list[str], named: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _cli(capsys, *argv)
    line = _one_line(err)
    assert rc == 2 and out == ""
    assert line.startswith(f"kvfabric {argv[0]}: argument {named}") and "usage:" not in err, line


def test_a_bad_option_exits_2_with_one_line_in_a_real_process() -> None:
    """The process itself: status 2, one line on stderr, no traceback (was: 13-47 lines and status 1)."""
    for argv in (["collector", "--memory-limit", "lots"], ["bench", "--mode", "pressure", "--param", "hot_share=x"]):
        proc = subprocess.run([sys.executable, "-m", "kvfabric.cli", *argv], capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 2 and proc.stdout == "", proc.stderr
        assert _one_line(proc.stderr).startswith(f"kvfabric {argv[0]}: ")


# ----------------------------------------------------------------------------------------- the collector


def test_collector_names_the_address_in_use(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        rc, _, err = _cli(capsys, "collector", "--db", str(tmp_path / "c.duckdb"), "--socket",
                          str(tmp_path / "c.sock"), "--port", str(port), "--log-level", "ERROR")
    line = _one_line(err)
    assert rc == 2 and f"127.0.0.1:{port} is already in use" in line and "--port" in line, line
    assert "Errno" not in line


def test_collector_names_the_socket_in_use_and_the_database(tmp_path: Path, not_duckdb: str,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    sock_path = str(tmp_path / "busy.sock")
    with socket.socket(socket.AF_UNIX) as busy:
        busy.bind(sock_path)
        busy.listen()
        rc, _, err = _cli(capsys, "collector", "--db", str(tmp_path / "c.duckdb"), "--socket", sock_path,
                          "--port", "0", "--log-level", "ERROR")
    line = _one_line(err)
    assert rc == 2 and "--socket" in line and sock_path in line and "in use" in line, line
    rc, _, err = _cli(capsys, "collector", "--db", not_duckdb, "--socket", str(tmp_path / "d.sock"), "--port", "0",
                      "--log-level", "ERROR")
    line = _one_line(err)
    assert rc == 2 and f"--db {not_duckdb}" in line, line


def test_collector_start_errors_without_a_path_get_one() -> None:
    """``[Errno 1] Operation not permitted`` and ``[Errno 98] Address already in use`` named nothing: the socket
    bind is the one start-up operation whose error carries no path, so the message supplies it."""
    config = CollectorConfig(db_path="/x/kv.duckdb", socket_path="/run/kv/kv.sock", host="127.0.0.1", port=8321)
    assert startup_os_error(OSError(errno.EPERM, "Operation not permitted"), config) == (
        "--socket /run/kv/kv.sock: cannot create the socket (Operation not permitted)")
    assert "--socket /run/kv/kv.sock is already in use" in startup_os_error(
        OSError(errno.EADDRINUSE, "Address already in use"), config)
    assert startup_os_error(PermissionError(errno.EACCES, "Permission denied", "/x/kv.duckdb.wal"), config) == (
        "/x/kv.duckdb.wal: Permission denied")


# ----------------------------------------------------------------------------------------- export


def test_export_run_exports_only_that_run(golden_db: str, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """``--run`` was ignored by the Parquet export (every run was written); ``--engine`` too."""
    rows = Counter((r["run_id"], r["engine"]) for g in golden_streams() for r in g.rows)
    out = tmp_path / "pq"
    rc, stdout, _ = _cli(capsys, "export", "--db", golden_db, "--out", str(out), "--run", "runB")
    assert rc == 0 and "of 1 run(s)" in stdout
    assert sorted(p.name for p in (out / "events").iterdir()) == ["run_id=runB"]
    events = pq.read_table(out / "events").to_pylist()
    assert len(events) == rows[("runB", "e0")]
    assert {s["run_id"] for s in pq.read_table(out / "streams" / "streams.parquet").to_pylist()} == {"runB"}

    rc, _, _ = _cli(capsys, "export", "--db", golden_db, "--out", str(out), "--run", "runA", "--engine", "e1")
    assert rc == 0 and len(pq.read_table(out / "events").to_pylist()) == rows[("runA", "e1")]
    rc, _, _ = _cli(capsys, "export", "--db", golden_db, "--out", str(out))  # every run, as before
    assert rc == 0 and len(pq.read_table(out / "events").to_pylist()) == sum(rows.values())

    rc, _, err = _cli(capsys, "export", "--db", golden_db, "--out", str(out), "--run", "nope")
    assert rc == 2 and _one_line(err) == "kvfabric export: --run: unknown run 'nope'"


def test_export_refuses_options_of_the_other_format(golden_db: str, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = _cli(capsys, "export", "--db", golden_db, "--out", str(tmp_path / "pq"), "--block-tokens", "16")
    assert rc == 2 and "--block-tokens goes with --format mooncake" in _one_line(err)
    rc, _, err = _cli(capsys, "export", "--db", golden_db, "--out", str(tmp_path / "t.jsonl"), "--run", "runA",
                      "--format", "mooncake", "--by-date")
    assert rc == 2 and "--by-date goes with --format parquet" in _one_line(err)


def test_export_to_a_place_that_cannot_be_written_names_it(empty_db: str, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    rc, _, err = _cli(capsys, "export", "--db", empty_db, "--out", str(blocker / "out"))
    assert rc == 2 and _one_line(err).startswith(f"kvfabric export: --out {blocker / 'out'}: cannot write there")
    # Permission denied (the tests may run as root, where chmod does not stop writes: the error is simulated).
    locked = str(tmp_path / "locked" / "out")

    def refuse(path: str, *args: object, **kwargs: object) -> None:
        raise PermissionError(errno.EACCES, "Permission denied", path)

    monkeypatch.setattr(os, "makedirs", refuse)
    rc, _, err = _cli(capsys, "export", "--db", empty_db, "--out", locked)
    line = _one_line(err)
    assert rc == 2 and f"--out {locked}" in line and "Permission denied" in line, line


# ----------------------------------------------------------------------------------------- query


def test_query_on_a_file_that_is_not_a_collector_database(not_duckdb: str, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    plain = str(tmp_path / "plain.duckdb")
    duckdb.connect(plain).close()
    for db, says in ((not_duckdb, "cannot be read as a DuckDB database"),
                     (plain, "is not a kvfabric collector database"),
                     (str(tmp_path), "is a directory"),
                     (str(tmp_path / "missing.duckdb"), "no database at")):
        rc, _, err = _cli(capsys, "query", "runs", "--db", db)
        line = _one_line(err)
        assert rc == 2 and db in line and says in line, line
    for argv in (["whatif", "--run", "r"], ["learn", "--run", "r", "--out", str(tmp_path / "m.json")]):
        rc, _, err = _cli(capsys, *argv, "--db", not_duckdb)
        assert rc == 2 and not_duckdb in _one_line(err)


def test_query_flags_missing_or_not_taken_are_usage_errors(golden_db: str,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = _cli(capsys, "query", "family_detail", "--db", golden_db, "--run", "runA")
    assert rc == 2 and _one_line(err) == (
        "kvfabric query: family_detail needs --family; it takes: --run RUN --family FAMILY")
    rc, _, err = _cli(capsys, "query", "compare", "--db", golden_db)
    assert rc == 2 and "compare needs --a and --b" in _one_line(err)
    rc, _, err = _cli(capsys, "query", "runs", "--db", golden_db, "--family", "famX")
    assert rc == 2 and "runs does not take --family" in _one_line(err)
    # --limit is top_waste_families' n (it used to fail with "unexpected keyword argument 'limit'")
    rc, out, _ = _cli(capsys, "query", "top_waste_families", "--db", golden_db, "--run", "runA", "--limit", "1",
                      "--format", "json")
    assert rc == 0 and len(json.loads(out)) == 1


def test_query_takes_the_block_hash_forms_rest_takes_and_prints(golden_db: str,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    answers = []
    for form in (f"{HASH_STORY:016x}", f"0x{HASH_STORY:x}", str(HASH_STORY)):
        rc, out, err = _cli(capsys, "query", "block_history", "--db", golden_db, "--block-hash", form,
                            "--format", "json")
        assert rc == 0, err
        answers.append(json.loads(out))
    assert answers[0] == answers[1] == answers[2] and answers[0]["block_hash_hex"] == f"{HASH_STORY:016x}"
    rc, out, _ = _cli(capsys, "query", "block_history", "--db", golden_db, "--block-hash", f"{HASH_STORY:016x}")
    assert rc == 0 and f"{HASH_STORY:016x}" in out and "\nevents\n" in out  # events as a table under a title


def test_query_pages_with_cursor(golden_db: str, capsys: pytest.CaptureFixture[str]) -> None:
    seen: list[dict[str, object]] = []
    cursor: str | None = None
    while True:
        extra = ["--cursor", cursor] if cursor else []
        rc, out, err = _cli(capsys, "query", "evictions", "--db", golden_db, "--limit", "5", "--format", "json",
                            *extra)
        assert rc == 0, err
        page = json.loads(out)
        seen += page["items"]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert len(seen) == 12 and len({(e["engine"], e["run_id"], e["block_hash"]) for e in seen}) == 12
    rc, out, _ = _cli(capsys, "query", "evictions", "--db", golden_db, "--limit", "5")
    assert rc == 0 and re.search(r"repeat with --cursor \S+ for the next page", out)
    rc, _, err = _cli(capsys, "query", "evictions", "--db", golden_db, "--cursor", "garbage")
    assert rc == 2 and "is not a cursor returned by this API" in _one_line(err)


def test_query_says_when_it_cut_the_answer(golden_db: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = _cli(capsys, "query", "families", "--db", golden_db, "--limit", "1")
    assert rc == 0 and _one_line(err) == "kvfabric query: showing the first 1 rows; --limit N shows up to 10,000"
    rc, _, err = _cli(capsys, "query", "families", "--db", golden_db)  # 3 families, under the default 100
    assert rc == 0 and err == ""


def test_query_rounds_numbers_for_people_and_json_keeps_them(golden_db: str,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _cli(capsys, "query", "run_summary", "--db", golden_db, "--run", "runA")
    rate = next(line for line in out.splitlines() if line.startswith("prefix_hit_rate "))
    assert rc == 0 and rate.split()[-1] == "0.4636", rate  # 510 / 1100, was printed as 0.4636363636363636
    assert not re.search(r"\d\.\d{6,}", out), out
    rc, out, _ = _cli(capsys, "query", "run_summary", "--db", golden_db, "--run", "runA", "--format", "json")
    assert rc == 0 and json.loads(out)["prefix_hit_rate"] == 510 / 1100


# ----------------------------------------------------------------------------------------- bench, replay, learn


def _trace(path: Path, *rows: dict[str, object]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_bench_param_of_the_wrong_type_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = _cli(capsys, "bench", "--mode", "pressure", "--param", "hot_share=notjson")
    line = _one_line(err)
    assert rc == 2 and "hot_share must be a number, not 'notjson'" in line, line


def test_trace_rows_without_a_field_name_file_and_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = {"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}
    trace = _trace(tmp_path / "t.jsonl", good, {"input_length": 10, "output_length": 1, "hash_ids": [1]})
    for argv in (["replay", "--trace", trace, "--num-blocks", "100", "--fast", "--no-progress"],
                 ["replay", "--trace", trace, "--num-blocks", "100", "--no-progress"],
                 ["learn", "--trace", trace, "--out", str(tmp_path / "m.json"), "--no-progress"],
                 ["bench", "--mode", "dataset", "--param", f"path={trace}", "--endpoint", "http://127.0.0.1:9"]):
        rc, _, err = _cli(capsys, *argv)
        line = _one_line(err)
        assert rc == 2 and f"{trace}:2: the row has no timestamp" in line, (argv, line)


def test_dataset_mode_announces_the_prompts_it_cuts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``max_input_tokens`` (default 4096) cut long prompts silently; now the cut is announced, the cap is a
    documented parameter (``kvfabric bench --help`` lists it with its default), and null lifts it."""
    from kvfabric.bench.modes import make_sessions

    trace = _trace(tmp_path / "t.jsonl",
                   {"timestamp": 0, "input_length": 8, "output_length": 1, "hash_ids": [1, 2]},
                   {"timestamp": 5, "input_length": 20, "output_length": 1, "hash_ids": [1, 2, 3, 4, 5]})
    params = {"path": trace, "block_tokens": 4, "max_input_tokens": 12}
    sessions = list(make_sessions("dataset", params, 0))
    assert [s.prompt.num_drawn for s in sessions] == [8, 12]
    err = capsys.readouterr().err
    assert "1 of 2 rows" in err and "max_input_tokens=12" in err and "null removes it" in err, err
    sessions = list(make_sessions("dataset", {**params, "max_input_tokens": None}, 0))
    assert [s.prompt.num_drawn for s in sessions] == [8, 20] and capsys.readouterr().err == ""
    rc, out, _ = _cli(capsys, "bench", "--help")
    assert rc == 0 and "max_input_tokens=4096" in out


def test_progress_bars_go_to_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = _trace(tmp_path / "t.jsonl", *({"timestamp": i, "input_length": 600, "output_length": 1,
                                              "hash_ids": [i % 2, 9]} for i in range(4)))
    rc, out, err = _cli(capsys, "replay", "--trace", trace, "--num-blocks", "200", "--fast", "--format", "json")
    assert rc == 0 and json.loads(out)["requests"] == 4 and "\r" not in out
    assert "fast lru@200" in err  # the bar


# ----------------------------------------------------------------------------------------- REST


def test_rest_refuses_unknown_query_parameters(empty_db: str) -> None:
    from fastapi.testclient import TestClient

    from kvfabric.api.app import create_app
    from kvfabric.queries import QueryRunner

    client = TestClient(create_app(QueryRunner.for_path(empty_db), token=""))
    r = client.get("/api/v1/evictions", params={"familly": "x"})
    assert r.status_code == 422
    assert r.json()["detail"] == ("unknown query parameter(s) familly; /api/v1/evictions accepts: cursor, engine, "
                                  "family, host, limit, lora, run, since_ns, tenant, until_ns")
    assert client.get("/api/v1/evictions", params={"family": "x", "limit": 5}).status_code == 200
    r = client.get("/api/v1/runs", params={"run": "x"})
    assert r.status_code == 422 and "accepts: none" in r.json()["detail"]


# ----------------------------------------------------------------------------------------- --version, --help


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _cli(capsys, "--version")
    assert rc == 0 and out.strip() == f"kvfabric {kvfabric.__version__}"


def _default_texts(default: object) -> set[str]:
    texts = {str(default)}
    if isinstance(default, float):
        texts.add(f"{default:g}")
    return texts


@pytest.mark.parametrize("name", list(SUBCOMMANDS))
def test_every_help_shows_every_default(name: str) -> None:
    parser = build_parser(only=name)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
    missing = []
    for action in sub._actions:
        if not shows_default(action):
            continue
        shown = " ".join(sub._get_formatter()._format_action(action).split())
        if not any(t in shown for t in _default_texts(action.default)):
            missing.append(f"{'/'.join(action.option_strings)} (default {action.default!r}): {shown}")
    assert not missing, "\n".join(missing)
    assert "(default: None)" not in sub.format_help()
