-- family_depth($run, $family): where in the chain one family loses blocks: per depth, evictions and rebuilds.
SELECT
    depth,
    count(*) FILTER (WHERE event = 'block_evicted')::BIGINT AS evicted_blocks,
    count(*) FILTER (WHERE event = 'block_evicted' AND share_degree >= 2)::BIGINT AS shared_anchor_evictions,
    count(*) FILTER (WHERE event = 'block_rebuilt')::BIGINT AS rebuilt_blocks
FROM events
WHERE run_id = $run AND family = $family AND event IN ('block_evicted', 'block_rebuilt')
GROUP BY depth
ORDER BY depth NULLS LAST
