"""Response models of the REST API (the JSON shapes are the contract; OpenAPI at /docs is generated from these).

Conventions: ``*_ns`` are nanoseconds since the epoch (int64), ``*_s`` seconds; block hashes are signed 64-bit
integers as stored (``block_hash_hex`` gives the 16-hex-digit form family ids use). Ratios are 0 when their
denominator is 0; a mean over no samples is null. A number the event source cannot give (lookups, from vLLM's KV
events) is null and named in ``unavailable`` with the reason (kvfabric/queries/availability.py), never 0.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


def _sources() -> Any:
    return Field(default_factory=list, description="event sources of the streams counted: plugin, kv_events")


def _hit_rate_from() -> Any:
    return Field(None, description="lookups (the plugin's prefix_lookup rows) or engine_counters (vLLM's own "
                                   "prefix-cache counters, scraped); null when unavailable")


def _unavailable() -> Any:
    return Field(default_factory=dict, description="fields the event source cannot give (null here), each with the "
                                                   "reason; empty when every field is answered")


class ErrorBody(BaseModel):
    """Every 4xx/5xx answer: ``detail`` is one human sentence; ``errors`` lists parameter problems on 422."""

    detail: str
    errors: list[dict[str, object]] | None = None


class RunInfo(BaseModel):
    run_id: str
    engines: list[str]
    policies: list[str]
    first_ts_ns: int | None = Field(description="oldest event time in the run (null before any event)")
    last_ts_ns: int | None
    events: int
    streams: int
    sequence_gaps: int = Field(description="batches lost between sinks and the collector (per-stream seq jumps)")


class RunSummary(BaseModel):
    """docs/design.md §5 for one run. The first ten fields are the contract; the rest are context."""

    run_id: str
    prompt_tokens: int | None
    prefix_hit_tokens: int | None
    prefix_hit_rate: float | None
    evicted_blocks: int
    shared_anchor_eviction_ratio: float
    protected_eviction_ratio: float
    rebuilt_from_eviction_blocks: int
    regretful_evictions: int | None
    wasted_prefill_tokens: int
    requests: int | None = Field(description="admissions (prefix_lookup rows)")
    events: int
    shared_anchor_evictions: int
    protected_evictions: int
    mean_time_to_rebuild_s: float | None
    admission_limited_blocks: int
    sink_dropped_events: int
    block_size: int
    engines: list[str]
    policies: list[str]
    sequence_gaps: int
    first_ts_ns: int | None
    last_ts_ns: int | None
    events_by_type: dict[str, int]
    evicted_tokens: int | None = Field(0, description="prompt tokens in blocks the engine had cached and lost (§5)")
    novel_tokens: int | None = Field(0, description="prompt tokens in blocks the engine had never cached (§5)")
    uncacheable_tokens: int | None = Field(
        0, description="last-token blocks, gate-refused or never computed blocks (§5)"
    )
    hit_tokens_past_prompt: int | None = Field(
        0, description="hits of resumed requests beyond their prompt: prefix_hit_tokens - hit_tokens_past_prompt "
                       "+ evicted + novel + uncacheable = prompt_tokens"
    )
    evictions_by_reason: dict[str, int] = Field(
        default_factory=dict, description="evicted blocks by reason: pressure, connector, reset, unknown"
    )
    sources: list[str] = _sources()
    prefix_hit_rate_from: str | None = _hit_rate_from()
    unavailable: dict[str, str] = _unavailable()


class FamilyStats(BaseModel):
    run_id: str
    family: str | None
    requests: int | None
    prompt_tokens: int | None
    prefix_hit_tokens: int | None
    prefix_hit_rate: float | None
    evicted_blocks: int
    shared_anchor_evictions: int
    shared_anchor_eviction_ratio: float
    protected_evictions: int
    rebuilt_blocks: int
    wasted_prefill_tokens: int
    mean_time_to_rebuild_s: float | None
    regretful_evictions: int | None
    sources: list[str] = _sources()
    prefix_hit_rate_from: str | None = _hit_rate_from()
    unavailable: dict[str, str] = _unavailable()


class DepthStats(BaseModel):
    depth: int | None
    evicted_blocks: int
    shared_anchor_evictions: int
    rebuilt_blocks: int


class FamilyDetail(FamilyStats):
    by_depth: list[DepthStats]


class EventRow(BaseModel):
    """One stored event; ``row_key`` is the storage order tie-breaker used by cursors."""

    row_key: int
    ts_ns: int
    run_id: str | None
    engine: str | None
    seq: int
    step: int | None
    request_id: str | None
    block_id: int | None
    block_hash: int | None
    parent_hash: int | None
    family: str | None
    depth: int | None
    ref_count: int | None
    hit_count: int | None
    share_degree: int | None
    branch_factor: int | None
    retain_score: float | None
    protected: bool | None
    policy: str | None
    age_ns: int | None
    reason: str | None = Field(None, description="block_evicted: pressure, connector or reset (docs/design.md §4)")
    host: str | None = Field(None, description="host of the emitting engine (null: rows older than schema 3)")
    dp_rank: int | None = Field(None, description="vLLM data-parallel rank of the emitting engine")
    tenant: str | None = Field(None, description="cache_salt of the request (of the one that sealed the block)")
    lora: str | None = Field(None, description="LoRA adapter of the request (of the one that sealed the block)")


class EvictionPage(BaseModel):
    items: list[EventRow]
    next_cursor: str | None = Field(description="pass as ?cursor= (same filters) for the next page; null at the end")


class BlockEvent(EventRow):
    event: str
    count: int | None


class BlockHistory(BaseModel):
    block_hash: int
    block_hash_hex: str
    events: list[BlockEvent]


class Comparison(BaseModel):
    a: RunSummary
    b: RunSummary
    delta: dict[str, float | None] = Field(description="b - a for every numeric summary field (null where a or b "
                                                   "cannot give it)")


class KvEventsHealth(BaseModel):
    """One ``--kv-events`` subscriber (kvfabric/kvevents/subscriber.py). Addresses only for authenticated callers."""

    engine: str
    state: str = Field(description="connected | disconnected (the publisher went away: ZMQ reconnects) | waiting "
                                   "(never reached yet) | failed (the subscriber thread died: see problem)")
    since_ns: int = Field(description="when the current state began")
    stream_id: str | None = Field(description="the stream of the publisher incarnation being stored")
    last_seq: int | None = Field(description="the last seq placed in that stream (stored or refused)")
    batches: int
    rows: int
    lost: int = Field(description="batches published and never stored, all reasons (each counted once)")
    lost_by_reason: dict[str, int] = Field(description="gap | replay_unavailable | joined_late")
    decode_errors: int
    replays: int
    reconnects: int
    restarts: int = Field(description="publisher restarts detected (each a new stream)")
    last_batch_ns: int | None
    lag_s: float | None = Field(description="receive time minus the last live batch's ts")
    problem: str | None = None
    endpoint: str | None = None
    replay: str | None = None


class EngineMetricsHealth(BaseModel):
    """One engine-metrics endpoint (kvfabric/kvevents/engine_metrics.py). The URL only for authenticated callers."""

    engine: str
    reads: int
    failures: int
    counter_resets: int
    last_ok_ns: int | None
    problem: str | None = None
    url: str | None = None


class Health(BaseModel):
    """``status`` "ok" (200) or "failing" (503). Paths and ``detail`` only for callers with the bearer token."""

    status: str
    storage: str | None = Field(default=None, description="ok, or failing while DuckDB refuses writes")
    db_path: str | None = None
    socket_path: str | None = None
    open_streams: int | None = None
    writer_queue_rows: int | None = None
    commits: int | None = None
    problem: str | None = None
    detail: str | None = Field(default=None, description="the underlying error (authenticated callers only)")
    kv_events: list[KvEventsHealth] | None = Field(default=None, description="one per --kv-events spec")
    engine_metrics: list[EngineMetricsHealth] | None = Field(default=None,
                                                            description="one per engine-metrics URL")


class EngineInfo(BaseModel):
    """One event stream this collector holds or held: an engine with KVFabric on (kvfabric/ingest/engines.py).

    Listed from the moment the hook's forwarder says who it is, when vLLM builds the scheduler: before any
    request. Kept in memory (a collector restart forgets ended streams; live hooks reconnect within seconds)."""

    engine: str = Field(description="KVFABRIC_ENGINE_ID, default <host>/dp<rank>")
    host: str | None = Field(description="the engine's host name (null: a hook older than this field)")
    pid: int | None = Field(description="the engine process's pid, as the hook declared it")
    run_id: str
    policy: str
    vllm_version: str | None
    kvfabric_version: str | None = Field(description="the hook's KVFabric version")
    block_size: int
    num_blocks: int
    state: str = Field(description="connected | idle (the collector closed the quiet connection; the engine's "
                                   "forwarder still runs and reconnects) | disconnected (the engine's side ended)")
    connected_since_ns: int = Field(description="when this stream first connected")
    last_seen_ns: int = Field(description="its last connection or batch")
    ended_ns: int | None = Field(description="when its last connection ended (null while connected)")
    ended_why: str | None
    events: int = Field(description="rows received so far (each batch once, resends after a reconnect not "
                                    "counted again; sink_dropped markers included)")
    batches: int
    connections: int = Field(description="connections the stream made (1 + reconnects)")
    stream_id: str
    protocol: int


class FleetCounts(BaseModel):
    """The fleet overview's numbers (docs/design.md §5 definitions, as in the run summary), over the time window."""

    runs: list[str] = Field(description="runs with events (or, without a window, streams) here")
    requests: int | None = Field(description="admissions (prefix_lookup rows)")
    prompt_tokens: int | None
    hit_tokens: int | None = Field(
        description="prompt tokens served from the prefix cache (run summary: prefix_hit_tokens)"
    )
    prefix_hit_rate: float | None = Field(description="hit_tokens / prompt_tokens")
    evicted_blocks: int
    shared_anchor_evictions: int = Field(description="evicted blocks with share_degree >= 2")
    shared_anchor_eviction_ratio: float = Field(description="shared_anchor_evictions / evicted_blocks")
    rebuilt_blocks: int = Field(description="rebuilt-from-eviction blocks (block_rebuilt rows)")
    wasted_prefill_tokens: int = Field(description="rebuilt blocks x the block size of their stream")
    events: int = Field(description="stored rows in the window")
    sink_dropped_events: int = Field(description="events the sinks reported lost (sink_dropped rows)")
    sequence_gaps: int = Field(description="batches lost between sink and collector (streams.gaps)")
    ingest_lag_s: float | None = Field(description="max over the streams of (last receipt - newest stored event) "
                                                   "in seconds; null without a stored event")
    first_ts_ns: int | None
    last_ts_ns: int | None
    sources: list[str] = _sources()
    unavailable: dict[str, str] = _unavailable()


class FleetEngine(FleetCounts):
    host: str = Field(description="the events' host column ('' for rows that carry none)")
    engine: str
    dp_rank: int | None
    prefix_hit_rate_from: str | None = _hit_rate_from()


class FleetTotals(FleetCounts):
    """The engines' counts summed, ratios recomputed from the sums, ingest_lag_s their maximum. A lookup number
    sums the engines that have one, and is null (in unavailable) when none has."""

    prefix_hit_rate_from: list[str] = Field(default_factory=list,
                                            description="where the engines' hit rates summed here come from")

    hosts: int
    engines: int


class FleetOverview(BaseModel):
    since_ns: int | None = Field(description="the window's inclusive start (null: unbounded)")
    until_ns: int | None = Field(description="the window's exclusive end (null: unbounded)")
    totals: FleetTotals
    engines: list[FleetEngine] = Field(description="one per (host, engine), ordered by host, engine")
