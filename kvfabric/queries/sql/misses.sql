-- misses($run, $host, $tenant, $lora, $bucket_ns, $with_admissions): every admission's prompt tokens split into hit /
-- evicted / novel / uncacheable (docs/design.md §5, miss attribution), exactly, over the whole stored history of the
-- run; returned per run (level 'run'), per family ('family'), per time window of $bucket_ns from the run's first event
-- ('window'), and per admission ('admission', only when $with_admissions). $host, $tenant, $lora (NULL: any) keep
-- the admissions (prefix_lookup rows) of that host, tenant or LoRA adapter; the engine's history they are judged
-- against (which hashes it had cached) stays whole.
--
-- Per admission (one prefix_lookup row L of request r on engine e, prompt P, hit H, block size bs):
--   hit          = least(H, P)
--   C            = (P - 1) // bs: the full blocks vLLM could ever serve (it always computes the last prompt token)
--   a block of r at position m, ceil(hit / bs) <= m < C, sealed by this admission with hash h, is
--     evicted     when the engine had sealed h before L (another request, or r before a preemption): it was cached
--                 and lost (the block itself or an ancestor was evicted);
--     novel       otherwise: the engine had never cached h before L;
--   uncacheable  = P - hit - evicted - novel: the block holding the last prompt token (partial or full), blocks
--                 the admission gate refused or r never computed (aborted or preempted first).
-- So hit + evicted + novel + uncacheable = P for every admission, by construction.
--
-- "Sealed before L": the first block_sealed of (e, h) in (ts_ns, rowid) order precedes L and is not one of r's own
-- seals of this admission (those are emitted inside the same allocate_slots call, just before L). A seal belongs to
-- the admission of r whose lookup follows it in the same step, else to r's latest earlier lookup.
WITH bs AS (
    SELECT engine, max(block_size) AS bs FROM streams WHERE run_id = $run GROUP BY engine
),
run_start AS (
    SELECT coalesce(min(first_ts_ns), 0) AS t0, max(block_size) AS run_bs FROM streams WHERE run_id = $run
),
req AS (
    SELECT rowid AS row_key, run_id, engine, request_id, ts_ns, step, event, block_hash, depth
    FROM events
    WHERE run_id = $run AND event IN ('prefix_lookup', 'block_sealed') AND request_id IS NOT NULL
),
-- @include lookup_tagged
own_seals AS (
    SELECT
        CASE WHEN next_lookup_step = step THEN next_lookup ELSE prev_lookup END AS lookup_key,
        engine,
        block_hash,
        depth
    FROM tagged
    WHERE event = 'block_sealed' AND block_hash IS NOT NULL AND depth IS NOT NULL
),
first_seal AS (
    SELECT
        engine,
        block_hash,
        arg_min(struct_pack(ts := ts_ns, k := rowid, request_id := request_id, step := step), (ts_ns, rowid)) AS f
    FROM events
    WHERE run_id = $run AND event = 'block_sealed' AND block_hash IS NOT NULL
    GROUP BY engine, block_hash
),
lookups AS (
    SELECT
        e.rowid AS lookup_key,
        e.engine,
        e.request_id,
        e.family,
        e.ts_ns,
        e.step,
        coalesce(e.prompt_tokens, 0) AS prompt_tokens,
        least(coalesce(e.hit_tokens, 0), coalesce(e.prompt_tokens, 0)) AS hit_tokens,
        greatest(coalesce(e.hit_tokens, 0) - coalesce(e.prompt_tokens, 0), 0) AS hit_tokens_past_prompt,
        coalesce(bs.bs, run_start.run_bs) AS bs
    FROM events AS e
    LEFT JOIN bs USING (engine)
    CROSS JOIN run_start
    WHERE e.run_id = $run AND e.event = 'prefix_lookup'
      AND ($host IS NULL OR e.host = $host)
      AND ($tenant IS NULL OR e.tenant = $tenant)
      AND ($lora IS NULL OR e.lora = $lora)
),
classified AS (
    SELECT
        l.lookup_key,
        count(DISTINCT s.depth) FILTER (WHERE x.before_lookup) AS evicted_blocks,
        count(DISTINCT s.depth) FILTER (WHERE NOT x.before_lookup) AS novel_blocks
    FROM lookups AS l
    JOIN own_seals AS s ON s.lookup_key = l.lookup_key
    JOIN first_seal AS f ON f.engine = s.engine AND f.block_hash = s.block_hash
    CROSS JOIN LATERAL (
        SELECT
            (f.f.ts < l.ts_ns OR (f.f.ts = l.ts_ns AND f.f.k < l.lookup_key))
            AND NOT (f.f.request_id IS NOT DISTINCT FROM l.request_id AND f.f.step IS NOT DISTINCT FROM l.step)
            AS before_lookup
    ) AS x
    WHERE s.depth * l.bs >= l.hit_tokens AND s.depth < (l.prompt_tokens - 1) // l.bs
    GROUP BY l.lookup_key
),
split AS (
    SELECT
        l.*,
        coalesce(c.evicted_blocks, 0) * l.bs AS evicted_tokens,
        coalesce(c.novel_blocks, 0) * l.bs AS novel_tokens,
        (l.ts_ns - run_start.t0) // $bucket_ns AS bucket
    FROM lookups AS l
    LEFT JOIN classified AS c USING (lookup_key)
    CROSS JOIN run_start
),
grouped AS (
    SELECT
        CASE
            WHEN grouping(lookup_key) = 0 THEN 'admission'
            WHEN grouping(family) = 0 THEN 'family'
            WHEN grouping(bucket) = 0 THEN 'window'
            ELSE 'run'
        END AS level,
        family,
        bucket,
        lookup_key,
        any_value(request_id) AS request_id,
        any_value(engine) AS engine,
        min(ts_ns) AS ts_ns,
        count(*)::BIGINT AS admissions,
        sum(prompt_tokens)::BIGINT AS prompt_tokens,
        sum(hit_tokens)::BIGINT AS hit_tokens,
        sum(evicted_tokens)::BIGINT AS evicted_tokens,
        sum(novel_tokens)::BIGINT AS novel_tokens,
        sum(prompt_tokens - hit_tokens - evicted_tokens - novel_tokens)::BIGINT AS uncacheable_tokens,
        sum(hit_tokens_past_prompt)::BIGINT AS hit_tokens_past_prompt
    FROM split
    GROUP BY GROUPING SETS ((), (family), (bucket), (lookup_key, family))
)
SELECT
    g.level,
    g.family,
    CASE WHEN g.level = 'window' THEN run_start.t0 + g.bucket * $bucket_ns END AS window_start_ns,
    CASE WHEN g.level = 'admission' THEN g.request_id END AS request_id,
    CASE WHEN g.level = 'admission' THEN g.engine END AS engine,
    CASE WHEN g.level = 'admission' THEN g.ts_ns END AS ts_ns,
    g.admissions,
    coalesce(g.prompt_tokens, 0)::BIGINT AS prompt_tokens,
    coalesce(g.hit_tokens, 0)::BIGINT AS hit_tokens,
    coalesce(g.evicted_tokens, 0)::BIGINT AS evicted_tokens,
    coalesce(g.novel_tokens, 0)::BIGINT AS novel_tokens,
    coalesce(g.uncacheable_tokens, 0)::BIGINT AS uncacheable_tokens,
    coalesce(g.hit_tokens_past_prompt, 0)::BIGINT AS hit_tokens_past_prompt
FROM grouped AS g
CROSS JOIN run_start
WHERE g.level <> 'admission' OR $with_admissions
ORDER BY
    CASE g.level WHEN 'run' THEN 0 WHEN 'family' THEN 1 WHEN 'window' THEN 2 ELSE 3 END,
    CASE WHEN g.level = 'family' THEN -(coalesce(g.evicted_tokens, 0)) END,
    g.family NULLS LAST,
    g.bucket,
    g.ts_ns,
    g.lookup_key
