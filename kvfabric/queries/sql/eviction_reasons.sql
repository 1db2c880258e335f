-- eviction_reasons($run, $host, $tenant, $lora): block_evicted rows of one run (of one host, tenant, LoRA adapter
-- when set) by why the block lost its content (docs/design.md §4):
-- pressure (reused by get_new_blocks for a new allocation), connector (evict_blocks, KV connectors), reset (a
-- prefix-cache reset), unknown (the row carries no reason: streams of schema version 1, vLLM's KV events, which
-- say only that a block was removed, or an emitter that did not know). One row per reason present.
-- Streams of source kv_events carry no share_degree: their shared anchors are those of part kv_shared_evictions.
WITH
-- @include kv_shared_evictions
kv_shared AS (
    SELECT coalesce(reason, 'unknown') AS reason, count(*) AS n
    FROM kv_shared_evictions
    WHERE ($host IS NULL OR host = $host)
      AND ($tenant IS NULL OR tenant = $tenant)
      AND ($lora IS NULL OR lora = $lora)
    GROUP BY 1
),
r AS (
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
)
SELECT r.reason, r.evicted_blocks, (r.shared_anchor_evictions + coalesce(kv_shared.n, 0))::BIGINT AS shared_anchor_evictions
FROM r
LEFT JOIN kv_shared USING (reason)
ORDER BY 1
