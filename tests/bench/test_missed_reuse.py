"""Missed reuse (kvfabric/bench/missed_reuse.py): each request is compared with itself across the A/B's runs; only
prefill beyond its best run counts, failed requests are left out, and a folder with some per-request files missing is
refused rather than pooled."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from kvfabric.bench.missed_reuse import RunsMissingError, missed_reuse, missed_reuse_of_folder

ROOT = Path(__file__).resolve().parents[2]
LCR = ROOT / "benchmarks/results/gpu/serving/long_conversation_return-h200-1"


def _req(session: str, turn: int, prompt: int, cached: int, ttft: float, ok: bool = True) -> dict[str, Any]:
    return {"component": "c", "session": session, "turn": turn, "prompt_tokens": prompt, "cached_tokens": cached,
            "ttft_s": ttft, "ok": ok}


def test_only_prefill_beyond_the_requests_best_run_counts() -> None:
    runs = {
        "lru": [[_req("a", 0, 1000, 0, 0.5), _req("a", 1, 2000, 1000, 0.9), _req("b", 0, 500, 0, 0.1)]],
        "keep": [[_req("a", 0, 1000, 0, 0.5), _req("a", 1, 2000, 1984, 0.2), _req("b", 0, 500, 0, 0.1),
                  _req("b", 1, 800, 0, 9.0, ok=False)]],
    }
    lru, keep = missed_reuse(runs, block_size=16)
    # a/0 and b/0 are cold in every run: nothing missed. a/1 prefilled 1,000 under lru, 16 at best: 984 missed.
    assert (lru.requests, lru.missed, lru.missed_tokens_p50) == (3, 1, 984.0)
    assert lru.ttft_p50_missed_s == 0.9 and lru.ttft_p50_rest_s == pytest.approx(0.3)
    # keep's a/1 is the best run itself; the failed b/1 is neither counted nor a best.
    assert (keep.requests, keep.missed, keep.missed_tokens_p50) == (3, 0, None)
    assert keep.share == 0.0 and lru.share == pytest.approx(1 / 3)


def test_less_than_a_block_beyond_the_best_is_not_missed_reuse() -> None:
    runs = {"lru": [[_req("a", 0, 100, 90, 0.1)]], "x": [[_req("a", 0, 100, 100, 0.1)]]}
    assert [m.missed for m in missed_reuse(runs, block_size=16)] == [0, 0]
    assert [m.missed for m in missed_reuse(runs, block_size=8)] == [1, 0]
    with pytest.raises(ValueError, match="block_size"):
        missed_reuse(runs, block_size=0)


def test_a_folder_keeps_all_per_request_files_or_none(tmp_path: Path) -> None:
    folder = tmp_path / "ab"
    shutil.copytree(LCR, folder, ignore=shutil.ignore_patterns("*.png"))
    ab = json.loads((folder / "ab.json").read_text())
    stats = missed_reuse_of_folder(folder, ab)
    assert stats is not None and [m.policy for m in stats] == ab["policies"]
    assert sum(m.requests for m in stats) == sum(run["requests_ok"] for run in ab["runs"])
    (folder / "runs" / f"{ab['runs'][3]['run_id']}.bench.json").unlink()
    with pytest.raises(RunsMissingError, match=ab["runs"][3]["run_id"]):
        missed_reuse_of_folder(folder, ab)
    shutil.rmtree(folder / "runs")
    assert missed_reuse_of_folder(folder, ab) is None
