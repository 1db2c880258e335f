"""What ``kvfabric ab`` reads from the collector: REST while it runs, the DuckDB file once it has stopped.

REST (docs/design.md §7): ``/api/v1/runs`` (to know when a run's events have all arrived),
``/api/v1/runs/{run}/summary`` and ``/api/v1/families?run=``. The DuckDB file (events table, docs/design.md §4)
gives what REST does not: rebuilt blocks over time and each admission's ``prefix_lookup`` row, joined with the
client's requests through the ``X-Request-Id`` the benchmark sent (vLLM names the request ``cmpl-<id>-0-<random>``).
DuckDB allows one process on a file, so :func:`read_events` runs after the collector has stopped.
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

__all__ = ["WARMUP_SUFFIX", "fetch_run", "offline_run", "read_events", "request_join", "split_warmup",
           "wait_quiescent"]

#: A run's warm-up events move to the run id ``<run>`` + this suffix (:func:`split_warmup`).
WARMUP_SUFFIX = "~warmup"


def _get(url: str, timeout: float = 10.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def run_events(http_url: str, run_id: str) -> int:
    """Events the collector has stored for ``run_id`` (0 when it has none yet)."""
    runs = _get(f"{http_url}/api/v1/runs")
    items = runs["items"] if isinstance(runs, dict) else runs
    return next((int(r["events"]) for r in items if r["run_id"] == run_id), 0)


def wait_quiescent(http_url: str, run_id: str, *, settle_s: float = 2.0, timeout: float = 120.0) -> int:
    """Wait until the stored event count of ``run_id`` is non-zero and has not moved for ``settle_s``.

    The server is idle by then (the benchmark has its last answer), so a count that stops moving means the hook's
    buffer, its forwarder and the collector's writer have all drained. Returns the count.
    """
    deadline = time.monotonic() + timeout
    last, since = -1, time.monotonic()
    while True:
        now_count = run_events(http_url, run_id)
        now = time.monotonic()
        if now_count != last:
            last, since = now_count, now
        elif now_count > 0 and now - since >= settle_s:
            return now_count
        if now > deadline:
            return now_count
        time.sleep(0.25)


def fetch_run(http_url: str, run_id: str, timeout: float = 10.0) -> dict[str, Any]:
    """The collector's analytics of one run: summary and families (most wasted prefill first)."""
    q = urllib.parse.quote(run_id, safe="")
    summary = _get(f"{http_url}/api/v1/runs/{q}/summary", timeout)
    fams = _get(f"{http_url}/api/v1/families?run={q}&limit=1000", timeout)
    families = fams["items"] if isinstance(fams, dict) else fams
    return {"summary": summary, "families": families}


def split_warmup(db_path: str, cuts: dict[str, int | None]) -> dict[str, int]:
    """Move each run's warm-up events to the run id ``<run>~warmup``; returns the rows moved per run.

    ``cuts`` maps a run id to the wall-clock time (ns, the clock of the events' ``ts_ns``) taken after the
    collector had stored every warm-up event and before the first measured request was sent (None: no warm-up).
    Moved: every event of the run before the cut, and every later ``block_evicted`` of a block the warm-up sealed
    (the warm-up's prompts share no block with the scenario's, so such an eviction frees a warm-up block; with the
    default warm-up, shorter than a block, there are none). The
    streams table is left alone (the run keeps its streams, gaps and drops). Needs the collector stopped (DuckDB
    allows one writing process); a run with no events before its cut moves nothing, so a second call is a no-op.
    """
    import duckdb  # (only where a collector file is read: `kvfabric ab --help` and bench reports stay fast)

    moved: dict[str, int] = {}
    con = duckdb.connect(db_path)
    try:
        for run, cut in cuts.items():
            if cut is None:
                moved[run] = 0
                continue
            warm = run + WARMUP_SUFFIX
            con.execute("BEGIN TRANSACTION")
            con.execute("UPDATE events SET run_id = ? WHERE run_id = ? AND ts_ns < ?", [warm, run, cut])
            con.execute(
                "UPDATE events SET run_id = ? WHERE run_id = ? AND event = 'block_evicted' AND block_hash IN "
                "(SELECT block_hash FROM events WHERE run_id = ? AND event = 'block_sealed')", [warm, run, warm])
            row = con.execute("SELECT count(*) FROM events WHERE run_id = ?", [warm]).fetchone()
            con.execute("COMMIT")
            moved[run] = int(row[0]) if row else 0
    finally:
        con.close()
    return moved


def offline_run(db_path: str, run_id: str) -> dict[str, Any]:
    """:func:`fetch_run`'s answer computed from the collector's file (stopped collector), by the same queries the
    collector's REST routes run."""
    from kvfabric.queries.runner import QueryRunner  # (DuckDB behind it: only where a collector file is read)

    runner = QueryRunner.for_path(db_path)
    return {"summary": runner.run_summary(run_id), "families": runner.families(run=run_id, limit=1000)}


def read_events(db_path: str, run_ids: list[str]) -> dict[str, dict[str, Any]]:
    """Per run: rebuilt-block times, eviction split and admissions, from the collector's DuckDB file.

    * ``rebuilt_s``: seconds from the run's first event to each ``block_rebuilt``, sorted;
    * ``evicted_shared`` / ``evicted_private``: evictions of shared anchors (share_degree >= 2) / private tails;
    * ``lookups``: ``[request_id, prompt_tokens, hit_tokens]`` for every ``prefix_lookup`` (an admission; a
      preempted request is admitted, and counted, again).
    """
    # duckdb: only when a run is read, not for `kvfabric ab --help`
    import duckdb

    out: dict[str, dict[str, Any]] = {}
    con = duckdb.connect(db_path, read_only=True)
    try:
        for run in run_ids:
            t0 = con.execute("SELECT min(ts_ns) FROM events WHERE run_id = ?", [run]).fetchone()
            first = t0[0] if t0 and t0[0] is not None else 0
            rebuilt = [
                (r[0] - first) / 1e9
                for r in con.execute(
                    "SELECT ts_ns FROM events WHERE run_id = ? AND event = 'block_rebuilt' ORDER BY ts_ns", [run]
                ).fetchall()
            ]
            shared, private = con.execute(
                "SELECT count(*) FILTER (WHERE share_degree >= 2),"
                " count(*) FILTER (WHERE coalesce(share_degree, 0) < 2)"
                " FROM events WHERE run_id = ? AND event = 'block_evicted'", [run]
            ).fetchone() or (0, 0)
            lookups = [
                [str(r[0]), int(r[1] or 0), int(r[2] or 0)]
                for r in con.execute(
                    "SELECT request_id, prompt_tokens, hit_tokens FROM events"
                    " WHERE run_id = ? AND event = 'prefix_lookup' ORDER BY ts_ns", [run]
                ).fetchall()
            ]
            out[run] = {"rebuilt_s": rebuilt, "evicted_shared": int(shared), "evicted_private": int(private),
                        "lookups": lookups}
    finally:
        con.close()
    return out


def request_join(records: list[dict[str, Any]], lookups: list[list[Any]]) -> dict[str, Any]:
    """Compare, request by request, the cached tokens the server told the client with the collector's hit tokens.

    A client record is matched to the ``prefix_lookup`` rows whose vLLM request id contains its ``X-Request-Id``.
    vLLM reports the cached tokens of a request's *first* admission; the collector has one row per admission.
    """
    by_id: dict[str, list[list[Any]]] = {}
    pattern = re.compile(r"cmpl-(.+?)-\d+(?:-[0-9a-zA-Z]+)?$")
    for lk in lookups:
        m = pattern.match(lk[0])
        key = m.group(1) if m else lk[0]
        by_id.setdefault(key, []).append(lk)
    matched = equal = readmitted = 0
    client_first = collector_first = 0
    unmatched_client = 0
    for r in records:
        if not r.get("ok") or r.get("cached_tokens") is None:
            continue
        rows = by_id.get(r["request_id"])
        if not rows:
            unmatched_client += 1
            continue
        matched += 1
        readmitted += len(rows) - 1
        client_first += int(r["cached_tokens"])
        collector_first += int(rows[0][2])
        equal += int(rows[0][2]) == int(r["cached_tokens"])
    known = {r["request_id"] for r in records}
    orphan_lookups = sum(len(v) for k, v in by_id.items() if k not in known)
    return {
        "requests_matched": matched,
        "requests_equal": equal,
        "readmissions": readmitted,
        "client_cached_tokens_matched": client_first,
        "collector_first_admission_hit_tokens": collector_first,
        "client_requests_without_lookup": unmatched_client,
        "lookups_without_client_request": orphan_lookups,
    }
