"""KV saved at equal hit rate: how much smaller a policy's KV pool is than the pool LRU needs for the same hit rate.

Input: LRU's median prefix hit rate at each swept capacity (``kvfabric ab --capacities``), and a policy's median
hit rate ``h`` at capacity ``c``. LRU's curve is made monotone (hit rate never falls as the pool grows: each point
takes the running maximum over the smaller capacities, so a noisy dip cannot make a smaller pool look "enough") and
read piecewise-linearly between the swept points. ``c'`` is the smallest capacity at which that curve reaches
``h``, and ``saved = 1 - c / c'``. Outside the swept range only a bound is known:

* ``h`` above LRU's best hit rate in the sweep: LRU needs more than the largest capacity ``c_max``, so
  ``saved >= 1 - c / c_max`` (``bound = "at_least"``);
* ``h`` below LRU's hit rate at the smallest capacity ``c_min``: LRU needs less than ``c_min``, so
  ``saved <= 1 - c / c_min`` (``bound = "at_most"``; often negative: the policy needs *more* KV than LRU).

Pure arithmetic, no I/O: the report (:mod:`kvfabric.bench.report`) and its tests call it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from itertools import pairwise
from typing import Any, Literal

__all__ = ["KvSaved", "kv_saved", "lru_capacity_for", "monotone_curve"]

Bound = Literal["exact", "at_least", "at_most"]


@dataclass(frozen=True)
class KvSaved:
    """One policy at one capacity. ``lru_capacity`` is ``c'`` when ``bound == "exact"``, else the swept end it is
    bounded by (``c_max`` for ``at_least``, ``c_min`` for ``at_most``); ``saved`` is ``1 - capacity /
    lru_capacity`` (exact, or the bound). Both None when the policy's hit rate or LRU's curve is unknown."""

    policy: str
    capacity: int
    hit_rate: float | None
    lru_capacity: float | None
    saved: float | None
    bound: Bound | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def monotone_curve(points: Mapping[int, float | None]) -> list[tuple[int, float]]:
    """LRU's (capacity, hit rate) points sorted by capacity, unknown ones dropped, each hit rate raised to the
    running maximum over smaller capacities (so the result is non-decreasing)."""
    out: list[tuple[int, float]] = []
    best = float("-inf")
    for c in sorted(points):
        h = points[c]
        if h is None:
            continue
        best = max(best, float(h))
        out.append((int(c), best))
    return out


def lru_capacity_for(curve: Sequence[tuple[int, float]], h: float) -> tuple[float, Bound]:
    """The smallest capacity at which the monotone ``curve`` (from :func:`monotone_curve`, non-empty) reaches hit
    rate ``h``, with ``"exact"``; or the swept end that bounds it (see the module docstring)."""
    if not curve:
        raise ValueError("LRU's hit-rate curve is empty")
    c0, h0 = curve[0]
    if h < h0:
        return float(c0), "at_most"
    if h == h0:
        return float(c0), "exact"
    for (ca, ha), (cb, hb) in pairwise(curve):
        if ha < h <= hb:  # hb > ha here, so the division is safe
            return ca + (h - ha) / (hb - ha) * (cb - ca), "exact"
    return float(curve[-1][0]), "at_least"


def kv_saved(lru: Mapping[int, float | None], policy: str, capacity: int, hit_rate: float | None) -> KvSaved:
    """KV saved by ``policy`` at ``capacity`` with median ``hit_rate``, against LRU's median hit rate per capacity
    ``lru`` (see the module docstring)."""
    curve = monotone_curve(lru)
    if hit_rate is None or not curve:
        return KvSaved(policy, capacity, hit_rate, None, None, None)
    c_lru, bound = lru_capacity_for(curve, float(hit_rate))
    return KvSaved(policy, capacity, hit_rate, c_lru, 1.0 - capacity / c_lru, bound)
