-- fleet($since_ns, $until_ns, $run): the fleet overview, one row per (host, engine), ordered by host, engine
-- (QueryRunner.fleet adds their totals). $run NULL: every run; time range on ts_ns, since_ns inclusive, until_ns
-- exclusive (NULL: unbounded).
--   host                          the events' host column; rows without one (files older than schema 3) take the
--                                 host their stream declared, else ''
--   requests, prompt_tokens, hit_tokens
--                                 prefix_lookup rows, sums of prompt_tokens and hit_tokens (run_summary's
--                                 requests, prompt_tokens, prefix_hit_tokens)
--   evicted_blocks, shared_anchor_evictions
--                                 block_evicted rows, those with share_degree >= 2
--   rebuilt_blocks                block_rebuilt rows (run_summary's rebuilt_from_eviction_blocks)
--   wasted_prefill_tokens         rebuilt blocks x block size of the stream of the same (run, engine)
--   events                        every row in the window; sink_dropped_events: sum("count") of sink_dropped rows
--   sequence_gaps                 batches lost between sink and collector (streams.gaps) of the engine's streams
--                                 that have events in the window (all its streams without a window)
--   ingest_lag_s                  max over those streams of (last_seen_ns - last_ts_ns) / 1e9: how far the newest
--                                 stored event lies behind the collector's last receipt of that stream
--   dp_rank                       the data-parallel rank the engine's latest stream declared, else its events'
--   sources                       the distinct sources of the engine's streams (plugin, kv_events)
--   counter_rows, counter_prompt_tokens, counter_hit_tokens
--                                 prefix_cache_counters rows in the window and their sums (vLLM's own counters) of
--                                 the engines without lookups; kvfabric.queries.availability uses them there
-- Streams of source kv_events carry no share_degree: their shared anchors are those of part kv_shared_evictions.
-- Ratios are 0, never NULL, when their denominator is 0.
-- One scan of the events in the window grouped by (run, host, engine); everything else works on small results.
WITH
-- @include kv_shared_evictions
kv_shared AS (
    SELECT run_id, host, engine, count(*) AS n
    FROM kv_shared_evictions
    WHERE ($since_ns IS NULL OR ts_ns >= $since_ns) AND ($until_ns IS NULL OR ts_ns < $until_ns)
    GROUP BY run_id, host, engine
),
counters AS (
    -- read only for the engines that have no lookups (kv_engines): the only ones whose hit rate they give
    SELECT e.run_id, e.host, e.engine, count(*) AS n, sum(e.prompt_tokens) AS prompt_tokens,
           sum(e.hit_tokens) AS hit_tokens
    FROM events AS e
    JOIN kv_engines AS k ON k.run_id = e.run_id AND k.engine = e.engine
    WHERE e.event = 'prefix_cache_counters'
      AND ($run IS NULL OR e.run_id = $run)
      AND ($since_ns IS NULL OR e.ts_ns >= $since_ns)
      AND ($until_ns IS NULL OR e.ts_ns < $until_ns)
    GROUP BY e.run_id, e.host, e.engine
),
g AS (
    SELECT
        run_id,
        host,
        engine,
        count(*) AS events,
        count(*) FILTER (WHERE event = 'prefix_lookup') AS requests,
        sum(prompt_tokens) FILTER (WHERE event = 'prefix_lookup') AS prompt_tokens,
        sum(hit_tokens) FILTER (WHERE event = 'prefix_lookup') AS hit_tokens,
        count(*) FILTER (WHERE event = 'block_evicted') AS evicted,
        count(*) FILTER (WHERE event = 'block_evicted' AND share_degree >= 2) AS shared_anchor,
        count(*) FILTER (WHERE event = 'block_rebuilt') AS rebuilt,
        sum("count") FILTER (WHERE event = 'sink_dropped') AS sink_dropped,
        max(dp_rank) AS dp_rank,
        min(ts_ns) AS first_ts_ns,
        max(ts_ns) AS last_ts_ns
    FROM events
    WHERE ($run IS NULL OR run_id = $run)
      AND ($since_ns IS NULL OR ts_ns >= $since_ns)
      AND ($until_ns IS NULL OR ts_ns < $until_ns)
    GROUP BY run_id, host, engine
),
st AS (
    SELECT * FROM streams WHERE ($run IS NULL OR run_id = $run)
),
engine_bs AS (
    SELECT
        run_id, engine, max(block_size) AS block_size, max(host) AS host,
        list(DISTINCT coalesce(source, 'plugin')) AS sources
    FROM st
    GROUP BY run_id, engine
),
run_bs AS (
    SELECT run_id, max(block_size) AS block_size FROM st GROUP BY run_id
),
ev AS (
    SELECT
        coalesce(g.host, engine_bs.host, '') AS host,
        g.engine,
        list(DISTINCT g.run_id) AS runs,
        max(g.dp_rank) AS dp_rank,
        sum(g.events) AS events,
        sum(g.requests) AS requests,
        sum(g.prompt_tokens) AS prompt_tokens,
        sum(g.hit_tokens) AS hit_tokens,
        sum(g.evicted) AS evicted_blocks,
        sum(g.shared_anchor + coalesce(kv_shared.n, 0)) AS shared_anchor_evictions,
        sum(g.rebuilt) AS rebuilt_blocks,
        sum(g.rebuilt * coalesce(engine_bs.block_size, run_bs.block_size, 0)) AS wasted_prefill_tokens,
        sum(g.sink_dropped) AS sink_dropped_events,
        sum(counters.n) AS counter_rows,
        sum(counters.prompt_tokens) AS counter_prompt_tokens,
        sum(counters.hit_tokens) AS counter_hit_tokens,
        list_distinct(flatten(list(coalesce(engine_bs.sources, [])))) AS sources,
        min(g.first_ts_ns) AS first_ts_ns,
        max(g.last_ts_ns) AS last_ts_ns
    FROM g
    LEFT JOIN engine_bs ON engine_bs.run_id = g.run_id AND engine_bs.engine = g.engine
    LEFT JOIN run_bs ON run_bs.run_id = g.run_id
    LEFT JOIN kv_shared
        ON kv_shared.run_id = g.run_id AND kv_shared.host IS NOT DISTINCT FROM g.host AND kv_shared.engine = g.engine
    LEFT JOIN counters
        ON counters.run_id = g.run_id AND counters.host IS NOT DISTINCT FROM g.host AND counters.engine = g.engine
    GROUP BY 1, 2
),
sv AS (
    SELECT
        coalesce(host, '') AS host,
        engine,
        list(DISTINCT run_id) AS runs,
        arg_max(dp_rank, first_seen_ns) AS dp_rank,
        sum(gaps) AS sequence_gaps,
        max(last_seen_ns - last_ts_ns) / 1e9 AS ingest_lag_s,
        list(DISTINCT coalesce(source, 'plugin')) AS sources
    FROM st
    WHERE ($since_ns IS NULL OR last_ts_ns >= $since_ns)
      AND ($until_ns IS NULL OR first_ts_ns < $until_ns)
    GROUP BY 1, 2
),
e AS (
    SELECT
        coalesce(ev.host, sv.host) AS host,
        coalesce(ev.engine, sv.engine) AS engine,
        coalesce(sv.dp_rank, ev.dp_rank) AS dp_rank,
        list_sort(list_distinct(list_concat(coalesce(ev.runs, []), coalesce(sv.runs, [])))) AS runs,
        coalesce(ev.requests, 0)::BIGINT AS requests,
        coalesce(ev.prompt_tokens, 0)::BIGINT AS prompt_tokens,
        coalesce(ev.hit_tokens, 0)::BIGINT AS hit_tokens,
        coalesce(ev.evicted_blocks, 0)::BIGINT AS evicted_blocks,
        coalesce(ev.shared_anchor_evictions, 0)::BIGINT AS shared_anchor_evictions,
        coalesce(ev.rebuilt_blocks, 0)::BIGINT AS rebuilt_blocks,
        coalesce(ev.wasted_prefill_tokens, 0)::BIGINT AS wasted_prefill_tokens,
        coalesce(ev.events, 0)::BIGINT AS events,
        coalesce(ev.sink_dropped_events, 0)::BIGINT AS sink_dropped_events,
        coalesce(sv.sequence_gaps, 0)::BIGINT AS sequence_gaps,
        sv.ingest_lag_s::DOUBLE AS ingest_lag_s,
        ev.first_ts_ns,
        ev.last_ts_ns,
        list_sort(list_distinct(list_concat(coalesce(ev.sources, []), coalesce(sv.sources, [])))) AS sources,
        coalesce(ev.counter_rows, 0)::BIGINT AS counter_rows,
        coalesce(ev.counter_prompt_tokens, 0)::BIGINT AS counter_prompt_tokens,
        coalesce(ev.counter_hit_tokens, 0)::BIGINT AS counter_hit_tokens
    FROM ev
    FULL OUTER JOIN sv ON sv.host = ev.host AND sv.engine = ev.engine
)
SELECT
    host,
    engine,
    dp_rank,
    runs,
    requests,
    prompt_tokens,
    hit_tokens,
    coalesce(hit_tokens / nullif(prompt_tokens, 0), 0)::DOUBLE AS prefix_hit_rate,
    evicted_blocks,
    shared_anchor_evictions,
    coalesce(shared_anchor_evictions / nullif(evicted_blocks, 0), 0)::DOUBLE AS shared_anchor_eviction_ratio,
    rebuilt_blocks,
    wasted_prefill_tokens,
    events,
    sink_dropped_events,
    sequence_gaps,
    ingest_lag_s,
    first_ts_ns,
    last_ts_ns,
    sources,
    counter_rows,
    counter_prompt_tokens,
    counter_hit_tokens
FROM e
ORDER BY host, engine
