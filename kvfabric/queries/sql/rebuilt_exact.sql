-- rebuilt_exact($run): rebuilt-from-eviction recomputed exactly from the raw events, per family.
-- The hook detects rebuilds online with a bounded memory of evicted hashes; this query has no such bound: a seal of
-- a hash whose previous sealed/evicted event on the same engine was an eviction is a rebuild. Compare its totals
-- with run_summary.rebuilt_from_eviction_blocks to see what the bounded memory missed.
WITH x AS (
    SELECT
        family,
        event,
        ts_ns,
        lag(event) OVER w AS prev_event,
        lag(ts_ns) OVER w AS prev_ts
    FROM events
    WHERE run_id = $run AND event IN ('block_sealed', 'block_evicted') AND block_hash IS NOT NULL
    WINDOW w AS (PARTITION BY engine, block_hash ORDER BY ts_ns, rowid)
)
SELECT
    family,
    count(*)::BIGINT AS rebuilt_blocks,
    avg(ts_ns - prev_ts) / 1e9 AS mean_time_to_rebuild_s
FROM x
WHERE event = 'block_sealed' AND prev_event = 'block_evicted'
GROUP BY family
ORDER BY rebuilt_blocks DESC, family NULLS LAST
