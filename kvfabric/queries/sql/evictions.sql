-- evictions(filters..., $after_ts, $after_rowid, $limit): block_evicted rows, oldest first, keyset-paginated.
-- Order key (ts_ns, rowid): rowid is unique and stable because events is append-only, so a walk page by page
-- returns every eviction exactly once even when many share a timestamp. "ts_ns >= $after_ts" is written out so
-- DuckDB prunes row groups by their ts_ns zone maps (a page costs the same at the start and at the end).
-- Time range: since_ns inclusive, until_ns exclusive. $host, $tenant (cache_salt), $lora: NULL for any (rows of files
-- older than schema 3 carry none of them, so a filter leaves them out).
SELECT
    rowid AS row_key,
    ts_ns,
    run_id,
    engine,
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
    age_ns,
    reason,
    host,
    dp_rank,
    tenant,
    lora
FROM events
WHERE event = 'block_evicted'
  AND ($run IS NULL OR run_id = $run)
  AND ($family IS NULL OR family = $family)
  AND ($engine IS NULL OR engine = $engine)
  AND ($host IS NULL OR host = $host)
  AND ($tenant IS NULL OR tenant = $tenant)
  AND ($lora IS NULL OR lora = $lora)
  AND ($since_ns IS NULL OR ts_ns >= $since_ns)
  AND ($until_ns IS NULL OR ts_ns < $until_ns)
  AND ($after_ts IS NULL OR (ts_ns >= $after_ts AND (ts_ns > $after_ts OR rowid > $after_rowid)))
ORDER BY ts_ns, rowid
LIMIT $limit
