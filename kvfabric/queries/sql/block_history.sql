-- block_history($block_hash, $run, $limit): every event of one block hash, oldest first (its life story:
-- sealed, touched, freed, evicted, rebuilt ... possibly in several runs and engines).
SELECT
    rowid AS row_key,
    ts_ns,
    run_id,
    engine,
    event,
    seq,
    step,
    request_id,
    block_id,
    block_hash,
    parent_hash,
    family,
    depth,
    ref_count,
    hit_count,
    share_degree,
    branch_factor,
    retain_score,
    protected,
    policy,
    "count",
    age_ns,
    reason
FROM events
WHERE block_hash = $block_hash
  AND ($run IS NULL OR run_id = $run)
ORDER BY ts_ns, rowid
LIMIT $limit
