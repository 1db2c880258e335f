"""The import graph of a package, read with ``ast`` (nothing is imported), and the rules its arrows must obey.

Used by ``tests/test_import_graph.py``; kept apart so the checker itself can be tested on small synthetic graphs.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Arrow:
    """``source`` imports ``target`` (a module, or a name's module), at module level or inside a function/class."""

    source: str
    target: str
    module_level: bool
    line: int


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def arrows_of(source: str, text: str, is_package: bool) -> list[Arrow]:
    """Every import in ``text`` (the module ``source``), resolved to absolute names. ``from X import y`` yields
    ``X.y`` (it may name a submodule) and the caller maps it to the longest known module. A call
    ``importlib.import_module("a.b")`` (or ``import_module("a.b")``) with a string literal is an import of ``a.b``
    too, at module level when the call is not inside a function or class."""
    tree = ast.parse(text)
    top = {id(node) for node in tree.body}
    # (``if TYPE_CHECKING:`` and ``try:`` blocks at module level run at import: count them as module level)
    for node in tree.body:
        if isinstance(node, (ast.If, ast.Try)):
            top.update(id(n) for n in ast.walk(node))
    # (an ``if TYPE_CHECKING:`` block never runs, wherever it sits: never a function-level import)
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            top.update(id(n) for n in ast.walk(node))
    # (a call runs at import when it sits in a module-level statement other than a def or a class)
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            top.update(id(n) for n in ast.walk(node) if isinstance(n, ast.Call))
    out: list[Arrow] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _imported_by_name(node) is not None:
            out.append(Arrow(source, _imported_by_name(node) or "", id(node) in top, node.lineno))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                out.append(Arrow(source, alias.name, id(node) in top, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = source.split(".") if is_package else source.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:
                out.append(Arrow(source, f"{module}.{alias.name}", id(node) in top, node.lineno))
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported_by_name(call: ast.Call) -> str | None:
    """The module a call ``importlib.import_module("a.b")`` / ``import_module("a.b")`` names, else None (a name
    computed at run time cannot be read)."""
    func = call.func
    named = (isinstance(func, ast.Attribute) and func.attr == "import_module"
             and isinstance(func.value, ast.Name) and func.value.id == "importlib") or \
            (isinstance(func, ast.Name) and func.id == "import_module")
    if named and call.args and isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, str):
        return call.args[0].value
    return None


def package_graph(root: Path, package: str) -> tuple[set[str], list[Arrow]]:
    """(modules, arrows between them and to outside packages) of ``package`` under ``root``; an arrow's target is
    the longest module of the package it names, or the outside name as written."""
    modules: dict[str, tuple[Path, bool]] = {}
    for path in sorted((root / package).rglob("*.py")):
        modules[module_name(root, path)] = (path, path.name == "__init__.py")
    arrows: list[Arrow] = []
    for name, (path, is_package) in modules.items():
        for a in arrows_of(name, path.read_text(encoding="utf-8"), is_package):
            target = resolve(a.target, modules.keys(), package)
            arrows.append(Arrow(a.source, target, a.module_level, a.line))
    return set(modules), arrows


def resolve(name: str, modules: Iterable[str], package: str) -> str:
    """The longest module of ``modules`` that ``name`` is or lies in (``kvfabric.x.y.Name`` -> ``kvfabric.x.y``)."""
    if not (name == package or name.startswith(package + ".")):
        return name
    known = set(modules)
    parts = name.split(".")
    while parts and ".".join(parts) not in known:
        parts.pop()
    return ".".join(parts) if parts else name


def cycles(nodes: Iterable[str], edges: Iterable[tuple[str, str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (or a self-loop): each is an import cycle."""
    graph: dict[str, set[str]] = {n: set() for n in nodes}
    for a, b in edges:
        if a in graph and b in graph:
            graph[a].add(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # (Tarjan; the graphs here are a few hundred nodes)
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph[v]:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def unit_of(module: str, package: str) -> str:
    """The package's first-level unit a module belongs to (``kvfabric.engine.steering.victims`` -> ``engine``)."""
    rest = module[len(package) + 1:] if module.startswith(package + ".") else ""
    return rest.split(".")[0] if rest else ""


def violations(arrows: Iterable[Arrow], package: str, layers: Mapping[str, int],
               forbidden: Iterable[tuple[str, str, bool]]) -> list[str]:
    """What breaks the rules, one line each:

    * an arrow from a unit to a unit of a higher layer (``layers``: unit -> rank; within a unit anything goes);
    * an arrow of ``forbidden`` (source unit, target unit or outside package, module level only?) present;
    * an arrow from or to a unit ``layers`` does not know (a new package must be placed).
    """
    out: list[str] = []
    forbidden = list(forbidden)
    for a in arrows:
        src = unit_of(a.source, package)
        inside = a.target == package or a.target.startswith(package + ".")
        dst = unit_of(a.target, package) if inside else a.target.split(".")[0]
        where = f"{a.source}:{a.line} imports {a.target}" + ("" if a.module_level else " (in a function)")
        for f_src, f_dst, module_level_only in forbidden:
            if src == f_src and dst == f_dst and (a.module_level or not module_level_only):
                out.append(f"forbidden arrow {f_src} -> {f_dst}: {where}")
        if not inside or a.target == package or src == dst:
            continue
        if src not in layers or dst not in layers:
            out.append(f"unplaced unit {src if src not in layers else dst!r}: {where}")
        elif layers[dst] > layers[src]:
            out.append(f"upward import {src} (layer {layers[src]}) -> {dst} (layer {layers[dst]}): {where}")
    return out


def unexplained_function_imports(root: Path, package: str) -> list[str]:
    """Imports made inside a function (of ``package``'s modules or of any other: vLLM, the standard library) with
    no comment on the line above their run or on the line itself (module-level imports are the rule; a
    function-level one says why). ``if TYPE_CHECKING:`` blocks are not function level."""
    out = []
    for path in sorted((root / package).rglob("*.py")):
        lines = path.read_text(encoding="utf-8").split("\n")
        name = module_name(root, path)
        for a in arrows_of(name, "\n".join(lines), path.name == "__init__.py"):
            if a.module_level:
                continue
            at = a.line - 1  # (a comment above a run of imports explains the run)
            while at > 0 and lines[at - 1].strip().startswith(("import ", "from ")):
                at -= 1
            above = lines[at - 1] if at >= 1 else ""
            if "#" not in lines[a.line - 1] and not above.strip().startswith("#"):
                out.append(f"{name}:{a.line} imports {a.target} inside a function without a comment saying why")
    return out
