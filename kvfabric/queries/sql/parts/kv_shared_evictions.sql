-- Part of a WITH clause (included by `-- @include kv_shared_evictions`; see kvfabric/queries/catalog.py). Uses $run
-- (NULL: every run).
--   kv_engines            (run_id, engine) whose streams are all of source kv_events (vLLM's KV events and the
--                         engine's scraped counters): engines without lookups and without share_degree
--   kv_shared_evictions   one row per shared-anchor eviction of those engines: run_id, engine, host, family, depth,
--                         reason, tenant, lora, ts_ns
-- Those events know no requests, only the chain of stored blocks (docs/kv-events.md): a block is a shared anchor
-- from the moment a second distinct child was stored under it, or it was stored a second time (a second request
-- computed the same prefix: stored again after its eviction, or as a second copy); an eviction is a shared-anchor
-- eviction when that moment came at or before it (seals before any time window count: the status is the block's
-- history). On a run without such engines the joins have an empty build side and read nothing more.
kv_engines AS (
    SELECT run_id, engine
    FROM streams
    WHERE $run IS NULL OR run_id = $run
    GROUP BY run_id, engine
    HAVING bool_and(coalesce(source, 'plugin') = 'kv_events')
),
kv_seals AS (
    SELECT e.run_id, e.engine, e.block_hash, e.parent_hash, e.ts_ns
    FROM events AS e
    JOIN kv_engines AS k ON k.run_id = e.run_id AND k.engine = e.engine
    WHERE e.event = 'block_sealed' AND e.block_hash IS NOT NULL AND ($run IS NULL OR e.run_id = $run)
),
kv_marks AS (
    -- 'child': the first store of each distinct child, credited to its parent; 'store': every store of the block
    SELECT run_id, engine, parent_hash AS block_hash, 'child' AS kind, min(ts_ns) AS ts_ns
    FROM kv_seals
    WHERE parent_hash IS NOT NULL
    GROUP BY run_id, engine, parent_hash, block_hash
    UNION ALL
    SELECT run_id, engine, block_hash, 'store' AS kind, ts_ns FROM kv_seals
),
kv_anchors AS (
    SELECT run_id, engine, block_hash, min(ts_ns) AS anchor_ns
    FROM (
        SELECT
            run_id, engine, block_hash, ts_ns,
            row_number() OVER (PARTITION BY run_id, engine, block_hash, kind ORDER BY ts_ns) AS k
        FROM kv_marks
    )
    WHERE k = 2
    GROUP BY run_id, engine, block_hash
),
kv_shared_evictions AS (
    SELECT e.run_id, e.engine, e.host, e.family, e.depth, e.reason, e.tenant, e.lora, e.ts_ns
    FROM events AS e
    JOIN kv_anchors AS a ON a.run_id = e.run_id AND a.engine = e.engine AND a.block_hash = e.block_hash
    WHERE e.event = 'block_evicted' AND a.anchor_ns <= e.ts_ns AND ($run IS NULL OR e.run_id = $run)
),
