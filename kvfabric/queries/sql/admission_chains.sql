-- admission_chains($run): the recorded traffic of one run, one row per admission (prefix_lookup) in lookup order:
-- what `kvfabric whatif` replays and `kvfabric export --format mooncake` writes (docs/design.md §5, §7).
--   positions / hashes   the request's block chain as the events show it: block_touched rows of the admission
--                        (its hits) and block_sealed rows (blocks it computed and cached), as parallel lists;
--                        positions it neither hit nor sealed (admission gate, never computed) are absent
--   allocated_blocks     block_allocated rows of the admission (new blocks it took: prefill and decode)
--   end_ns               its last event carrying its request id (its frees, when it finished)
-- Rows of a request belong to the admission whose lookup follows them in the same step, else to its latest
-- earlier lookup (as in misses.sql).
WITH bs AS (
    SELECT engine, max(block_size) AS bs FROM streams WHERE run_id = $run GROUP BY engine
),
req AS (
    SELECT rowid AS row_key, run_id, engine, request_id, ts_ns, step, event, block_hash, depth
    FROM events
    WHERE run_id = $run AND request_id IS NOT NULL
      AND event IN ('prefix_lookup', 'block_sealed', 'block_touched', 'block_allocated', 'block_freed',
                    'ref_count_changed')
),
-- @include lookup_tagged
own AS (
    SELECT
        CASE WHEN event = 'prefix_lookup' THEN row_key
             WHEN next_lookup_step = step THEN next_lookup
             ELSE prev_lookup END AS lookup_key,
        event, block_hash, depth, ts_ns
    FROM tagged
),
per_admission AS (
    SELECT
        lookup_key,
        list(depth ORDER BY depth) FILTER (WHERE event IN ('block_touched', 'block_sealed')
                                                AND block_hash IS NOT NULL AND depth IS NOT NULL) AS positions,
        list(block_hash ORDER BY depth) FILTER (WHERE event IN ('block_touched', 'block_sealed')
                                                   AND block_hash IS NOT NULL AND depth IS NOT NULL) AS hashes,
        count(*) FILTER (WHERE event = 'block_allocated') AS allocated_blocks,
        max(ts_ns) AS end_ns
    FROM own
    WHERE lookup_key IS NOT NULL
    GROUP BY lookup_key
)
SELECT
    e.rowid AS lookup_key,
    e.engine,
    e.request_id,
    e.family,
    e.ts_ns,
    coalesce(e.prompt_tokens, 0) AS prompt_tokens,
    coalesce(e.hit_tokens, 0) AS hit_tokens,
    coalesce(bs.bs, (SELECT max(block_size) FROM streams WHERE run_id = $run)) AS block_size,
    coalesce(p.positions, []) AS positions,
    coalesce(p.hashes, []) AS hashes,
    coalesce(p.allocated_blocks, 0)::BIGINT AS allocated_blocks,
    greatest(coalesce(p.end_ns, e.ts_ns), e.ts_ns) AS end_ns
FROM events AS e
LEFT JOIN bs USING (engine)
LEFT JOIN per_admission AS p ON p.lookup_key = e.rowid
WHERE e.run_id = $run AND e.event = 'prefix_lookup'
ORDER BY e.ts_ns, e.rowid
