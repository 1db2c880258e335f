-- family_depth($run, $family): where in the chain one family loses blocks: per depth, evictions and rebuilds.
-- Streams of source kv_events carry no share_degree: their shared anchors are those of part kv_shared_evictions.
WITH
-- @include kv_shared_evictions
kv_shared AS (
    SELECT depth, count(*) AS n FROM kv_shared_evictions WHERE family = $family GROUP BY depth
),
d AS (
    SELECT
        depth,
        count(*) FILTER (WHERE event = 'block_evicted')::BIGINT AS evicted_blocks,
        count(*) FILTER (WHERE event = 'block_evicted' AND share_degree >= 2)::BIGINT AS shared_anchor_evictions,
        count(*) FILTER (WHERE event = 'block_rebuilt')::BIGINT AS rebuilt_blocks
    FROM events
    WHERE run_id = $run AND family = $family AND event IN ('block_evicted', 'block_rebuilt')
    GROUP BY depth
)
SELECT
    d.depth,
    d.evicted_blocks,
    (d.shared_anchor_evictions + coalesce(kv_shared.n, 0))::BIGINT AS shared_anchor_evictions,
    d.rebuilt_blocks
FROM d
LEFT JOIN kv_shared ON kv_shared.depth IS NOT DISTINCT FROM d.depth
ORDER BY d.depth NULLS LAST
