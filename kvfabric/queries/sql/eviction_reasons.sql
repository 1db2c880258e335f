-- eviction_reasons($run, $host, $tenant, $lora): block_evicted rows of one run (of one host, tenant, LoRA adapter
-- when set) by why the block lost its content (docs/design.md §4):
-- pressure (reused by get_new_blocks for a new allocation), connector (evict_blocks, KV connectors), reset (a
-- prefix-cache reset), unknown (the row carries no reason: streams of schema version 1, or an emitter that did not
-- know). One row per reason present.
SELECT
    coalesce(reason, 'unknown') AS reason,
    count(*)::BIGINT AS evicted_blocks,
    count(*) FILTER (WHERE share_degree >= 2)::BIGINT AS shared_anchor_evictions
FROM events
WHERE run_id = $run AND event = 'block_evicted'
  AND ($host IS NULL OR host = $host)
  AND ($tenant IS NULL OR tenant = $tenant)
  AND ($lora IS NULL OR lora = $lora)
GROUP BY 1
ORDER BY 1
