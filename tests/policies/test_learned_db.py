"""``kvfabric learn --db``: a model learned from a run the collector recorded equals the model of the trace itself.

A trace goes through vLLM's real scheduler (``kvfabric replay``, hook on) streaming to a real collector process;
``kvfabric learn --db FILE --run R`` rebuilds the admissions from the stored events (block digests instead of the
trace's ids: the same prefix structure) and must find exactly the class counts ``kvfabric learn --trace`` finds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.collector_testkit import collector_files, wait_until

from kvfabric.cli import main
from kvfabric.learn.source import from_db, from_trace
from kvfabric.policies.reuse_model import ReuseModel

pytestmark = pytest.mark.vllm


def test_learning_from_the_collector_matches_learning_from_the_trace(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = []
    last: dict[int, list[int]] = {}
    nid = 1000
    for i in range(60):
        fam = (i * 7) % 5
        ids = last.get(fam, [fam, 100 + fam]) if i % 4 else [fam, 100 + fam]
        ids = [*ids, nid]
        nid += 1
        last[fam] = ids
        rows.append({"timestamp": i * 500, "input_length": len(ids) * 512 - 37, "output_length": 4,
                     "hash_ids": ids})
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with collector_files() as files:
        proc = files.process()
        proc.start()
        try:
            assert main(["replay", "--trace", str(trace), "--policy", "lru", "--num-blocks", "2000",
                         "--collector", files.socket_path, "--run-id", "learn-me", "--format", "json",
                         "--no-progress"]) == 0
            out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])

            def stored() -> Any:
                runs = {r["run_id"]: r for r in httpx.get(f"{files.http_url}/api/v1/runs").json()}
                run = runs.get("learn-me")
                return run if run and run["events"] >= out["events_emitted"] else None

            wait_until(stored, timeout=30, what="the replay's events stored")
        finally:
            proc.stop()
        from_events = from_db(files.db_path, "learn-me")
        from_file = from_trace(str(trace), 16)
        assert from_events.block_size == 16 and len(from_events) == len(rows)
        assert [len(c) for c in from_events.chains] == [len(c) for c in from_file.chains]
        assert from_events.input_lengths == from_file.input_lengths
        m_db, m_trace = tmp_path / "db.json", tmp_path / "trace.json"
        assert main(["learn", "--db", files.db_path, "--run", "learn-me", "--out", str(m_db), "--no-progress"]) == 0
        assert main(["learn", "--trace", str(trace), "--out", str(m_trace), "--no-progress"]) == 0
        a, b = ReuseModel.load(m_db), ReuseModel.load(m_trace)
        assert a.training["kind"] == "db" and a.training["run"] == "learn-me"
        assert {i: (c.n, c.reused, c.hist) for i, c in a.classes.items()} == \
            {i: (c.n, c.reused, c.hist) for i, c in b.classes.items()}
        assert main(["learn", "--db", files.db_path, "--run", "nope", "--out", str(m_db), "--no-progress"]) == 2
        assert "not in" in capsys.readouterr().err
