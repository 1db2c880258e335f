-- run_summary($run, $host, $tenant, $lora): the analytics contract of docs/design.md §5 for one run, one row; with
-- $host, $tenant (cache_salt) or $lora set, of that run's events of that host, tenant or LoRA adapter only (the
-- stream columns: block_size, engines, policies, sequence_gaps, first/last_ts_ns, of the host's streams).
--   prompt_tokens, prefix_hit_tokens   sums over prefix_lookup rows
--   evicted_blocks                     count of block_evicted
--   shared_anchor_eviction_ratio       block_evicted with share_degree >= 2 / evicted
--   protected_eviction_ratio           block_evicted with protected / evicted
--   rebuilt_from_eviction_blocks       count of block_rebuilt
--   regretful_evictions                sum("count") over prefix_lookup rows
--   wasted_prefill_tokens              rebuilt blocks x block size of the stream of the same (run, engine)
--   sources                            the distinct sources of the streams (plugin, kv_events)
--   counter_rows, counter_prompt_tokens, counter_hit_tokens
--                                      prefix_cache_counters rows (vLLM's own prefix-cache counters, scraped), and
--                                      their sums; kvfabric.queries.availability uses them where there are no
--                                      lookups and drops them from the answer
-- Streams of source kv_events carry no share_degree: their shared anchors are those of part kv_shared_evictions.
-- Every ratio is 0, never NULL, when its denominator is 0. mean_time_to_rebuild_s is NULL without rebuilds.
-- One scan of the run's rows grouped by (engine, event); everything else works on that small result.
WITH
-- @include kv_shared_evictions
g AS (
    SELECT
        engine,
        event,
        count(*) AS n,
        sum(prompt_tokens) AS prompt_tokens,
        sum(hit_tokens) AS hit_tokens,
        sum("count") AS count_sum,
        count(*) FILTER (WHERE share_degree >= 2) AS shared_anchor,
        count(*) FILTER (WHERE protected) AS protected,
        sum(age_ns) AS age_sum,
        count(age_ns) AS age_n
    FROM events
    WHERE run_id = $run
      AND ($host IS NULL OR host = $host)
      AND ($tenant IS NULL OR tenant = $tenant)
      AND ($lora IS NULL OR lora = $lora)
    GROUP BY engine, event
),
kv_shared AS (
    SELECT engine, count(*) AS n
    FROM kv_shared_evictions
    WHERE ($host IS NULL OR host = $host)
      AND ($tenant IS NULL OR tenant = $tenant)
      AND ($lora IS NULL OR lora = $lora)
    GROUP BY engine
),
engine_bs AS (
    SELECT engine, max(block_size) AS block_size FROM streams WHERE run_id = $run GROUP BY engine
),
run_streams AS (
    SELECT
        max(block_size) AS block_size,
        coalesce(sum(gaps), 0)::BIGINT AS sequence_gaps,
        coalesce(list(DISTINCT engine ORDER BY engine) FILTER (WHERE engine IS NOT NULL), []) AS engines,
        coalesce(list(DISTINCT policy ORDER BY policy) FILTER (WHERE policy IS NOT NULL), []) AS policies,
        coalesce(list(DISTINCT coalesce(source, 'plugin') ORDER BY coalesce(source, 'plugin')), []) AS sources,
        min(first_ts_ns) AS first_ts_ns,
        max(last_ts_ns) AS last_ts_ns
    FROM streams
    WHERE run_id = $run AND ($host IS NULL OR host = $host)
),
t AS (
    SELECT g.*, coalesce(engine_bs.block_size, (SELECT block_size FROM run_streams), 0) AS block_size
    FROM g LEFT JOIN engine_bs USING (engine)
),
s AS (
    SELECT
        coalesce(sum(n), 0)::BIGINT AS events,
        coalesce(sum(n) FILTER (WHERE event = 'prefix_lookup'), 0)::BIGINT AS requests,
        coalesce(sum(prompt_tokens) FILTER (WHERE event = 'prefix_lookup'), 0)::BIGINT AS prompt_tokens,
        coalesce(sum(hit_tokens) FILTER (WHERE event = 'prefix_lookup'), 0)::BIGINT AS prefix_hit_tokens,
        coalesce(sum(count_sum) FILTER (WHERE event = 'prefix_lookup'), 0)::BIGINT AS regretful_evictions,
        coalesce(sum(n) FILTER (WHERE event = 'block_evicted'), 0)::BIGINT AS evicted_blocks,
        (coalesce(sum(shared_anchor) FILTER (WHERE event = 'block_evicted'), 0)
            + (SELECT coalesce(sum(n), 0) FROM kv_shared))::BIGINT AS shared_anchor_evictions,
        coalesce(sum(protected) FILTER (WHERE event = 'block_evicted'), 0)::BIGINT AS protected_evictions,
        coalesce(sum(n) FILTER (WHERE event = 'block_rebuilt'), 0)::BIGINT AS rebuilt_from_eviction_blocks,
        coalesce(sum(n * block_size) FILTER (WHERE event = 'block_rebuilt'), 0)::BIGINT AS wasted_prefill_tokens,
        sum(age_sum) FILTER (WHERE event = 'block_rebuilt')
            / nullif(sum(age_n) FILTER (WHERE event = 'block_rebuilt'), 0) / 1e9 AS mean_time_to_rebuild_s,
        coalesce(sum(count_sum) FILTER (WHERE event = 'cache_admission_limited'), 0)::BIGINT
            AS admission_limited_blocks,
        coalesce(sum(count_sum) FILTER (WHERE event = 'sink_dropped'), 0)::BIGINT AS sink_dropped_events,
        coalesce(sum(n) FILTER (WHERE event = 'prefix_cache_counters'), 0)::BIGINT AS counter_rows,
        coalesce(sum(prompt_tokens) FILTER (WHERE event = 'prefix_cache_counters'), 0)::BIGINT
            AS counter_prompt_tokens,
        coalesce(sum(hit_tokens) FILTER (WHERE event = 'prefix_cache_counters'), 0)::BIGINT AS counter_hit_tokens
    FROM t
),
by_type AS (
    SELECT event, sum(n)::BIGINT AS n FROM g GROUP BY event
)
SELECT
    $run AS run_id,
    s.prompt_tokens,
    s.prefix_hit_tokens,
    coalesce(s.prefix_hit_tokens / nullif(s.prompt_tokens, 0), 0)::DOUBLE AS prefix_hit_rate,
    s.evicted_blocks,
    coalesce(s.shared_anchor_evictions / nullif(s.evicted_blocks, 0), 0)::DOUBLE AS shared_anchor_eviction_ratio,
    coalesce(s.protected_evictions / nullif(s.evicted_blocks, 0), 0)::DOUBLE AS protected_eviction_ratio,
    s.rebuilt_from_eviction_blocks,
    s.regretful_evictions,
    s.wasted_prefill_tokens,
    s.requests,
    s.events,
    s.shared_anchor_evictions,
    s.protected_evictions,
    s.mean_time_to_rebuild_s,
    s.admission_limited_blocks,
    s.sink_dropped_events,
    coalesce(r.block_size, 0) AS block_size,
    r.engines,
    r.policies,
    r.sequence_gaps,
    r.sources,
    s.counter_rows,
    s.counter_prompt_tokens,
    s.counter_hit_tokens,
    r.first_ts_ns,
    r.last_ts_ns,
    (SELECT coalesce(map(list(event ORDER BY event), list(n ORDER BY event)), map()) FROM by_type)
        AS events_by_type
FROM s, run_streams AS r
