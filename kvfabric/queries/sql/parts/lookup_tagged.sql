-- Part of a WITH clause (included by `-- @include lookup_tagged`; see kvfabric/queries/catalog.py). Reads a CTE
-- `req` (rowid as row_key, run_id, engine, request_id, ts_ns, step, event, ...) and tags each of a request's
-- events with the lookup after it (next_lookup, next_lookup_step) and the lookup before it (prev_lookup), in
-- (ts_ns, rowid) order per run and engine: the admission an event belongs to.
tagged AS (
    SELECT
        *,
        first_value(CASE WHEN event = 'prefix_lookup' THEN row_key END IGNORE NULLS) OVER fwd AS next_lookup,
        first_value(CASE WHEN event = 'prefix_lookup' THEN step END IGNORE NULLS) OVER fwd AS next_lookup_step,
        last_value(CASE WHEN event = 'prefix_lookup' THEN row_key END IGNORE NULLS) OVER back AS prev_lookup
    FROM req
    WINDOW
        fwd AS (PARTITION BY run_id, engine, request_id ORDER BY ts_ns, row_key
                ROWS BETWEEN CURRENT ROW AND UNBOUNDED FOLLOWING),
        back AS (PARTITION BY run_id, engine, request_id ORDER BY ts_ns, row_key
                 ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW)
),
