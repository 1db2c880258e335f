"""Small helpers shared by the policy tables (:mod:`kvfabric.bench.policy_table`, :mod:`kvfabric.bench.learned_table`)
over their raw result rows (dicts)."""

from __future__ import annotations

import os
from typing import Any


def pick(rows: list[dict[str, Any]], **kw: Any) -> dict[str, Any] | None:
    """The first row whose fields equal every keyword given, or None."""
    for r in rows:
        if all(r.get(k) == v for k, v in kw.items()):
            return r
    return None


def gap_closed(p: float, lru: float, opt: float) -> float | None:
    """Share of the LRU-to-optimum gap that ``p`` closes (None when there is no gap)."""
    gap = opt - lru
    return None if gap <= 1e-12 else (p - lru) / gap


def trace_name(path: str) -> str:
    """A trace file's short name: ``../shared/traces/mooncake_synthetic_trace.jsonl`` -> ``synthetic_trace``."""
    return os.path.basename(path).removesuffix(".jsonl").removeprefix("mooncake_")
