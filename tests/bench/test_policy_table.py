"""``python -m kvfabric.bench.policy_table``: ``docs/policy-results.md`` and its plots are rendered from the committed
``benchmarks/results/policy_sweep.json``, every table has rows, the committed page is what the results file
renders, and a results file that lacks rows makes the renderer fail instead of publishing empty tables (issue 31:
rows naming their trace by absolute path, the metadata by relative path, once rendered every table empty).
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from kvfabric.bench import policy_table
from kvfabric.bench.table_rows import MissingRows, pick, repo_relative, resolve, trace_key

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results" / "policy_sweep.json"
PAGE = REPO / "docs" / "policy-results.md"
BUNDLED_TRACE = REPO / "kvfabric" / "bench" / "traces" / "mooncake_synthetic_first400.jsonl"
PLOTS = ("policy-hit-rate-conversation_first_half.png", "policy-hit-rate-synthetic_trace.png",
         "policy-gap-closed.png", "policy-learned-gap.png")


def _committed() -> dict[str, Any]:
    return json.loads(RESULTS.read_text())


def _tables(text: str) -> list[tuple[str, list[list[str]]]]:
    """Every Markdown table in ``text``: (the heading above it, its data rows as cells)."""
    tables: list[tuple[str, list[list[str]]]] = []
    heading = ""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#"):
            heading = line
        if line.startswith("|") and i + 1 < len(lines) and re.fullmatch(r"\|(---\|)+", lines[i + 1]):
            rows = []
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append([c.strip() for c in lines[i].strip("|").split("|")])
                i += 1
            tables.append((heading, rows))
            continue
        i += 1
    return tables


def _render(data: dict[str, Any], tmp_path: Path) -> str:
    plots = tmp_path / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    return policy_table.render(data, tmp_path / "policy-results.md", plots)


def test_committed_results_render_every_table_with_rows(tmp_path: Path) -> None:
    text = _render(_committed(), tmp_path)
    tables = _tables(text)
    # Per trace: hit rate, gap closed, wasted prefill, admission gate; the learned policy's three; real scheduler
    # (whole traces), agreement, robustness.
    assert len(tables) == 2 * 4 + 3 + 3
    fractions = len(_committed()["meta"]["fractions"])
    for heading, rows in tables:
        assert rows, f"table under {heading!r} has no rows"
        for row in rows:
            assert any(c not in ("-", "") for c in row[1:]), f"row {row} under {heading!r} has no numbers"
    by_heading: dict[str, list[int]] = {}
    for heading, rows in tables:
        by_heading.setdefault(heading, []).append(len(rows))
    assert by_heading["#### Prefix hit rate (%)"] == [fractions, fractions, fractions, fractions]
    assert by_heading["### Robustness: the first 1,500 rows of each trace"] == [2 * fractions]
    # No cell of the sweep's tables is missing ("-" stood for a row the renderer did not find).
    sweep_tables = [rows for heading, rows in tables if heading.startswith("#### Wasted")]
    assert all("-" not in row for rows in sweep_tables for row in rows)
    for name in PLOTS:
        assert (tmp_path / "plots" / name).stat().st_size > 10_000, name


def test_committed_page_is_what_the_results_render(tmp_path: Path) -> None:
    """docs/policy-results.md's generated part is the committed results file's rendering (re-render with
    ``python -m kvfabric.bench.policy_table --reuse``); the hand-written parts around it are kept."""
    page = tmp_path / "policy-results.md"
    shutil.copy(PAGE, page)
    (tmp_path / "plots").mkdir()
    policy_table.render(_committed(), page, tmp_path / "plots")
    assert page.read_text() == PAGE.read_text()


def test_rows_match_by_trace_file_whatever_path_wrote_them(tmp_path: Path) -> None:
    data = _committed()
    # The committed file records one spelling, relative to the repository root, in rows and metadata alike.
    spellings = {r["trace"] for section in ("sweep", "robust", "agree_fast", "agree_real", "full_real",
                                            "learned_eval") for r in data[section]} | set(data["meta"]["traces"])
    assert spellings == set(data["meta"]["traces"]) and not any(os.path.isabs(s) for s in spellings)
    expected = _render(data, tmp_path / "a")
    # Rows written from another checkout (absolute paths: the bug's trigger) still match by file name ...
    moved = copy.deepcopy(data)
    for section in ("sweep", "robust", "agree_fast", "agree_real", "full_real", "learned_eval"):
        for r in moved[section]:
            r["trace"] = "/another/clone/../shared/traces/" + os.path.basename(r["trace"])
    assert _render(moved, tmp_path / "b") == expected
    # ... and a results file the sweep writes spells them as the metadata does again.
    assert policy_table.relative_traces(moved) == data
    name = "mooncake_synthetic_trace.jsonl"
    assert trace_key(f"/x/y/{name}") == trace_key(f"../shared/traces/{name}") == "synthetic_trace"
    assert pick([{"trace": "/x/mooncake_a.jsonl", "v": 1}], trace="../a/mooncake_a.jsonl") == {
        "trace": "/x/mooncake_a.jsonl", "v": 1}
    assert pick([{"trace": "/x/mooncake_a.jsonl"}], trace="mooncake_b.jsonl") is None


@pytest.mark.parametrize("section", ["sweep", "robust", "agree_fast", "agree_real", "learned_eval"])
def test_removing_the_rows_makes_the_renderer_fail(tmp_path: Path, section: str) -> None:
    data = _committed()
    data[section] = []
    with pytest.raises(MissingRows):
        _render(data, tmp_path)
    assert not (tmp_path / "policy-results.md").exists()
    assert not list((tmp_path / "plots").iterdir())  # nothing written: no plot without data either


@pytest.mark.parametrize("section", ["sweep", "robust", "agree_fast", "learned_eval"])
def test_removing_one_row_makes_the_renderer_fail(tmp_path: Path, section: str) -> None:
    data = _committed()
    rows = data[section]
    victim = next(r for r in rows if section != "learned_eval" or r["policy"] == "lru")
    rows.remove(victim)
    with pytest.raises(MissingRows, match=re.escape(f"fraction={victim['fraction']!r}")):
        _render(data, tmp_path)


def test_rows_under_paths_of_another_trace_make_the_renderer_fail(tmp_path: Path) -> None:
    """Rows that name no trace of the metadata are the issue's case seen from the other side: no silent skip."""
    data = _committed()
    for r in data["sweep"]:
        r["trace"] = "/elsewhere/other_trace.jsonl"
    with pytest.raises(MissingRows, match="other_trace"):
        _render(data, tmp_path)


def test_main_reuse_exits_non_zero_and_writes_nothing_without_rows(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    data = _committed()
    data["sweep"] = []
    results = tmp_path / "policy_sweep.json"
    results.write_text(json.dumps(data))
    out = tmp_path / "page.md"
    rc = policy_table.main(["--reuse", "--data", str(results), "--out", str(out), "--plots", str(tmp_path / "p")])
    assert rc == 1
    assert "section 'sweep' has no rows" in capsys.readouterr().err
    assert not out.exists()


def test_sweep_records_trace_paths_relative_to_the_repository(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trace = tmp_path / "mooncake_tiny.jsonl"
    trace.write_text("".join(BUNDLED_TRACE.read_text().splitlines(keepends=True)[:60]))
    monkeypatch.chdir(tmp_path)  # not the repository root: the recorded path must not depend on it
    data = policy_table.run_all([str(trace)], [0.5], 16, 1, 20, [], ["sweep"])
    recorded = {r["trace"] for r in data["sweep"]} | set(data["meta"]["traces"])
    assert recorded == {repo_relative(str(trace))}
    (path,) = recorded
    assert not os.path.isabs(path)
    assert Path(resolve(path)).resolve() == trace.resolve()
    assert resolve("kvfabric/bench/traces") == str(REPO / "kvfabric" / "bench" / "traces")


def test_metadata_naming_a_trace_by_absolute_path_is_refused(tmp_path: Path) -> None:
    data = _committed()
    data["meta"]["traces"] = {"/abs/" + os.path.basename(k): v for k, v in data["meta"]["traces"].items()}
    with pytest.raises(MissingRows, match="absolute path"):
        _render(data, tmp_path)
