"""``kvfabric export --format mooncake`` on a hand-made recorded run whose trace is known by hand.

Run ``runX`` (engine e0, block size 4), admissions in this order (H*, J*, K* are block digests):

  q1  t=0       P  9  seals H0 H1 (3 blocks taken)                  output 1
  q2  t=1.5 s   P 16  hits H0 H1, seals H2 H3 (3 blocks taken)      output 2
  q3  t=2.25 s  P 16  hits H0 H1, seals J2 J3 (3 blocks taken)      output 2
  q4  t=3 s     P 13  seals K0; the gate refuses K1 K2 (4 taken)    output 1
  q5  t=4 s     P 16  hits H0 H1 H2, recomputes H3 (2 taken)        output 2

With 8 tokens per id (2 recorded blocks): q1 [0 1], q2 [0 2], q3 [0 3], q4 [4 5], q5 [0 2]: a group shares its id
only when both its blocks are known and full (q1's second group is partial, q4's hold unknown blocks). With 4
tokens per id (the run's block size), every recorded block keeps its own id.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.collector_testkit import EventScript, collector_files, send_scripts, wait_rows

from kvfabric.cli import main as kvfabric_main
from kvfabric.sim.offline import load_trace

H = [100, 101, 102, 103]
J = [202, 203]
K = [300, 301, 302]


def script() -> EventScript:
    s = EventScript("runX", "e0")
    s.admit("q1", "h", 9, H[:2], allocate=3)
    s.at(1.5).step().admit("q2", "h", 16, H, hit_blocks=2, allocate=3)
    s.at(2.25).step().admit("q3", "h", 16, [*H[:2], *J], hit_blocks=2, allocate=3)
    s.at(3).step().admit("q4", "k", 13, K, seal=[0], allocate=4, limited=2)
    s.at(4).step().admit("q5", "h", 16, H, hit_blocks=3, allocate=2)
    return s


@pytest.fixture(scope="module")
def db() -> Iterator[str]:
    with collector_files() as files:
        with files.process():
            g = script().stream("x")
            send_scripts(files.socket_path, [g])
            wait_rows(files.http_url, "runX", len(g.rows))
        yield files.db_path


def _export(db: str, out: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str]:
    rc = kvfabric_main(["export", "--db", db, "--run", "runX", "--format", "mooncake", "--out", str(out), *extra])
    cap = capsys.readouterr()
    return rc, cap.out + cap.err


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_trace_rows_known_by_hand(db: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "x8.jsonl"
    rc, text = _export(db, out, capsys, "--block-tokens", "8")
    assert rc == 0 and "exported 5 admissions of run runX" in text
    rows = _rows(out)
    assert [r["timestamp"] for r in rows] == [0, 1500, 2250, 3000, 4000]
    assert [r["input_length"] for r in rows] == [9, 16, 16, 13, 16]
    assert [r["output_length"] for r in rows] == [1, 2, 2, 1, 2]
    assert [r["hash_ids"] for r in rows] == [[0, 1], [0, 2], [0, 3], [4, 5], [0, 2]]
    assert {r["block_tokens"] for r in rows} == {8}

    fine = tmp_path / "x4.jsonl"
    assert _export(db, fine, capsys, "--block-tokens", "4")[0] == 0
    assert [r["hash_ids"] for r in _rows(fine)] == [[0, 1, 2], [0, 1, 3, 4], [0, 1, 5, 6], [7, 8, 9, 10],
                                                    [0, 1, 3, 4]]


def test_mooncake_default_is_the_shared_format_and_replays(db: str, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "x.jsonl"
    rc, text = _export(db, out, capsys)
    assert rc == 0 and f"kvfabric replay --trace {out}" in text
    rows = _rows(out)
    # The format of shared/traces/README.md, nothing else: no digests, no token ids, no request ids.
    assert all(set(r) == {"timestamp", "input_length", "output_length", "hash_ids"} for r in rows)
    assert all(len(r["hash_ids"]) == -(-r["input_length"] // 512) for r in rows)
    ids = [h for r in rows for h in r["hash_ids"]]
    assert ids == list(range(len(ids)))  # prompts under 512 tokens: no 512-token block is proven shared
    assert len(load_trace(out)) == 5
    rc = kvfabric_main(["replay", "--trace", str(out), "--fast", "--policy", "lru", "--num-blocks", "16",
                        "--format", "json", "--no-progress"])
    replayed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and replayed["requests"] == 5 and replayed["prompt_tokens"] == 70


def test_bad_exports_fail_with_one_line(db: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bad.jsonl"
    for extra, message in (
        (["--block-tokens", "6"], "must be a multiple of the run's block size (4)"),
        (["--engine", "nowhere"], "has no admission on engine 'nowhere'"),
    ):
        rc, text = _export(db, out, capsys, *extra)
        assert rc == 2 and message in text and len(text.strip().splitlines()) == 1, text
    assert not out.exists()  # nothing half-written
    rc = kvfabric_main(["export", "--db", db, "--format", "mooncake", "--out", str(out)])
    assert rc == 2 and "needs --run" in capsys.readouterr().err
    rc = kvfabric_main(["export", "--db", db, "--run", "nope", "--format", "mooncake", "--out", str(out)])
    assert rc == 2 and "unknown run 'nope'" in capsys.readouterr().err
