"""Response models of the miss-attribution, request-story and what-if endpoints (docs/design.md §5, §7).

Token splits: ``hit_tokens + evicted_tokens + novel_tokens + uncacheable_tokens == prompt_tokens`` in every split
(admission, family, window, run). ``hit_tokens`` counts prompt tokens only: a request resumed after a preemption
can hit its own earlier output too, which ``hit_tokens_past_prompt`` reports.

All three need lookups, which vLLM's KV events (source ``kv_events``) do not carry: for a run of that source alone
the answer has no split (null, empty lists) and ``unavailable`` says why (kvfabric/queries/availability.py).
"""

from __future__ import annotations

from pydantic import BaseModel, Field


class MissSplit(BaseModel):
    admissions: int = Field(description="prefix_lookup rows (admissions) counted")
    prompt_tokens: int
    hit_tokens: int = Field(description="prompt tokens served from the prefix cache")
    evicted_tokens: int = Field(description="prompt tokens in blocks this engine had cached before and lost")
    novel_tokens: int = Field(description="prompt tokens in blocks this engine had never cached")
    uncacheable_tokens: int = Field(
        description="the block holding the last prompt token, blocks the admission gate refused or never computed"
    )
    hit_tokens_past_prompt: int = Field(description="hits of resumed requests beyond their prompt (not in the split)")


class FamilyMisses(MissSplit):
    family: str | None


class WindowMisses(MissSplit):
    window_start_ns: int = Field(description="start of the window (run's first event + k * bucket_s)")


def _unavailable() -> object:
    return Field(None, description="why this run has no answer here (its events carry no lookups); null when it has")


class RunMisses(BaseModel):
    run_id: str
    bucket_s: float
    totals: MissSplit | None = Field(description="null when unavailable")
    items: list[FamilyMisses] = Field(description="one per family, most evicted tokens first")
    windows: list[WindowMisses] = Field(description="admissions by lookup time, windows without any omitted")
    evictions_by_reason: dict[str, int] = Field(description="block_evicted rows by reason: pressure, connector, "
                                                            "reset, unknown")
    unavailable: str | None = _unavailable()


class TokenSplit(BaseModel):
    hit_tokens: int
    evicted_tokens: int
    novel_tokens: int
    uncacheable_tokens: int


class StoryBlock(BaseModel):
    """One prompt block of one admission: what the lookup found there and, if it was computed, why."""

    depth: int = Field(description="position in the request's chain (0 = first block)")
    tokens: int = Field(description="prompt tokens in this block (the block size, or fewer for the last one)")
    kind: str = Field(description="hit, evicted, novel or uncacheable")
    cause: str | None = Field(description="evicted: evicted | ancestor_evicted; uncacheable: last_token | "
                                          "partial_block | admission_gate | not_computed")
    block_hash: int | None
    block_hash_hex: str | None
    block_id: int | None
    sealed_ns: int | None = Field(description="when this admission computed and cached it (evicted, novel)")
    rebuilt: bool = Field(description="the hook reported it rebuilt (block_rebuilt)")
    rebuilt_age_ns: int | None = Field(description="from its eviction to its rebuild, per the hook")
    first_cached_ns: int | None = Field(description="when the engine first cached this block (before the lookup)")
    last_evicted_ns: int | None = Field(
        description="its last eviction before the lookup, if no seal came after it (any block this admission sealed)"
    )
    evicted_reason: str | None = Field(description="why: pressure, connector, reset (null: not recorded)")
    evicted_by_request: str | None = Field(description="the request whose allocation evicted it (pressure)")
    evicted_idle_ns: int | None = Field(description="how long it had been unused when evicted")
    evicted_share_degree: int | None
    evicted_hit_count: int | None


class StoryAdmission(BaseModel):
    run_id: str
    engine: str
    admission: int = Field(description="0 for the first admission; more after preemptions")
    family: str | None
    lookup_ns: int
    lookup_step: int | None
    prompt_tokens: int
    lookup_hit_tokens: int = Field(description="prefix_lookup.hit_tokens as recorded")
    lookup_depth: int | None
    regretful_evictions: int | None
    block_size: int
    split: TokenSplit
    blocks: list[StoryBlock]


class RequestStory(BaseModel):
    request_id: str
    runs: list[str]
    admissions: list[StoryAdmission]
    unavailable: str | None = _unavailable()


class WhatIfEngine(BaseModel):
    engine: str
    admissions: int
    block_size: int
    own_policy: str
    own_num_blocks: int
    num_blocks: int
    mean_in_flight: float
    concurrency: int
    whatif_prefix_hit_rate: float
    optimal_prefix_hit_rate: float
    own_prefix_hit_rate: float


class WhatIf(BaseModel):
    """The replays and what the run had; every number null (and ``unavailable`` set) for a run whose events carry
    no lookups, since there is no traffic to replay."""

    run_id: str
    policy: str | None
    num_blocks: int | None
    admissions: int
    prompt_tokens: int | None
    engines: list[WhatIfEngine]
    actual_policy: str | None
    actual_prefix_hit_rate: float | None
    actual_wasted_prefill_tokens: int
    actual_evicted_blocks: int
    whatif_prefix_hit_rate: float | None
    whatif_wasted_prefill_tokens: int | None
    whatif_evicted_blocks: int | None
    optimal_prefix_hit_rate: float | None
    optimal_wasted_prefill_tokens: int | None
    replay_own_prefix_hit_rate: float | None = Field(description="the replay under the run's own policy and capacity")
    replay_own_wasted_prefill_tokens: int | None
    replay_own_error: float | None = Field(description="replay_own_prefix_hit_rate - actual_prefix_hit_rate")
    predicted_change: float | None = Field(description="whatif_prefix_hit_rate - replay_own_prefix_hit_rate")
    tolerance: float = Field(description="stated bound on |replay_own_error|")
    within_tolerance: bool | None
    unavailable: str | None = _unavailable()


class Lifetimes(BaseModel):
    """Seconds from a block's seal (its latest before the eviction, same engine and hash) to its eviction."""

    evicted_blocks: int = Field(description="evictions paired with their seal")
    without_seal: int = Field(description="evictions whose seal the run does not hold (sealed before recording)")
    mean_s: float | None
    p50_s: float | None
    p90_s: float | None
    max_s: float | None


class FamilyLifetimes(Lifetimes):
    family: str | None


class RunLifetimes(BaseModel):
    run_id: str
    totals: Lifetimes
    items: list[FamilyLifetimes] = Field(description="one per family, most evicted first")
