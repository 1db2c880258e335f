-- run_span($run): first and last event time of one run (from the streams table: no scan of events).
SELECT min(first_ts_ns) AS first_ts_ns, max(last_ts_ns) AS last_ts_ns FROM streams WHERE run_id = $run
