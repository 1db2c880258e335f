-- run_sources($run): the event sources of one run's streams, one row each (plugin: KVFabric's hook; kv_events:
-- vLLM's KV-event stream; a stream older than the column counts as plugin). kvfabric.queries.availability decides
-- from them what the run can answer.
SELECT DISTINCT coalesce(source, 'plugin') AS source
FROM streams
WHERE run_id = $run
ORDER BY 1
