-- runs: one row per run, newest activity last.
-- Read from the streams table, which the writer updates in the same transaction as the events it accounts for
-- (and ingest guarantees a stream's rows carry its metadata's run_id and engine), so this is exact and O(streams)
-- instead of a scan of the events table.
SELECT
    run_id,
    coalesce(list(DISTINCT engine ORDER BY engine) FILTER (WHERE engine IS NOT NULL), []) AS engines,
    coalesce(list(DISTINCT policy ORDER BY policy) FILTER (WHERE policy IS NOT NULL), []) AS policies,
    min(first_ts_ns) AS first_ts_ns,
    max(last_ts_ns) AS last_ts_ns,
    coalesce(sum("rows"), 0)::BIGINT AS events,
    count(*)::BIGINT AS streams,
    coalesce(sum(gaps), 0)::BIGINT AS sequence_gaps
FROM streams
GROUP BY run_id
ORDER BY first_ts_ns NULLS LAST, run_id
