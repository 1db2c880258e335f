-- run_exists($run): whether any stream of that run was ever accepted (a run with no events yet still exists).
SELECT count(*) > 0 AS found FROM streams WHERE run_id = $run
