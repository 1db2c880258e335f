-- request_story($request, $run): one request's story, one row per (admission, prompt block position): what its
-- lookup found, which blocks hit, which it computed again and why they were not in the cache (docs/design.md §5).
-- $run NULL: every run that saw this request id.
--
-- Same rules as misses.sql, evaluated for this request's blocks only (the two are checked against each other):
--   kind 'hit'          position m with m * bs < least(H, P)
--   kind 'uncacheable'  m >= (P - 1) // bs (cause 'last_token', or 'partial_block' for a block shorter than bs),
--                       or a block past the hit this admission never sealed (cause 'admission_gate' when the
--                       admission has a cache_admission_limited row, else 'not_computed')
--   kind 'evicted'      sealed by this admission and sealed on the engine before the lookup by someone else (or by
--                       this request before a preemption); cause 'evicted' when the hash's last eviction before the
--                       lookup came after its last seal (given: time, reason, evicting request, idle time), else
--                       'ancestor_evicted' (the hash itself was cached, but the prefix walk stopped before it)
--   kind 'novel'        sealed by this admission, never cached by the engine before
-- tokens: bs, or what the prompt has left in its last block. Admissions are numbered in lookup order per engine.
WITH lk AS (
    SELECT
        rowid AS lookup_key,
        run_id,
        engine,
        family,
        ts_ns,
        step,
        coalesce(prompt_tokens, 0) AS prompt_tokens,
        coalesce(hit_tokens, 0) AS lookup_hit_tokens,
        least(coalesce(hit_tokens, 0), coalesce(prompt_tokens, 0)) AS hit_tokens,
        depth AS lookup_depth,
        "count" AS regretful_evictions,
        row_number() OVER (PARTITION BY run_id, engine ORDER BY ts_ns, rowid) - 1 AS admission
    FROM events
    WHERE request_id = $request AND event = 'prefix_lookup' AND ($run IS NULL OR run_id = $run)
),
bs AS (
    SELECT run_id, engine, max(block_size) AS bs FROM streams GROUP BY run_id, engine
),
req AS (
    SELECT rowid AS row_key, run_id, engine, request_id, ts_ns, step, event, block_id, block_hash, depth, age_ns
    FROM events
    WHERE request_id = $request AND ($run IS NULL OR run_id = $run)
      AND event IN ('prefix_lookup', 'block_sealed', 'block_touched', 'block_rebuilt', 'cache_admission_limited')
),
-- @include lookup_tagged
own AS (
    SELECT
        CASE WHEN next_lookup_step = step THEN next_lookup ELSE prev_lookup END AS lookup_key,
        event, block_id, block_hash, depth, ts_ns, age_ns
    FROM tagged
    WHERE event <> 'prefix_lookup'
),
limited AS (
    SELECT DISTINCT lookup_key FROM own WHERE event = 'cache_admission_limited'
),
positions AS (
    SELECT l.*, coalesce(b.bs, 16) AS bs, p.pos
    FROM lk AS l
    LEFT JOIN bs AS b ON b.run_id = l.run_id AND b.engine = l.engine
    CROSS JOIN LATERAL (
        SELECT unnest(range(0, (l.prompt_tokens + coalesce(b.bs, 16) - 1) // coalesce(b.bs, 16))) AS pos
    ) AS p
),
blocks AS (
    SELECT
        p.*,
        s.block_hash AS sealed_hash,
        s.block_id AS sealed_block_id,
        s.ts_ns AS sealed_ns,
        t.block_hash AS touched_hash,
        t.block_id AS touched_block_id,
        r.age_ns AS rebuilt_age_ns,
        (r.lookup_key IS NOT NULL) AS rebuilt,
        (lim.lookup_key IS NOT NULL) AS admission_limited
    FROM positions AS p
    LEFT JOIN own AS s ON s.lookup_key = p.lookup_key AND s.event = 'block_sealed' AND s.depth = p.pos
    LEFT JOIN own AS t ON t.lookup_key = p.lookup_key AND t.event = 'block_touched' AND t.depth = p.pos
    LEFT JOIN own AS r ON r.lookup_key = p.lookup_key AND r.event = 'block_rebuilt' AND r.depth = p.pos
    LEFT JOIN limited AS lim ON lim.lookup_key = p.lookup_key
),
wanted AS (
    SELECT DISTINCT run_id, engine, sealed_hash AS block_hash FROM blocks WHERE sealed_hash IS NOT NULL
),
hist AS (
    -- Every seal and eviction of those hashes on the same engine: their life before this request needed them.
    SELECT e.rowid AS row_key, e.run_id, e.engine, e.block_hash, e.event, e.ts_ns, e.step, e.request_id, e.reason,
           e.age_ns, e.share_degree, e.hit_count
    FROM events AS e
    JOIN wanted AS w ON w.run_id = e.run_id AND w.engine = e.engine AND w.block_hash = e.block_hash
    WHERE e.event IN ('block_sealed', 'block_evicted')
),
before AS (
    SELECT
        b.lookup_key,
        b.pos,
        min(h.ts_ns) FILTER (WHERE h.event = 'block_sealed'
                                   AND NOT (h.request_id IS NOT DISTINCT FROM $request AND h.step = b.step))
            AS first_cached_ns,
        arg_max(struct_pack(ts := h.ts_ns, k := h.row_key), (h.ts_ns, h.row_key))
            FILTER (WHERE h.event = 'block_sealed'
                          AND NOT (h.request_id IS NOT DISTINCT FROM $request AND h.step = b.step)) AS last_seal,
        arg_max(struct_pack(ts := h.ts_ns, k := h.row_key, reason := h.reason, by_request := h.request_id, idle_ns := h.age_ns,
                            share_degree := h.share_degree, hit_count := h.hit_count), (h.ts_ns, h.row_key))
            FILTER (WHERE h.event = 'block_evicted') AS last_eviction
    FROM blocks AS b
    JOIN hist AS h ON h.run_id = b.run_id AND h.engine = b.engine AND h.block_hash = b.sealed_hash
    WHERE h.ts_ns < b.ts_ns OR (h.ts_ns = b.ts_ns AND h.row_key < b.lookup_key)
    GROUP BY b.lookup_key, b.pos
),
classified AS (
    SELECT
        b.*,
        bf.first_cached_ns,
        -- The hash lost its content and was not cached again before the lookup (else an ancestor was missing).
        CASE WHEN bf.last_eviction.ts > bf.last_seal.ts
                  OR (bf.last_eviction.ts = bf.last_seal.ts AND bf.last_eviction.k > bf.last_seal.k)
             THEN bf.last_eviction END AS last_eviction,
        least(b.bs, b.prompt_tokens - b.pos * b.bs) AS tokens,
        CASE
            WHEN b.pos * b.bs < b.hit_tokens THEN 'hit'
            WHEN b.pos >= (b.prompt_tokens - 1) // b.bs THEN 'uncacheable'
            WHEN b.sealed_hash IS NULL THEN 'uncacheable'
            WHEN bf.first_cached_ns IS NOT NULL THEN 'evicted'
            ELSE 'novel'
        END AS kind
    FROM blocks AS b
    LEFT JOIN before AS bf ON bf.lookup_key = b.lookup_key AND bf.pos = b.pos
)
SELECT
    run_id,
    engine,
    admission,
    lookup_key,
    family,
    ts_ns AS lookup_ns,
    step AS lookup_step,
    prompt_tokens,
    lookup_hit_tokens,
    lookup_depth,
    regretful_evictions,
    bs AS block_size,
    pos AS depth,
    tokens,
    kind,
    CASE
        WHEN kind = 'uncacheable' AND pos >= (prompt_tokens - 1) // bs AND tokens < bs THEN 'partial_block'
        WHEN kind = 'uncacheable' AND pos >= (prompt_tokens - 1) // bs THEN 'last_token'
        WHEN kind = 'uncacheable' AND admission_limited THEN 'admission_gate'
        WHEN kind = 'uncacheable' THEN 'not_computed'
        WHEN kind = 'evicted' AND last_eviction IS NOT NULL THEN 'evicted'
        WHEN kind = 'evicted' THEN 'ancestor_evicted'
    END AS cause,
    coalesce(touched_hash, sealed_hash) AS block_hash,
    coalesce(touched_block_id, sealed_block_id) AS block_id,
    sealed_ns,
    rebuilt,
    rebuilt_age_ns,
    first_cached_ns,
    last_eviction.ts AS last_evicted_ns,
    last_eviction.reason AS evicted_reason,
    last_eviction.by_request AS evicted_by_request,
    last_eviction.idle_ns AS evicted_idle_ns,
    last_eviction.share_degree AS evicted_share_degree,
    last_eviction.hit_count AS evicted_hit_count
FROM classified
ORDER BY run_id, engine, admission, pos
