-- lifetimes($run): how long blocks stayed cached before their eviction, for the run (level 'run', first) and per
-- family (level 'family', most evicted first). Each block_evicted row is paired with the latest block_sealed of the
-- same engine and hash at or before it (an ASOF join; a hash cached twice at once pairs both evictions with its
-- latest copy); evictions with no such seal (sealed before recording began) count in without_seal and in no time.
-- Works alike for both sources: both write block_sealed and block_evicted (docs/kv-events.md).
--   evicted_blocks           evictions paired with their seal
--   mean_s, p50_s, p90_s, max_s   seconds from that seal to the eviction (NULL without a pair), computed on integer
--                            ns so that the answer does not depend on the order rows are summed in
WITH ev AS (
    SELECT engine, block_hash, family, ts_ns
    FROM events
    WHERE run_id = $run AND event = 'block_evicted' AND block_hash IS NOT NULL
),
seals AS (
    SELECT engine, block_hash, ts_ns
    FROM events
    WHERE run_id = $run AND event = 'block_sealed' AND block_hash IS NOT NULL
),
paired AS (
    SELECT ev.family, ev.ts_ns - s.ts_ns AS lifetime_ns
    FROM ev
    ASOF LEFT JOIN seals AS s ON ev.engine = s.engine AND ev.block_hash = s.block_hash AND ev.ts_ns >= s.ts_ns
),
levels AS (
    SELECT 'run' AS level, NULL::VARCHAR AS family, lifetime_ns FROM paired
    UNION ALL
    SELECT 'family' AS level, family, lifetime_ns FROM paired
)
SELECT
    level,
    family,
    count(lifetime_ns)::BIGINT AS evicted_blocks,
    (count(*) - count(lifetime_ns))::BIGINT AS without_seal,
    avg(lifetime_ns) / 1e9 AS mean_s,
    quantile_cont(lifetime_ns, 0.5) / 1e9 AS p50_s,
    quantile_cont(lifetime_ns, 0.9) / 1e9 AS p90_s,
    max(lifetime_ns) / 1e9 AS max_s
FROM levels
GROUP BY level, family
ORDER BY level = 'family', evicted_blocks DESC, family NULLS LAST
