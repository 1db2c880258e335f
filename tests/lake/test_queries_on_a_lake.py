"""The named queries run unchanged on a lake: the golden workload and the kv-events streams of
support/kv_answers_testkit.py, sent to a collector on a DuckDB file and to one on a lake (PostgreSQL catalog, moto
S3), give the same answer to every query, ``whatif`` included."""

from __future__ import annotations

import os
from typing import Any

import pytest
from support.collector_testkit import HASH_STORY, collector_files, send_golden, send_scripts, stored, wait_until
from support.kv_answers_testkit import FAM_R, kv_streams
from support.lake_testkit import LakeLocation as KitLocation

from kvfabric.analysis.whatif import whatif
from kvfabric.collector import CollectorProcess
from kvfabric.lake import LakeLocation
from kvfabric.queries import QUERY_NAMES, QueryRunner
from kvfabric.queries.sources import connector

pytestmark = pytest.mark.timeout(300)


def _answers(q: QueryRunner) -> dict[str, Any]:
    family = q.families("runA")[0]["family"]
    request_id = q.admission_misses("runA")[0]["request_id"]
    params: dict[str, dict[str, Any]] = {
        "runs": {}, "run_summary": {"run": "runA"}, "families": {"run": "runA"},
        "family_detail": {"run": "runA", "family": family}, "evictions": {"run": "runA"},
        "block_history": {"block_hash": str(HASH_STORY)}, "compare": {"a": "runA", "b": "runB"},
        "top_waste_families": {"run": "runA"}, "rebuilt_exact": {"run": "runA"}, "misses": {"run": "runA"},
        "admission_misses": {"run": "runA"}, "request": {"request_id": request_id}, "lifetimes": {"run": "runA"},
        "fleet": {},
    }
    assert set(params) == set(QUERY_NAMES)  # a new query must be added here too
    out = {name: q.run(name, **params[name]) for name in QUERY_NAMES}
    out["run_summary B"] = q.run_summary("runB")
    out["whatif"] = whatif(q, "runA", "adaptive_aging", 64)
    # The kv-events source's answers (its shared anchors, lifetimes and unavailable fields are SQL of their own).
    out["kv run_summary"] = q.run_summary("runK")
    out["kv counters run_summary"] = q.run_summary("runKC")
    out["kv families"] = q.families("runK")
    out["kv family_detail"] = q.family_detail("runK", FAM_R)
    out["kv lifetimes"] = q.lifetimes("runK")
    out["kv misses"] = q.misses("runK")
    return _without_row_positions(out)


def _without_row_positions(value: Any) -> Any:
    """Row keys and cursors name a row's position in its store (rowid), which differs between the two; the ingest
    lag is when each collector received the rows."""
    if isinstance(value, dict):
        return {k: _without_row_positions(v) for k, v in value.items()
                if k not in ("row_key", "next_cursor", "ingest_lag_s")}
    if isinstance(value, list):
        return [_without_row_positions(v) for v in value]
    return value


@pytest.mark.parametrize("lake_location", ["s3"], indirect=True)
def test_every_named_query_answers_the_same_on_a_lake(lake_location: KitLocation,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in lake_location.env.items():
        monkeypatch.setenv(name, value)
    with collector_files() as file_side, collector_files() as lake_side:
        config = lake_side.config(lake=lake_location.catalog, data=lake_location.data, coalesce_ms=50)
        with file_side.process(coalesce_ms=50), \
                CollectorProcess(config, log_path=lake_side.log_path, env={**os.environ}, ready_timeout=60):
            total = send_golden(file_side.socket_path) + send_scripts(file_side.socket_path, kv_streams())
            assert send_golden(lake_side.socket_path) + send_scripts(lake_side.socket_path, kv_streams()) == total
            runs = ("runA", "runB", "runK", "runKC", "runMix", "runPM")
            for f in (file_side, lake_side):
                wait_until(lambda f=f: sum(stored(f.http_url, r) for r in runs) == total,
                           timeout=30, what="the golden and kv-events workloads committed")
        on_file = _answers(QueryRunner.for_path(file_side.db_path))
        on_lake = _answers(QueryRunner(connector("", LakeLocation.parse(lake_location.catalog, lake_location.data))))
    assert on_file["run_summary"]["events"] == 30 and on_file["evictions"]["items"]  # a real workload, not empties
    assert on_file["kv run_summary"]["shared_anchor_evictions"] == 4 and on_file["kv lifetimes"]["items"]
    for name in on_file:
        assert on_lake[name] == on_file[name], (name, _diff(on_lake[name], on_file[name]))


def _diff(a: Any, b: Any, path: str = "") -> list[str]:
    """Where two answers differ (for the failure message)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in _diff(a.get(k), b.get(k), f"{path}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in _diff(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: lake {a!r} file {b!r}"]
