"""Which numbers each event source can give: the one rule the REST API, the CLI and the reports apply.

Sources (``streams.source``): ``plugin`` (KVFabric's hook inside vLLM: every event type, lookups included) and
``kv_events`` (vLLM's standard KV-event stream, ``--kv-events-config``: blocks stored, removed and cleared, with no
request ids, lookups or hits). A number that needs lookups (:data:`SUMMARY_LOOKUP_FIELDS`) cannot be known from
``kv_events`` alone; answering 0 would read as "no hits", so it is null and the answer's ``unavailable`` maps the
field to :data:`NO_LOOKUPS`.

Invariants:
  * a selection (run, family, engine) in which some stream has lookups answers every number from those lookups,
    exactly as a plugin-only selection does (``prefix_hit_rate_from`` = ``lookups``, ``unavailable`` empty);
  * otherwise every lookup field is null and listed in ``unavailable``, except that where the engines' own counters
    were scraped (``prefix_cache_counters`` rows: vLLM's ``prefix_cache_queries`` and ``prefix_cache_hits``) and
    the level has them (a run or an engine; a family has none), ``prompt_tokens``, ``prefix_hit_tokens`` and
    ``prefix_hit_rate`` come from those counters (``prefix_hit_rate_from`` = ``engine_counters``);
  * a stream without a source (files older than the column) is a plugin stream.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

Row = dict[str, Any]

PLUGIN = "plugin"
KV_EVENTS = "kv_events"

NO_LOOKUPS = "not available from kv-events (no lookups)"
"""The reason every unavailable field carries, and the line the CLI and the demo print in its place."""

FROM_LOOKUPS = "lookups"
FROM_COUNTERS = "engine_counters"
FROM_COUNTERS_TEXT = "from the engine's counters"
"""How a report names a hit rate taken from vLLM's own counters."""

HIT_FIELDS: tuple[str, ...] = ("prompt_tokens", "prefix_hit_tokens", "prefix_hit_rate")
"""The fields the engine's counters can fill (run and engine levels)."""

SUMMARY_LOOKUP_FIELDS: tuple[str, ...] = (
    *HIT_FIELDS,
    "requests",
    "regretful_evictions",
    "evicted_tokens",
    "novel_tokens",
    "uncacheable_tokens",
    "hit_tokens_past_prompt",
)
"""Run-summary fields computed from ``prefix_lookup`` rows (and the miss split, which starts from them)."""

FAMILY_LOOKUP_FIELDS: tuple[str, ...] = (*HIT_FIELDS, "requests", "regretful_evictions")
FLEET_LOOKUP_FIELDS: tuple[str, ...] = ("requests", "prompt_tokens", "hit_tokens", "prefix_hit_rate")
FLEET_HIT_FIELDS: tuple[str, ...] = ("prompt_tokens", "hit_tokens", "prefix_hit_rate")

COUNTER_COLUMNS: tuple[str, ...] = ("counter_rows", "counter_prompt_tokens", "counter_hit_tokens")
"""Columns the SQL adds for this module and the answers do not carry."""


def normalised(sources: Iterable[str | None] | None) -> list[str]:
    """The distinct sources, sorted; a missing source is the plugin's."""
    return sorted({s or PLUGIN for s in (sources or [])})


def has_lookups(sources: Iterable[str | None] | None) -> bool:
    """Whether a selection with streams of ``sources`` has lookups (no stream at all: it has nothing to lack)."""
    found = normalised(sources)
    return not found or any(s != KV_EVENTS for s in found)


def apply(row: Row, lookup_fields: Iterable[str], *, hit_fields: tuple[str, ...] = HIT_FIELDS,
          counters: bool = True) -> Row:
    """``row`` (with ``sources`` and, when ``counters``, :data:`COUNTER_COLUMNS`) made honest about its source:
    adds ``sources``, ``prefix_hit_rate_from`` and ``unavailable`` and drops the counter columns (module
    docstring). ``hit_fields`` names the (prompt, hit, rate) fields the counters fill, in that order."""
    out = {k: v for k, v in row.items() if k not in COUNTER_COLUMNS}
    out["sources"] = normalised(row.get("sources"))
    if has_lookups(out["sources"]):
        out["prefix_hit_rate_from"] = FROM_LOOKUPS
        out["unavailable"] = {}
        return out
    missing = list(lookup_fields)
    out["prefix_hit_rate_from"] = None
    if counters and row.get("counter_rows"):
        prompt, hits = int(row["counter_prompt_tokens"] or 0), int(row["counter_hit_tokens"] or 0)
        prompt_field, hit_field, rate_field = hit_fields
        out[prompt_field], out[hit_field] = prompt, hits
        out[rate_field] = hits / prompt if prompt else 0.0
        out["prefix_hit_rate_from"] = FROM_COUNTERS
        missing = [f for f in missing if f not in hit_fields]
    for field in missing:
        out[field] = None
    out["unavailable"] = dict.fromkeys(missing, NO_LOOKUPS)
    return out
