"""Which requests an A/B's policies change: per request, the reuse it missed against its best run in the A/B.

A scenario's requests are the same in every run of an A/B (the same session and turn always sends the same prompt;
only the dispatch order moves with timing), so each request can be compared with itself across runs and policies.
A request **missed reuse** in a run when it prefilled at least one block more than it did in the A/B's run where it
prefilled least (over every run of every policy): context that some run kept cached and this one recomputed. What
no run kept (new turn text, cold documents) is the same for all policies and is not counted.

Invariants: read only from the client's per-request records (``runs/<run_id>.bench.json``, the ``requests`` list)
of an A/B folder; a request's identity is ``(component, session, turn)``; a run's failed requests are left out; the
TTFT medians pool every request of every run of a policy (one distribution, not a median of run medians).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvfabric.bench.stats import median

__all__ = ["MissedReuse", "RunsMissingError", "missed_reuse", "missed_reuse_of_folder"]

Key = tuple[str, str | None, int | None]


class RunsMissingError(ValueError):
    """An A/B folder whose ``ab.json`` names runs that have no per-request file under ``runs/``."""


@dataclass(frozen=True)
class MissedReuse:
    """One policy's requests, pooled over its runs."""

    policy: str
    requests: int
    missed: int
    missed_tokens_p50: float | None
    """Median tokens a request that missed reuse prefilled beyond its best run."""
    ttft_p50_missed_s: float | None
    ttft_p50_rest_s: float | None
    ttft_p50_s: float | None

    @property
    def share(self) -> float:
        return self.missed / self.requests if self.requests else 0.0


def _key(request: dict[str, Any]) -> Key:
    return (str(request["component"]), request.get("session"), request.get("turn"))


def _uncached(request: dict[str, Any]) -> int:
    return int(request["prompt_tokens"]) - int(request.get("cached_tokens") or 0)


def missed_reuse(runs: dict[str, list[list[dict[str, Any]]]], block_size: int) -> list[MissedReuse]:
    """``runs``: per policy, each run's request records. One :class:`MissedReuse` per policy, in ``runs``' order."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, not {block_size}")
    best: dict[Key, int] = {}
    for policy_runs in runs.values():
        for requests in policy_runs:
            for r in requests:
                if r.get("ok"):
                    k, uncached = _key(r), _uncached(r)
                    best[k] = min(best.get(k, uncached), uncached)
    out = []
    for policy, policy_runs in runs.items():
        ok = [r for requests in policy_runs for r in requests if r.get("ok")]
        extra = [(_uncached(r) - best[_key(r)], r) for r in ok]
        missed = [(x, r) for x, r in extra if x >= block_size]
        rest = [r for x, r in extra if x < block_size]
        out.append(MissedReuse(
            policy=policy, requests=len(ok), missed=len(missed),
            missed_tokens_p50=median(float(x) for x, _ in missed),
            ttft_p50_missed_s=median(float(r["ttft_s"]) for _, r in missed if r.get("ttft_s") is not None),
            ttft_p50_rest_s=median(float(r["ttft_s"]) for r in rest if r.get("ttft_s") is not None),
            ttft_p50_s=median(float(r["ttft_s"]) for r in ok if r.get("ttft_s") is not None),
        ))
    return out


def missed_reuse_of_folder(folder: Path, ab: dict[str, Any]) -> list[MissedReuse] | None:
    """:func:`missed_reuse` of a ``kvfabric ab --out`` folder whose ``ab.json`` is ``ab``; None when the folder
    keeps no per-request files at all (a results folder may leave ``runs/`` out). Raises
    :class:`RunsMissingError` when some runs have one and others do not (a partial copy would bias the pooling)."""
    files = {run["run_id"]: folder / "runs" / f"{run['run_id']}.bench.json" for run in ab["runs"]}
    present = [f.is_file() for f in files.values()]
    if not any(present):
        return None
    if not all(present):
        lost = sorted(rid for rid, f in files.items() if not f.is_file())
        raise RunsMissingError(f"{folder}: no per-request file for {', '.join(lost)}")
    runs: dict[str, list[list[dict[str, Any]]]] = {p: [] for p in ab["policies"]}
    for run in ab["runs"]:
        runs[run["policy"]].append(json.loads(files[run["run_id"]].read_text())["requests"])
    block_size = int(ab["plan"]["scenario"]["server"]["block_size"])
    return missed_reuse(runs, block_size)
