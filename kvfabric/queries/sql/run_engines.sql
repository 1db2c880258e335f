-- run_engines($run): the engines of one run with the configuration their streams declared (block size, pool size
-- in blocks, eviction policy, settings JSON); for an engine with several streams (restarts), its latest one.
SELECT
    engine,
    arg_max(block_size, first_seen_ns) AS block_size,
    arg_max(num_blocks, first_seen_ns) AS num_blocks,
    arg_max(policy, first_seen_ns) AS policy,
    arg_max(settings, first_seen_ns) AS settings,
    count(*)::BIGINT AS streams
FROM streams
WHERE run_id = $run
GROUP BY engine
ORDER BY engine
