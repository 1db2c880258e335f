"""Imports run one way: the package's import graph, read with ``ast``, has no cycle and no arrow against the cut.

The layers, lowest first (a unit may import its own layer's units only where listed below, and any lower layer):

  0  contract, argtypes, usage      what crosses a process boundary; small shared leaves
  1  lifecycle                      records in, side table and event rows out
  2  policies                       key functions and the victim index
  3  settings, queries              the KVFABRIC_* table; the named SQL
  4  engine, forwarder              inside vLLM's process; the forwarder process (siblings: never each other)
  5  ingest, kvevents, sim          the collector's ingest side (sockets, KV events); the simulated engine and replays
  6  learn, analysis                fitting models; what-if and traffic analyses
  7  api                            REST
  8  collector                      the collector process
  9  bench, demo, cli               commands
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.import_graph import Arrow, cycles, package_graph, unexplained_function_imports, violations

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "kvfabric"

LAYERS = {
    "contract": 0, "argtypes": 0, "usage": 0,
    "lifecycle": 1, "lake": 1,
    "policies": 2,
    "settings": 3, "queries": 3,
    "engine": 4, "forwarder": 4,
    "ingest": 5, "kvevents": 5, "sim": 5,
    "learn": 6, "analysis": 6,
    "api": 7,
    "collector": 8,
    "bench": 9, "demo": 9, "cli": 9,
}

#: (source unit, target unit or outside package, at module level only) arrows that must not exist.
FORBIDDEN = [
    ("forwarder", "engine", False),
    ("engine", "forwarder", False),  # (the engine starts the forwarder by name, as a process)
    *[(low, high, False) for low in ("policies", "lifecycle", "contract") for high in ("engine", "forwarder")],
    *[(low, "vllm", True) for low in ("policies", "lifecycle", "contract", "forwarder")],
    *[("contract", unit, False) for unit in LAYERS if unit != "contract"],
]


@pytest.fixture(scope="module")
def graph() -> tuple[set[str], list[Arrow]]:
    return package_graph(ROOT, PACKAGE)


def test_the_package_has_no_import_cycle(graph: tuple[set[str], list[Arrow]]) -> None:
    modules, arrows = graph
    assert cycles(modules, [(a.source, a.target) for a in arrows]) == []


def test_no_import_runs_upward_or_across_the_process_cut(graph: tuple[set[str], list[Arrow]]) -> None:
    _, arrows = graph
    assert violations(arrows, PACKAGE, LAYERS, FORBIDDEN) == []


def test_every_unit_is_placed_in_a_layer(graph: tuple[set[str], list[Arrow]]) -> None:
    modules, _ = graph
    units = {m.split(".")[1] for m in modules if m.count(".") >= 1}
    assert units <= set(LAYERS), f"place {sorted(units - set(LAYERS))} in LAYERS"


def test_imports_inside_functions_say_why() -> None:
    # Module-level imports are the rule, in every unit and for every package (kvfabric's, vLLM, the standard
    # library); one made inside a function says why (a fast `--help`, vLLM or matplotlib loaded only where they
    # are used, a cycle avoided) on its line or the line above its run.
    assert unexplained_function_imports(ROOT, PACKAGE) == []


# ---- the checker itself, on small synthetic graphs: each rule fails when its arrow is there ----

def _arrows(*pairs: tuple[str, str], module_level: bool = True) -> list[Arrow]:
    return [Arrow(f"{PACKAGE}.{a}", b if b.startswith(("vllm", "numpy")) else f"{PACKAGE}.{b}", module_level, 1)
            for a, b in pairs]


def test_the_checker_finds_a_cycle() -> None:
    nodes = ["a", "b", "c", "d"]
    assert cycles(nodes, [("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")]) == [["a", "b", "c"]]
    assert cycles(nodes, [("a", "b"), ("b", "c"), ("c", "d")]) == []
    assert cycles(nodes, [("d", "d")]) == [["d"]]


@pytest.mark.parametrize("arrow", [
    ("forwarder.loop", "engine.handover"),
    ("engine.handover", "forwarder.loop"),
    ("policies.index", "engine.recorder"),
    ("lifecycle.expander", "engine.recorder"),
    ("contract.records", "engine.recorder"),
    ("policies.index", "forwarder.sinks"),
    ("lifecycle.expander", "forwarder.sinks"),
    ("contract.ring", "forwarder.loop"),
    ("contract.schema", "lifecycle.side_table"),
    ("contract.schema", "settings"),
    ("policies.base", "vllm.v1.core.block_pool"),
    ("lifecycle.keeper", "vllm"),
    ("contract.schema", "vllm.config"),
    ("forwarder.loop", "vllm"),
    ("lifecycle.side_table", "policies.base"),
    ("sim.harness", "bench.prompts"),
])
def test_the_checker_refuses_each_arrow_against_the_cut(arrow: tuple[str, str]) -> None:
    assert violations(_arrows(arrow), PACKAGE, LAYERS, FORBIDDEN) != []


def test_the_checker_allows_downward_arrows_and_lazy_vllm_outside_the_core() -> None:
    fine = _arrows(("engine.pool", "contract.records"), ("forwarder.loop", "lifecycle.expander"),
                   ("policies.base", "lifecycle.side_table"), ("sim.replay", "engine.install"),
                   ("engine.steering.victims", "engine.compiled"))
    assert violations(fine, PACKAGE, LAYERS, FORBIDDEN) == []
    assert violations(_arrows(("engine.plugin", "vllm.v1"), module_level=False), PACKAGE, LAYERS, FORBIDDEN) == []
    assert violations(_arrows(("policies.base", "vllm"), module_level=False), PACKAGE, LAYERS, FORBIDDEN) == []


def test_the_checker_reads_relative_and_nested_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "p"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import a\n")
    (pkg / "sub" / "a.py").write_text("from ..b import x\n\ndef f():\n    import p.sub  # (why)\n")
    (pkg / "b.py").write_text("x = 1\n")
    modules, arrows = package_graph(tmp_path, "p")
    assert modules == {"p", "p.sub", "p.sub.a", "p.b"}
    got = {(a.source, a.target, a.module_level) for a in arrows}
    assert got == {("p.sub", "p.sub.a", True), ("p.sub.a", "p.b", True), ("p.sub.a", "p.sub", False)}
    assert unexplained_function_imports(tmp_path, "p") == []
    (pkg / "sub" / "a.py").write_text("def f():\n    import p.b\n")
    assert len(unexplained_function_imports(tmp_path, "p")) == 1


def _tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_checker_reads_import_module_with_a_literal_name(tmp_path: Path) -> None:
    # The arrow settings -> sim hid in an ``importlib.import_module("kvfabric.sim.latency")``: it counts.
    _tree(tmp_path, {
        "kvfabric/__init__.py": "",
        "kvfabric/sim/__init__.py": "",
        "kvfabric/sim/latency.py": "NAMES = ()\n",
        "kvfabric/settings.py": (
            "import importlib\nfrom importlib import import_module\n\n"
            "LOADED = import_module('kvfabric.sim')\n\n"
            "def names():\n"
            "    return importlib.import_module('kvfabric.sim.latency').NAMES\n\n"
            "def computed(name):\n"
            "    return importlib.import_module(name)  # (a name known at run time only: not an arrow)\n"
        ),
    })
    _, arrows = package_graph(tmp_path, PACKAGE)
    got = {(a.source, a.target, a.module_level) for a in arrows if a.target.startswith(PACKAGE)}
    assert got == {("kvfabric.settings", "kvfabric.sim", True), ("kvfabric.settings", "kvfabric.sim.latency", False)}
    assert len([v for v in violations(arrows, PACKAGE, LAYERS, FORBIDDEN) if "upward import settings" in v]) == 2
    assert len(unexplained_function_imports(tmp_path, PACKAGE)) == 1  # names(): no comment says why


@pytest.mark.parametrize("unit", sorted(LAYERS))
def test_the_checker_wants_a_reason_for_a_function_import_in_every_unit(tmp_path: Path, unit: str) -> None:
    body = "def f():\n    from kvfabric.usage import UsageError\n    return UsageError\n"
    _tree(tmp_path, {"kvfabric/__init__.py": "", "kvfabric/usage.py": "UsageError = 1\n",
                     f"kvfabric/{unit}/__init__.py": "", f"kvfabric/{unit}/m.py": body})
    assert [line.split(":")[0] for line in unexplained_function_imports(tmp_path, PACKAGE)] == [f"kvfabric.{unit}.m"]
    (tmp_path / f"kvfabric/{unit}/m.py").write_text(body.replace("UsageError\n", "UsageError  # (why)\n", 1))
    assert unexplained_function_imports(tmp_path, PACKAGE) == []
    (tmp_path / f"kvfabric/{unit}/m.py").write_text(body.replace("    from", "    # (why)\n    from", 1))
    assert unexplained_function_imports(tmp_path, PACKAGE) == []


@pytest.mark.parametrize("statement", [
    "import json", "from vllm.config import VllmConfig", "import matplotlib.pyplot as plt", "from tqdm import tqdm",
])
def test_the_checker_wants_a_reason_for_a_function_import_of_an_outside_package(tmp_path: Path, statement: str) -> None:
    body = f"def f():\n    {statement}\n    return 1\n"
    _tree(tmp_path, {"kvfabric/__init__.py": "", "kvfabric/bench/__init__.py": "", "kvfabric/bench/m.py": body})
    assert [line.split(":")[0] for line in unexplained_function_imports(tmp_path, PACKAGE)] == ["kvfabric.bench.m"]
    (tmp_path / "kvfabric/bench/m.py").write_text(body.replace(f"    {statement}", f"    # (why)\n    {statement}"))
    assert unexplained_function_imports(tmp_path, PACKAGE) == []
    # (at module level, in a module-level ``if TYPE_CHECKING:``, or in one inside a function: not function level)
    for text in (f"{statement}\n", f"from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    {statement}\n",
                 f"import typing\n\ndef f():\n    if typing.TYPE_CHECKING:\n        {statement}\n"):
        (tmp_path / "kvfabric/bench/m.py").write_text(text)
        assert unexplained_function_imports(tmp_path, PACKAGE) == []
