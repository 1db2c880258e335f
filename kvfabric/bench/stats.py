"""Small statistics shared by the benchmark summary and the A/B report (no NumPy needed)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["median", "percentile", "primary_runs", "spread"]


def percentile(values: Iterable[float], q: float) -> float | None:
    """The ``q``-quantile (0..1) with linear interpolation between order statistics; None when empty."""
    xs = sorted(v for v in values if v is not None and not math.isnan(v))
    if not xs:
        return None
    if len(xs) == 1:
        return float(xs[0])
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return float(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo))


def median(values: Iterable[float]) -> float | None:
    return percentile(values, 0.5)


def spread(values: Sequence[float | None]) -> dict[str, float | None]:
    """``median``, ``min``, ``max`` and ``spread`` (= max - min) of a few repetitions."""
    xs = [float(v) for v in values if v is not None]
    if not xs:
        return {"median": None, "min": None, "max": None, "spread": None}
    return {"median": median(xs), "min": min(xs), "max": max(xs), "spread": max(xs) - min(xs)}


def primary_runs(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The runs of an A/B result (``kvfabric.bench.report.build``) that its single-capacity sections describe: all
    of them, or under a capacity sweep the primary capacity's. (Here, not in the report, so that the plots, which
    the report draws, read it without importing the report.)"""
    return [r for r in result["runs"] if r.get("capacity") == result.get("capacity")]
