"""``kvfabric replay``: real scheduler vs fast mode, the optimum inside vLLM, streaming to a collector socket."""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from kvfabric.cli import main
from kvfabric.policies import POLICY_NAMES

pytestmark = pytest.mark.vllm

KEYS = {
    "policy", "num_blocks", "requests", "prompt_tokens", "prefix_hit_tokens", "prefix_hit_rate", "evicted_blocks",
    "rebuilt_from_eviction_blocks", "wasted_prefill_tokens", "events_emitted", "events_dropped",
}


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """40 rows: 4 families with shared two-block trunks, conversations that extend their previous turn."""
    rows = []
    last: dict[int, list[int]] = {}
    next_id = 1000
    for i in range(40):
        fam = (i * 7) % 4
        ids = last.get(fam, [fam, 100 + fam])
        if i % 3 == 0:
            ids = [fam, 100 + fam]  # a fresh conversation of the family
        ids = [*ids, next_id]
        next_id += 1
        last[fam] = ids
        rows.append({"timestamp": i * 500, "input_length": len(ids) * 512 - 37, "output_length": 20,
                     "hash_ids": ids})
    path = tmp_path_factory.mktemp("trace") / "tiny.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def replay(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert main(["replay", *args, "--format", "json", "--no-progress"]) == 0
    out = capsys.readouterr().out.strip().splitlines()[-1]
    return json.loads(out)


@pytest.mark.parametrize("policy", [*POLICY_NAMES, "optimal"])
def test_real_and_fast_modes_agree(capsys: pytest.CaptureFixture[str], trace: Path, policy: str) -> None:
    args = ["--trace", str(trace), "--policy", policy, "--num-blocks", "400"]
    real = replay(capsys, *args)
    fast = replay(capsys, *args, "--fast")
    assert KEYS <= set(real) and KEYS <= set(fast)
    assert real["mode"] == "real" and fast["mode"] == "offline"
    assert real["requests"] == fast["requests"] == 40
    assert real["prompt_tokens"] == fast["prompt_tokens"]
    assert real["evicted_blocks"] > 0  # the pool is small enough to evict
    # The two modes model the same cache: identical hits, and rebuilt blocks within a block or two.
    assert real["prefix_hit_tokens"] == fast["prefix_hit_tokens"], (real, fast)
    assert abs(real["rebuilt_from_eviction_blocks"] - fast["rebuilt_from_eviction_blocks"]) <= 2
    assert real["events_emitted"] > 0 and real["events_dropped"] == 0
    assert real["wasted_prefill_tokens"] == 16 * real["rebuilt_from_eviction_blocks"]
    if policy == "lru":
        assert "steering" not in real  # lru attaches nothing


def test_optimum_beats_lru_inside_vllm(capsys: pytest.CaptureFixture[str], trace: Path) -> None:
    base = ["--trace", str(trace), "--num-blocks", "300"]
    lru = replay(capsys, *base, "--policy", "lru")
    opt = replay(capsys, *base, "--policy", "optimal")
    assert opt["prefix_hit_tokens"] > lru["prefix_hit_tokens"]


def test_events_stream_to_a_collector_socket(capsys: pytest.CaptureFixture[str], trace: Path,
                                             tmp_path: Path) -> None:
    path = str(tmp_path / "c.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    received: list[int] = []
    meta: dict[bytes, bytes] = {}

    def serve() -> None:
        conn, _ = server.accept()
        with conn, conn.makefile("rb") as f:
            reader = pa.ipc.open_stream(f)
            meta.update(reader.schema.metadata or {})
            for batch in reader:
                received.append(batch.num_rows)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    out = replay(capsys, "--trace", str(trace), "--policy", "adaptive_aging", "--num-blocks", "400",
                 "--collector", path, "--limit", "12")
    thread.join(10)
    server.close()
    assert out["events_dropped"] == 0
    assert sum(received) == out["events_emitted"]
    assert meta[b"kvfabric.policy"] == b"adaptive_aging"


def test_fast_mode_refuses_real_only_flags(trace: Path) -> None:
    assert main(["replay", "--trace", str(trace), "--num-blocks", "100", "--fast", "--collector", "/x"]) == 2


def test_bad_inputs_get_a_clear_error(capsys: pytest.CaptureFixture[str], trace: Path, tmp_path: Path) -> None:
    assert main(["replay", "--trace", str(tmp_path / "missing.jsonl"), "--num-blocks", "100"]) == 2
    assert "no trace file" in capsys.readouterr().err
    # A pool smaller than one request: said plainly, with the fix, instead of a traceback.
    assert main(["replay", "--trace", str(trace), "--num-blocks", "3", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "the pool has 2" in err and "raise --num-blocks" in err
