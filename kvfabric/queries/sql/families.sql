-- families($run, $family, $host, $tenant, $lora, $min_wasted_tokens, $limit): per (run, family) analytics, most
-- wasted prefill first. $run NULL means every run (slower: pass a run on large databases). $host, $tenant
-- (cache_salt), $lora: only the events of that host, tenant or LoRA adapter (NULL: any; rows of files older than
-- schema 3 have none, so a filter leaves them out).
-- A prefix_lookup row carries the family of its request; block rows carry the family of the request that sealed
-- the block (docs/design.md §5). Ratios are 0 when the denominator is 0; mean_time_to_rebuild_s is NULL without rebuilds.
-- sources: the distinct sources of the streams of the engines the family's rows come from (plugin, kv_events);
-- streams of source kv_events carry no share_degree: their shared anchors are those of part kv_shared_evictions.
-- One scan restricted to the three event types that matter, grouped by (run, family, engine) so the block size
-- join happens on the small grouped result.
WITH
-- @include kv_shared_evictions
kv_shared AS (
    SELECT run_id, family, engine, count(*) AS n
    FROM kv_shared_evictions
    WHERE ($family IS NULL OR family = $family)
      AND ($host IS NULL OR host = $host)
      AND ($tenant IS NULL OR tenant = $tenant)
      AND ($lora IS NULL OR lora = $lora)
    GROUP BY run_id, family, engine
),
g AS (
    SELECT
        run_id,
        family,
        engine,
        count(*) FILTER (WHERE event = 'prefix_lookup') AS requests,
        sum(prompt_tokens) FILTER (WHERE event = 'prefix_lookup') AS prompt_tokens,
        sum(hit_tokens) FILTER (WHERE event = 'prefix_lookup') AS hit_tokens,
        sum("count") FILTER (WHERE event = 'prefix_lookup') AS regretful,
        count(*) FILTER (WHERE event = 'block_evicted') AS evicted,
        count(*) FILTER (WHERE event = 'block_evicted' AND share_degree >= 2) AS shared_anchor,
        count(*) FILTER (WHERE event = 'block_evicted' AND protected) AS protected,
        count(*) FILTER (WHERE event = 'block_rebuilt') AS rebuilt,
        sum(age_ns) FILTER (WHERE event = 'block_rebuilt') AS age_sum,
        count(age_ns) FILTER (WHERE event = 'block_rebuilt') AS age_n
    FROM events
    WHERE event IN ('prefix_lookup', 'block_evicted', 'block_rebuilt')
      AND ($run IS NULL OR run_id = $run)
      AND ($family IS NULL OR family = $family)
      AND ($host IS NULL OR host = $host)
      AND ($tenant IS NULL OR tenant = $tenant)
      AND ($lora IS NULL OR lora = $lora)
    GROUP BY run_id, family, engine
),
engine_bs AS (
    SELECT run_id, engine, max(block_size) AS block_size, list(DISTINCT coalesce(source, 'plugin')) AS sources
    FROM streams
    GROUP BY run_id, engine
),
run_bs AS (
    SELECT run_id, max(block_size) AS block_size FROM streams GROUP BY run_id
),
f AS (
    SELECT
        g.run_id,
        g.family,
        sum(requests)::BIGINT AS requests,
        coalesce(sum(prompt_tokens), 0)::BIGINT AS prompt_tokens,
        coalesce(sum(hit_tokens), 0)::BIGINT AS prefix_hit_tokens,
        sum(evicted)::BIGINT AS evicted_blocks,
        sum(shared_anchor + coalesce(kv_shared.n, 0))::BIGINT AS shared_anchor_evictions,
        sum(protected)::BIGINT AS protected_evictions,
        sum(rebuilt)::BIGINT AS rebuilt_blocks,
        sum(rebuilt * coalesce(engine_bs.block_size, run_bs.block_size, 0))::BIGINT AS wasted_prefill_tokens,
        sum(age_sum) / nullif(sum(age_n), 0) / 1e9 AS mean_time_to_rebuild_s,
        coalesce(sum(regretful), 0)::BIGINT AS regretful_evictions,
        list_sort(list_distinct(flatten(list(coalesce(engine_bs.sources, []))))) AS sources
    FROM g
    LEFT JOIN engine_bs ON engine_bs.run_id = g.run_id AND engine_bs.engine = g.engine
    LEFT JOIN run_bs ON run_bs.run_id = g.run_id
    LEFT JOIN kv_shared
        ON kv_shared.run_id = g.run_id AND kv_shared.family IS NOT DISTINCT FROM g.family
        AND kv_shared.engine = g.engine
    GROUP BY g.run_id, g.family
)
SELECT
    run_id,
    family,
    requests,
    prompt_tokens,
    prefix_hit_tokens,
    coalesce(prefix_hit_tokens / nullif(prompt_tokens, 0), 0)::DOUBLE AS prefix_hit_rate,
    evicted_blocks,
    shared_anchor_evictions,
    coalesce(shared_anchor_evictions / nullif(evicted_blocks, 0), 0)::DOUBLE AS shared_anchor_eviction_ratio,
    protected_evictions,
    rebuilt_blocks,
    wasted_prefill_tokens,
    mean_time_to_rebuild_s,
    regretful_evictions,
    sources
FROM f
WHERE wasted_prefill_tokens >= $min_wasted_tokens
ORDER BY wasted_prefill_tokens DESC, evicted_blocks DESC, run_id, family NULLS LAST
LIMIT $limit
