"""A read-only collector on a lake (``--read-only``): the one place a team's dashboards and analysts query while
the hosts' collectors write. It opens no socket, writes nothing, and answers from what the writers have committed,
including what they commit after it started; ``kvfabric query --lake`` reads the same lake from the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest
from support.collector_testkit import bulk_batches, collector_files, meta, send_stream, stored, wait_until
from support.lake_testkit import LakeLocation as KitLocation

from kvfabric.collector import CollectorProcess

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("lake_location", ["local"], indirect=True)
def test_a_read_only_collector_serves_what_the_writers_commit(lake_location: KitLocation) -> None:
    env = {**os.environ, **lake_location.env}
    lake = {"lake": lake_location.catalog, "data": lake_location.data}
    with collector_files() as writer_files, collector_files() as reader_files:
        writer = CollectorProcess(writer_files.config(**lake, coalesce_ms=50), log_path=writer_files.log_path,
                                  env=env, ready_timeout=60)
        with writer:
            send_stream(writer_files.socket_path, meta("s1", "run-1", "h1/dp0"), bulk_batches("run-1", "h1/dp0", 4, 25))
            wait_until(lambda: stored(writer_files.http_url, "run-1") == 100, timeout=30, what="writer committed")
            reader_config = reader_files.config(**lake, read_only=True)
            argv = [sys.executable, "-m", "kvfabric.collector", *reader_config.to_argv()]
            with open(reader_files.log_path, "ab") as log:
                reader = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
            try:
                wait_until(lambda: _healthy(reader_files.http_url), timeout=60, what="the read-only collector")
                assert not os.path.exists(reader_files.socket_path)  # no socket: it ingests nothing
                assert stored(reader_files.http_url, "run-1") == 100, reader_files.log()
                # Committed by the writer after the reader attached: the reader sees it on its next query.
                send_stream(writer_files.socket_path, meta("s2", "run-2", "h2/dp0"),
                            bulk_batches("run-2", "h2/dp0", 2, 10))
                wait_until(lambda: stored(reader_files.http_url, "run-2") == 20, timeout=30,
                           what="the reader saw the writer's later commit")
                summary = httpx.get(reader_files.http_url + "/api/v1/runs/run-1/summary", timeout=10).json()
                assert summary["events"] == 100
            finally:
                reader.terminate()
                reader.wait(30)
            assert reader.returncode == 0, reader_files.log()
        # The CLI reads the lake while nothing runs, and while a writer runs (checked above through REST).
        out = subprocess.run(
            [sys.executable, "-m", "kvfabric.cli", "query", "runs", "--lake", lake_location.catalog,
             "--data", lake_location.data, "--format", "json"],
            env=env, capture_output=True, text=True, timeout=120,
        )
        assert out.returncode == 0, out.stderr
        assert {r["run_id"]: r["events"] for r in json.loads(out.stdout)} == {"run-1": 100, "run-2": 20}


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_read_only_without_a_lake_is_refused_in_one_line() -> None:
    out = subprocess.run([sys.executable, "-m", "kvfabric.collector", "--read-only"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "--read-only is for a lake" in out.stderr


def test_a_lake_that_cannot_be_attached_is_one_line_naming_it(tmp_path: os.PathLike[str]) -> None:
    out = subprocess.run([sys.executable, "-m", "kvfabric.collector", "--lake",
                          "postgres:dbname=nope host=127.0.0.1 port=1 user=postgres", "--data", str(tmp_path),
                          "--socket", os.path.join(str(tmp_path), "s.sock"), "--no-http"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().count("\n") == 0, out.stderr
    assert "cannot attach the lake postgres:dbname=nope" in out.stderr


