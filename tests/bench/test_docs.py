"""``python -m kvfabric.bench.docs``: every generated page, block and plot of the docs is what the committed results
render, and the renderer refuses what it cannot show (issue 31: "generated, or not published").

The copies of the repository the failure cases break are made in ``tmp_path``: the committed files are never
touched.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from kvfabric.bench import docs, policy_table
from kvfabric.bench.table_rows import MissingRows

ROOT = Path(__file__).resolve().parents[2]
ALL_BLOCKS = "\n".join(f"<!-- BEGIN GENERATED {n} -->\n<!-- END GENERATED {n} -->" for n in docs.BLOCKS)


def _copy(tmp: Path) -> Path:
    """The pages, the results and the plots a render reads, copied to ``tmp`` (a repository of its own), with every
    page's generated parts filled from the copied results (so the copy passes the check whatever state the
    committed pages are in; the committed state has a test of its own)."""
    for page in docs.pages(ROOT):
        (tmp / page).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / page, tmp / page)
    for png in (ROOT / "docs").glob("*.png"):
        shutil.copy(png, tmp / "docs" / png.name)
    shutil.copytree(ROOT / docs.RESULTS, tmp / docs.RESULTS,
                    ignore=shutil.ignore_patterns("*.png", "runs", "logs"))
    rendered, _ = docs.render_all(tmp)
    for page, text in rendered.items():
        (tmp / page).write_text(text)
    return tmp


def _with_every_block(root: Path, page: str = "docs/metrics.md") -> str:
    """Put every known block into a copied page (README.md may not hold markers yet), filled as committed."""
    p = root / page
    p.write_text(p.read_text() + "\n" + ALL_BLOCKS + "\n")
    p.write_text(docs.fill_blocks(p.read_text(), docs.Context(root, page)))
    return page


def _edit(root: Path, rel: str, change: Any) -> None:
    f = root / rel
    data = json.loads(f.read_text())
    change(data)
    f.write_text(json.dumps(data))


def test_the_committed_docs_are_what_the_committed_results_render() -> None:
    problems = docs.check(ROOT)
    assert problems == [], "run python -m kvfabric.bench.docs and commit the pages: " + "; ".join(problems)
    assert docs.main(["--check"]) == 0


def test_every_block_renders_a_table_with_rows_and_links_its_results() -> None:
    for name, render in docs.BLOCKS.items():
        for page, prefix in (("README.md", "benchmarks/results/"), ("docs/fleet.md", "../benchmarks/results/")):
            text = render(docs.Context(ROOT, page))
            rows = [ln for ln in text.splitlines() if ln.startswith("| ") and not ln.startswith("| ---")]
            assert len(rows) >= 2, f"{name}: no table with a row"  # header + at least one row
            assert f"]({prefix}" in text, f"{name}: no link to its results file from {page}"


def test_removing_a_results_row_fails_the_check(tmp_path: Path) -> None:
    """The issue's "Done when": a row removed from a copy of a results file, the check fails (here, one results file
    after another: a table row disappears, a range moves, or the renderer refuses)."""
    root = _copy(tmp_path)
    page = _with_every_block(root)
    assert docs.check(root) == []

    _edit(root, "benchmarks/results/retention.json", lambda d: d["bytes"].pop())
    problems = docs.check(root)
    assert any(page in p and "disk" in p for p in problems)
    shutil.copy(ROOT / "benchmarks/results/retention.json", root / "benchmarks/results/retention.json")

    _edit(root, "benchmarks/results/fleet.json", lambda d: d["writer_summary"]["local"]["by_n"].pop("3"))
    assert any("fleet" in p for p in docs.check(root))
    shutil.copy(ROOT / "benchmarks/results/fleet.json", root / "benchmarks/results/fleet.json")

    # One hook-overhead run fewer: the published range is over the runs that remain.
    runs = sorted((root / docs.HOOK_RUNS).glob(docs.HOOK_RUN_GLOB))
    assert len(runs) >= 2
    runs[-1].unlink()
    assert any("costs" in p for p in docs.check(root))


def test_the_collector_memory_figures_are_the_results_files(tmp_path: Path) -> None:
    """docs/reliability.md's memory figures come from collector_memory.json: a changed RSS or a removed row fails the
    check, a file without limits or without the file at all cannot be rendered."""
    rel = "benchmarks/results/collector_memory.json"
    root = _copy(tmp_path)
    page = "docs/reliability.md"
    assert "collector-memory" in docs.blocks_in((root / page).read_text())
    assert docs.check(root) == []

    def restore() -> None:
        shutil.copy(ROOT / rel, root / rel)

    def bump(d: dict[str, Any]) -> None:
        d["limits"][0]["points"][-1][1] += 100  # the uncapped RSS after the last batch

    _edit(root, rel, bump)
    assert docs.check(root) == [f"{page} differs from what the results render (blocks: soak, collector-memory)"]
    restore()
    _edit(root, rel, lambda d: [lim["points"].pop() for lim in d["limits"]])  # a table row fewer
    assert any(page in p and "collector-memory" in p for p in docs.check(root))
    restore()
    _edit(root, rel, lambda d: d["limits"][1]["points"].pop())  # the limits no longer sampled at the same rows
    with pytest.raises(docs.DocsError, match=r"collector_memory\.json: the limits need the same"):
        docs.check(root)
    _edit(root, rel, lambda d: d.update(limits=[]))
    with pytest.raises(docs.DocsError, match=r"collector_memory\.json: the limits need the same"):
        docs.check(root)
    (root / rel).unlink()
    with pytest.raises(docs.DocsError, match=r"cites benchmarks/results/collector_memory\.json, which does not exist"):
        docs.check(root)
    assert docs.main(["--check", "--root", str(root)]) == 2


def test_removing_a_policy_sweep_row_makes_the_renderer_fail(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    _edit(root, docs.POLICY_DATA, lambda d: d["sweep"].remove(next(r for r in d["sweep"] if r["policy"] == "lru")))
    with pytest.raises(MissingRows, match="no row with"):
        docs.check(root)
    assert docs.main(["--check", "--root", str(root)]) == 2


def test_a_table_that_should_have_rows_and_has_none_is_an_error(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    _with_every_block(root)
    _edit(root, "benchmarks/results/kv_events.json", lambda d: d.pop("published_rate"))
    with pytest.raises(docs.DocsError, match="no 'published_rate'"):
        docs.check(root)
    _edit(root, "benchmarks/results/ingest.json", lambda d: d.update(phases=[]))
    shutil.copy(ROOT / "benchmarks/results/kv_events.json", root / "benchmarks/results/kv_events.json")
    with pytest.raises(docs.DocsError, match="ingest: the table would have no rows"):
        docs.check(root)


def test_a_missing_cited_results_file_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = _copy(tmp_path)
    _with_every_block(root)
    (root / "benchmarks/results/kv_events.json").unlink()
    with pytest.raises(docs.DocsError, match=r"cites benchmarks/results/kv_events\.json, which does not exist"):
        docs.check(root)
    assert docs.main(["--check", "--root", str(root)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "kv_events.json" in err


def test_a_page_citing_a_results_file_that_does_not_exist_is_an_error(tmp_path: Path) -> None:
    """Hand-written prose counts too: a path under benchmarks/results/ a page names must exist."""
    root = _copy(tmp_path)
    page = root / "docs/kv-events.md"
    page.write_text(page.read_text() + "\nSee [this](../benchmarks/results/no_such_run.json).\n")
    with pytest.raises(docs.DocsError, match=r"no_such_run\.json"):
        docs.check(root)
    page.write_text(page.read_text().replace("no_such_run.json", "gpu/serving/<name>/"))
    assert docs.check(root) == []  # a placeholder is a pattern, not a citation


def test_a_plot_without_data_is_an_error(tmp_path: Path) -> None:
    data = json.loads((ROOT / docs.POLICY_DATA).read_text())
    assert all(pts for series in policy_table.plot_series(data).values() for pts in series.values())
    data["meta"]["fractions"] = []  # every series of every plot empty
    with pytest.raises(MissingRows, match="has no point"):
        policy_table.plot_series(data)
    data = json.loads((ROOT / docs.POLICY_DATA).read_text())
    data["learned_eval"] = [r for r in data["learned_eval"] if r["policy"] != "learned"]
    with pytest.raises(MissingRows, match="learned"):
        policy_table.plot_series(data)
    # Through the command: nothing drawn, nothing written.
    root = _copy(tmp_path)
    before = {p: p.read_bytes() for p in (root / "docs").glob("policy-*.png")}
    _edit(root, docs.POLICY_DATA, lambda d: d["meta"].update(fractions=[]))
    assert docs.main(["--root", str(root)]) == 2
    assert {p: p.read_bytes() for p in (root / "docs").glob("policy-*.png")} == before


def test_a_missing_plot_file_fails_the_check(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    (root / "docs/policy-gap-closed.png").unlink()
    assert docs.check(root) == ["docs/policy-gap-closed.png is missing"]


def test_block_markers_are_a_contract(tmp_path: Path) -> None:
    ctx = docs.Context(ROOT, "README.md")
    with pytest.raises(docs.DocsError, match="unknown generated block 'nope'"):
        docs.fill_blocks("<!-- BEGIN GENERATED nope -->\n<!-- END GENERATED nope -->\n", ctx)
    with pytest.raises(docs.DocsError, match="has no '<!-- END GENERATED disk -->'"):
        docs.fill_blocks("a\n<!-- BEGIN GENERATED disk -->\nold\n", ctx)
    with pytest.raises(docs.DocsError, match="END GENERATED without its BEGIN"):
        docs.fill_blocks("<!-- END GENERATED disk -->\n", ctx)
    with pytest.raises(docs.DocsError, match="inside block 'disk'"):
        docs.fill_blocks("<!-- BEGIN GENERATED disk -->\n<!-- BEGIN GENERATED fleet -->\n"
                         "<!-- END GENERATED fleet -->\n<!-- END GENERATED disk -->\n", ctx)
    text = "# Title\n\nprose\n<!-- BEGIN GENERATED disk -->\nstale 1,234\n<!-- END GENERATED disk -->\nafter\n"
    filled = docs.fill_blocks(text, ctx)
    assert filled.startswith("# Title\n\nprose\n<!-- BEGIN GENERATED disk -->\n")
    assert filled.endswith("<!-- END GENERATED disk -->\nafter\n") and "stale" not in filled
    assert docs.fill_blocks(filled, ctx) == filled  # rendering is idempotent
    assert docs.blocks_in(filled) == ["disk"]
    # A stale block in a copied page: the check names the page, and a write fixes it.
    root = _copy(tmp_path)
    page = root / "docs/reliability.md"
    page.write_text(page.read_text() + "\n" + text)
    assert docs.check(root) == ["docs/reliability.md differs from what the results render "
                                "(blocks: soak, collector-memory, disk)"]
    assert docs.main(["--check", "--root", str(root)]) == 1
    page.write_text(docs.fill_blocks(page.read_text(), docs.Context(root, "docs/reliability.md")))
    assert docs.check(root) == []


def test_ratios_print_with_the_precision_their_spread_supports() -> None:
    assert docs.decimals_for(0.03) == 2 and docs.decimals_for(0.004) == 3 and docs.decimals_for(0.2) == 1
    assert docs.ratio_range([1.074, 1.046, 1.05]) == ("1.05-1.07x", False)
    assert docs.ratio_range([0.996, 1.004]) == ("0.996-1.004x", True)
    assert docs.ratio_range([1.0412, 1.0414]) == ("1.041x", False)
    with pytest.raises(docs.DocsError):
        docs.ratio_range([])


def test_costs_calls_the_off_mode_the_noise_floor() -> None:
    text = docs.block_costs(docs.Context(ROOT, "README.md"))
    off = next(ln for ln in text.splitlines() if ln.startswith("| off "))
    assert "noise floor" in off and "identical code" in off
    runs = docs.hook_runs(docs.Context(ROOT, "README.md"))
    lo = min(r["streaming_vs_plain"] for _, r in runs)
    hi = max(r["streaming_vs_plain"] for _, r in runs)
    streaming = next(ln for ln in text.splitlines() if ln.startswith("| streaming "))
    assert docs.ratio_range([lo, hi])[0] in streaming
    assert all(f"fresh_clone_{i}.json" in text for i in range(1, len(runs) + 1))


def test_the_readme_serving_figures_are_the_complete_gpu_ab_results(tmp_path: Path) -> None:
    """The README's GPU serving table reads the committed A/B results: a changed median fails the check, and an A/B
    that lost a run (so no longer complete) leaves the table, which then has no row and cannot be rendered."""
    root = _copy(tmp_path)
    assert "serving" in docs.blocks_in((root / "README.md").read_text())
    assert docs.check(root) == []
    complete = [r for r in docs.serving_results.load(docs.serving_results.GPU, root) if r.complete]
    assert complete, "the README's serving table needs one complete GPU A/B"
    rel = f"{complete[0].path}/ab.json"

    def slower(d: dict[str, Any]) -> None:
        d["by_policy"]["lru"]["ttft_p90_s"]["median"] += 0.1

    _edit(root, rel, slower)
    assert any("README.md" in p and "serving" in p for p in docs.check(root))
    shutil.copy(ROOT / rel, root / rel)
    assert docs.check(root) == []
    for r in complete:
        _edit(root, f"{r.path}/ab.json", lambda d: d["runs"].pop())
    with pytest.raises(docs.DocsError, match="serving"):
        docs.check(root)
