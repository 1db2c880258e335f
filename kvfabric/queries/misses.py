"""Miss attribution and eviction causes (docs/design.md §5): shapes the rows of ``misses.sql``,
``request_story.sql`` and ``eviction_reasons.sql`` into the JSON the REST API and ``kvfabric query`` return.

The SQL does the work (exact, over the whole stored history of a run); this module only groups rows and names
fields, so the REST answer and the CLI's are the same dicts.

Invariants of the shapes built here (tested):
  * every split (admission, family, window, run) has ``hit_tokens + evicted_tokens + novel_tokens +
    uncacheable_tokens == prompt_tokens``;
  * the family items and the windows each sum to the run's totals;
  * ``evictions_by_reason`` always has every key of :data:`REASON_KEYS` (0 when absent).
"""

from __future__ import annotations

from typing import Any

from kvfabric.contract import schema as S

Row = dict[str, Any]

UNKNOWN_REASON = "unknown"
REASON_KEYS: tuple[str, ...] = (*S.EVICTION_REASONS, UNKNOWN_REASON)
"""Keys of ``evictions_by_reason``: the documented reasons, then ``unknown`` (rows that carry none)."""

SPLIT_FIELDS: tuple[str, ...] = (
    "admissions",
    "prompt_tokens",
    "hit_tokens",
    "evicted_tokens",
    "novel_tokens",
    "uncacheable_tokens",
    "hit_tokens_past_prompt",
)
"""Numbers of one split, in the order responses show them."""

DEFAULT_BUCKET_S = 60.0
MIN_BUCKET_S = 0.001
ONE_WINDOW_NS = 1 << 62
"""A bucket longer than any run: the summary asks for the run level only, in one window."""


def _split(row: Row) -> Row:
    return {k: int(row[k] or 0) for k in SPLIT_FIELDS}


def evictions_by_reason(rows: list[Row]) -> dict[str, int]:
    """``eviction_reasons.sql`` rows as ``{reason: evicted_blocks}`` with every reason present."""
    out = dict.fromkeys(REASON_KEYS, 0)
    for r in rows:
        key = r["reason"] if r["reason"] in out else UNKNOWN_REASON
        out[key] += int(r["evicted_blocks"])
    return out


def misses_response(run: str, bucket_s: float, rows: list[Row], reasons: list[Row]) -> Row:
    """The ``/runs/{run}/misses`` body from ``misses.sql`` rows (without admissions) and the run's reasons."""
    totals: Row = dict.fromkeys(SPLIT_FIELDS, 0)
    items: list[Row] = []
    windows: list[Row] = []
    for r in rows:
        level = r["level"]
        if level == "run":
            totals = _split(r)
        elif level == "family":
            items.append({"family": r["family"], **_split(r)})
        elif level == "window":
            windows.append({"window_start_ns": int(r["window_start_ns"]), **_split(r)})
    return {
        "run_id": run,
        "bucket_s": bucket_s,
        "totals": totals,
        "items": items,
        "windows": windows,
        "evictions_by_reason": evictions_by_reason(reasons),
        "unavailable": None,
    }


def unavailable_response(run: str, bucket_s: float, reasons: list[Row], why: str) -> Row:
    """The ``/runs/{run}/misses`` body of a run whose events have no lookups to split (vLLM's KV events): no
    totals, families or windows, and ``unavailable`` saying why; its evictions by reason still count."""
    return {
        "run_id": run,
        "bucket_s": bucket_s,
        "totals": None,
        "items": [],
        "windows": [],
        "evictions_by_reason": evictions_by_reason(reasons),
        "unavailable": why,
    }


def admission_rows(rows: list[Row]) -> list[Row]:
    """Per-admission splits from ``misses.sql`` rows of level ``admission``, in lookup order."""
    return [
        {"request_id": r["request_id"], "engine": r["engine"], "family": r["family"], "ts_ns": int(r["ts_ns"]),
         **_split(r)}
        for r in rows
        if r["level"] == "admission"
    ]


def summary_fields(rows: list[Row], reasons: list[Row]) -> Row:
    """What the run summary gains: the run's split (its hit part is ``prefix_hit_tokens`` less
    ``hit_tokens_past_prompt``) and ``evictions_by_reason``."""
    run = next((r for r in rows if r["level"] == "run"), None)
    split = _split(run) if run is not None else dict.fromkeys(SPLIT_FIELDS, 0)
    return {
        "evicted_tokens": split["evicted_tokens"],
        "novel_tokens": split["novel_tokens"],
        "uncacheable_tokens": split["uncacheable_tokens"],
        "hit_tokens_past_prompt": split["hit_tokens_past_prompt"],
        "evictions_by_reason": evictions_by_reason(reasons),
    }


_BLOCK_FIELDS: tuple[str, ...] = (
    "depth",
    "tokens",
    "kind",
    "cause",
    "block_hash",
    "block_id",
    "sealed_ns",
    "rebuilt",
    "rebuilt_age_ns",
    "first_cached_ns",
    "last_evicted_ns",
    "evicted_reason",
    "evicted_by_request",
    "evicted_idle_ns",
    "evicted_share_degree",
    "evicted_hit_count",
)


def story_response(request_id: str, rows: list[Row]) -> Row:
    """The ``/requests/{request_id}`` body from ``request_story.sql`` rows (one per admission and position)."""
    admissions: list[Row] = []
    current: Row | None = None
    for r in rows:
        key = r["lookup_key"]
        if current is None or current["_key"] != key:
            current = {
                "_key": key,
                "run_id": r["run_id"],
                "engine": r["engine"],
                "admission": int(r["admission"]),
                "family": r["family"],
                "lookup_ns": int(r["lookup_ns"]),
                "lookup_step": r["lookup_step"],
                "prompt_tokens": int(r["prompt_tokens"]),
                "lookup_hit_tokens": int(r["lookup_hit_tokens"]),
                "lookup_depth": r["lookup_depth"],
                "regretful_evictions": r["regretful_evictions"],
                "block_size": int(r["block_size"]),
                "split": dict.fromkeys(("hit_tokens", "evicted_tokens", "novel_tokens", "uncacheable_tokens"), 0),
                "blocks": [],
            }
            admissions.append(current)
        block = {k: r[k] for k in _BLOCK_FIELDS}
        h = block["block_hash"]
        block["block_hash_hex"] = None if h is None else f"{h & 0xFFFFFFFFFFFFFFFF:016x}"
        current["blocks"].append(block)
        current["split"][f"{r['kind']}_tokens"] += int(r["tokens"])
    # A prompt of 0 tokens has no positions: its admission has no rows (nothing to tell).
    admissions.sort(key=lambda a: (a["lookup_ns"], a["_key"]))
    for a in admissions:
        del a["_key"]
    runs = sorted({a["run_id"] for a in admissions})
    return {"request_id": request_id, "runs": runs, "admissions": admissions, "unavailable": None}
