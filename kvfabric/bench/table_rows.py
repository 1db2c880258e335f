"""Small helpers shared by the policy tables (:mod:`kvfabric.bench.policy_table`, :mod:`kvfabric.bench.learned_table`)
over their raw result rows (dicts).

Rows name their trace by path. A results file may hold the same trace under several paths (relative to the
repository root, or absolute from whichever checkout ran a section), so rows are matched by the trace's file name
(:func:`trace_key`), never by the path as written; :func:`repo_relative` is what the sweep records from now on.
"""

from __future__ import annotations

import os
from typing import Any

from kvfabric.settings import repo_root


class MissingRows(ValueError):
    """A generated table or plot would have no data (or lacks rows it should have): the renderer stops here
    instead of publishing an empty table."""


def trace_name(path: str) -> str:
    """A trace file's short name: ``../shared/traces/mooncake_synthetic_trace.jsonl`` -> ``synthetic_trace``."""
    return os.path.basename(path).removesuffix(".jsonl").removeprefix("mooncake_")


def trace_key(path: str) -> str:
    """What identifies a trace across results rows, whatever checkout or working directory wrote them: its file
    name (:func:`trace_name`). ``/home/a/shared/traces/x.jsonl``, ``../shared/traces/x.jsonl`` and ``x`` match."""
    return trace_name(path)


def repo_relative(path: str) -> str:
    """``path`` (absolute, or relative to the working directory) relative to the repository root, as results
    files record it: ``/home/a/shared/traces/x.jsonl`` from a checkout at ``/home/a/main`` ->
    ``../shared/traces/x.jsonl``."""
    return os.path.relpath(os.path.abspath(path), repo_root())


def resolve(path: str) -> str:
    """A path as results files record it (relative to the repository root, or absolute) -> one to open."""
    return path if os.path.isabs(path) else os.path.join(repo_root(), path)


def _matches(row: dict[str, Any], kw: dict[str, Any]) -> bool:
    for k, v in kw.items():
        got = row.get(k)
        if k == "trace":
            if not isinstance(got, str) or trace_key(got) != trace_key(v):
                return False
        elif got != v:
            return False
    return True


def pick(rows: list[dict[str, Any]], **kw: Any) -> dict[str, Any] | None:
    """The first row whose fields equal every keyword given (``trace`` compared by :func:`trace_key`), or None."""
    for r in rows:
        if _matches(r, kw):
            return r
    return None


def need(rows: list[dict[str, Any]], what: str, **kw: Any) -> dict[str, Any]:
    """:func:`pick`, raising :class:`MissingRows` (saying what was looked for and which traces the rows hold)
    when no row matches."""
    r = pick(rows, **kw)
    if r is None:
        held = sorted({str(x.get("trace")) for x in rows})
        wanted = ", ".join(f"{k}={v!r}" for k, v in kw.items())
        raise MissingRows(f"{what}: no row with {wanted} among {len(rows)} rows (their traces: {held or 'none'})")
    return r


def gap_closed(p: float, lru: float, opt: float) -> float | None:
    """Share of the LRU-to-optimum gap that ``p`` closes (None when there is no gap)."""
    gap = opt - lru
    return None if gap <= 1e-12 else (p - lru) / gap
