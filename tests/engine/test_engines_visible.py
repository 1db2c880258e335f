"""Visibly on (issue 26): an engine with KVFabric on says so in vLLM's own log, and the collector lists it before
its first request (``GET /api/v1/engines``, ``kvfabric status``), with its events once it serves, and as
disconnected once it stops.

The main test runs a real engine process: vLLM's logging configured as ``EngineCore`` configures it (default
level), the plugin loaded through vLLM's entry point, vLLM's real Scheduler on CPU, a real collector process.
"""

from __future__ import annotations

import json
import os
import queue
import socket
import subprocess
import sys
import textwrap
import threading
import time
from importlib.metadata import version
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from support.collector_testkit import collector_files, free_port, wait_until

import kvfabric
from kvfabric import cli
from kvfabric.contract import schema as S
from kvfabric.engine import plugin
from kvfabric.engine.config import load_hook_settings
from kvfabric.forwarder.buffer import EventBuffer
from kvfabric.forwarder.sinks import UnixArrowSink
from kvfabric.ingest.engines import CONNECTED, DISCONNECTED, IDLE, EngineRegistry
from kvfabric.ingest.validate import StreamMeta

ENGINE_PROCESS = textwrap.dedent(
    """
    import sys
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging

    configure_logging(LoggingConfig())  # what EngineCore.run_engine_core applies: vLLM's defaults (INFO, stdout)

    from kvfabric.sim.harness import SimulatedEngine, make_request

    engine = SimulatedEngine.create(64)  # loads the general plugins (the entry point), then builds the Scheduler
    print("READY", flush=True)
    sys.stdin.readline()
    for i in range(6):
        engine.add_request(make_request(f"r{i}", [1000 + i % 2] * 64 + [2000 + i] * 20, max_tokens=4))
    engine.run_until_done(max_steps=10_000)
    print("SERVED", flush=True)
    sys.stdin.readline()
    """
)


def status(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli.main(["status", *args])
    out, err = capsys.readouterr()
    return code, out, err


def engines(url: str) -> list[dict[str, Any]]:
    return httpx.get(f"{url}/api/v1/engines").json()


@pytest.mark.vllm
def test_an_engine_is_listed_before_its_first_request(capsys: pytest.CaptureFixture[str]) -> None:
    with collector_files() as files:
        collector = files.process()
        collector.start()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KVFABRIC_", "VLLM_LOGGING"))}
        env |= {"KVFABRIC_LIFECYCLE": "1", "KVFABRIC_SINK": f"unix://{files.socket_path}",
                "KVFABRIC_RUN_ID": "visible", "HF_HUB_OFFLINE": "1"}
        child = subprocess.Popen([sys.executable, "-c", ENGINE_PROCESS], env=env, stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines: queue.Queue[str] = queue.Queue()
        seen: list[str] = []
        threading.Thread(target=lambda: [lines.put(x) for x in child.stdout], daemon=True).start()  # type: ignore

        def read_until(marker: str, timeout: float = 240.0) -> None:
            deadline = time.monotonic() + timeout
            while not seen or seen[-1].strip() != marker:
                try:
                    seen.append(lines.get(timeout=max(0.1, deadline - time.monotonic())))
                except queue.Empty:
                    raise AssertionError(f"no {marker} from the engine process:\n" + "".join(seen)) from None
                if child.poll() is not None and lines.empty():
                    raise AssertionError("the engine process exited:\n" + "".join(seen))

        try:
            read_until("READY")
            # One line, in vLLM's own log format, at vLLM's default level.
            ours = [x for x in seen if "KVFabric" in x]
            assert len(ours) == 1, "".join(seen)
            line = ours[0]
            assert " INFO " in line and f"pid={child.pid}" in line  # vLLM's format: "(... pid=P) INFO <date> ..."
            engine_id = f"{socket.gethostname()}/dp0"
            assert (f"KVFabric {kvfabric.__version__} on engine {engine_id} (run visible): recording on, policy lru, "
                    f"sink unix://{files.socket_path}, collector answered") in line

            # No request yet: the collector lists the engine, and kvfabric status prints it.
            listed = wait_until(lambda: engines(files.http_url), timeout=30, what="the engine listed")
            assert len(listed) == 1
            e = listed[0]
            assert (e["engine"], e["host"], e["pid"], e["run_id"], e["policy"], e["state"], e["events"]) == (
                engine_id, socket.gethostname(), child.pid, "visible", "lru", CONNECTED, 0)
            assert e["vllm_version"] == version("vllm") and e["kvfabric_version"] == kvfabric.__version__
            assert e["num_blocks"] == 64 and e["block_size"] == 16
            assert abs(e["connected_since_ns"] / 1e9 - time.time()) < 300
            code, out, _ = status(capsys, "--url", files.http_url)
            assert code == 0, out
            header, titles, row = out.strip().splitlines()
            assert header == f"collector {files.http_url}, ok: 1 engine connected"
            assert titles.split()[:6] == ["ENGINE", "STATE", "HOST", "VLLM", "POLICY", "RUN"]
            assert row.split()[:6] == [engine_id, CONNECTED, socket.gethostname(), version("vllm"), "lru", "visible"]
            assert row.split()[-1] == "0"
            code, out, _ = status(capsys, "--url", files.http_url, "--format", "json")
            assert code == 0 and json.loads(out)["engines"][0]["engine"] == engine_id

            # It serves: its events so far grow (the same stream: connected since the start).
            child.stdin.write("\n")  # type: ignore[union-attr]
            child.stdin.flush()  # type: ignore[union-attr]
            read_until("SERVED")

            def counted_and_stored() -> dict[str, Any] | None:
                now = engines(files.http_url)[0]
                runs = {r["run_id"]: r for r in httpx.get(f"{files.http_url}/api/v1/runs").json()}
                stored = runs.get("visible", {}).get("events")
                return now if now["events"] > 0 and stored == now["events"] else None

            grown = wait_until(counted_and_stored, timeout=30, what="events counted and stored")
            assert (grown["stream_id"], grown["connections"], grown["connected_since_ns"]) == (
                e["stream_id"], 1, e["connected_since_ns"])

            # It stops: listed as disconnected (the forwarder ended its stream), and status says no engine is on.
            child.stdin.write("\n")  # type: ignore[union-attr]
            child.stdin.flush()  # type: ignore[union-attr]
            assert child.wait(timeout=60) == 0
            gone = wait_until(lambda: [x for x in engines(files.http_url) if x["state"] == DISCONNECTED],
                              timeout=30, what="the engine disconnected")
            assert gone[0]["ended_why"] == "the engine ended its stream" and gone[0]["ended_ns"] is not None
            code, out, _ = status(capsys, "--url", files.http_url)
            assert code == 1 and out.startswith(f"collector {files.http_url}, ok: 0 engines connected (1 disconnected)")
            assert DISCONNECTED in out.splitlines()[2]
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
            collector.stop()


def test_an_idle_stream_stays_listed_and_comes_back_after_a_collector_restart(
        capsys: pytest.CaptureFixture[str]) -> None:
    """A sink with nothing to send holds its connection: when the collector closes it for idleness the sink
    reconnects (the same stream: connected since its start), and a restarted collector lists it again within the
    sink's backoff. Behind a token, status needs it."""
    meta = {S.META_SCHEMA_VERSION: str(S.SCHEMA_VERSION), S.META_ENGINE: "idle/dp0", S.META_RUN_ID: "quiet",
            S.META_BLOCK_SIZE: "16", S.META_NUM_BLOCKS: "10", S.META_POLICY: "lru", S.META_VLLM_VERSION: "0.33.0"}
    with collector_files() as files:
        collector = files.process(idle_timeout_s=1.0, token="s3cret")
        collector.start()
        auth = {"Authorization": "Bearer s3cret"}
        sink = None
        try:
            code, out, err = status(capsys, "--url", files.http_url)
            assert code == 2 and err.strip() == (f"kvfabric status: the collector at {files.http_url} wants a bearer "
                                                 "token: pass --token or set $KVFABRIC_API_TOKEN")
            code, out, _ = status(capsys, "--url", files.http_url, "--token", "s3cret")
            assert code == 1 and "no engine has connected since this collector started" in out

            sink = UnixArrowSink(files.socket_path, EventBuffer(1000, 100), dict(meta), lambda n: (), flush_ms=20)
            sink.start()

            def listed() -> list[dict[str, Any]]:
                return httpx.get(f"{files.http_url}/api/v1/engines", headers=auth).json()

            first = wait_until(lambda: [e for e in listed() if e["state"] == CONNECTED], timeout=10,
                               what="the idle sink listed")[0]
            assert (first["engine"], first["events"], first["host"]) == ("idle/dp0", 0, None)  # no host sent
            again = wait_until(lambda: [e for e in listed() if e["connections"] >= 3], timeout=15,
                               what="reconnects after idle closes")[0]
            assert (again["stream_id"], again["connected_since_ns"]) == (first["stream_id"],
                                                                         first["connected_since_ns"])
            assert again["state"] in (CONNECTED, IDLE)
            code, out, _ = status(capsys, "--url", files.http_url, "--token", "s3cret")
            assert code == 0 and "idle/dp0" in out

            collector.stop()
            collector = files.process(token="s3cret")
            collector.start()
            back = wait_until(lambda: [e for e in listed() if e["state"] == CONNECTED], timeout=15,
                              what="the sink back after a collector restart")[0]
            assert back["stream_id"] == first["stream_id"]
        finally:
            if sink is not None:
                sink.close()
            collector.stop()


def test_status_without_a_collector_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    code, out, err = status(capsys, "--url", url, "--timeout", "2")
    assert code == 2 and not out
    assert len(err.strip().splitlines()) == 1 and err.startswith(f"kvfabric status: no collector answers at {url}: ")


def _meta(stream_id: str, engine: str = "e/dp0") -> StreamMeta:
    return StreamMeta(stream_id=stream_id, engine=engine, run_id="r", schema_version=S.SCHEMA_VERSION, block_size=16,
                      num_blocks=100, policy="lru", vllm_version="0.33.0", protocol=2)


def test_registry_states_counts_and_replacement() -> None:
    """idle = closed by the collector while the process at the other end lives; disconnected = ended by the
    engine's side, or its process is gone. A resent batch is counted once; a new stream of the same engine
    replaces its disconnected predecessor."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    reg = EngineRegistry(keep_ended=2)
    raw = {"kvfabric.host": "h", "kvfabric.pid": "123"}
    reg.opened(_meta("a"), raw, os.getpid())
    reg.received("a", 0, 10)
    reg.received("a", 1, 5)
    reg.received("a", 1, 5)  # resent after a reconnect
    row = reg.snapshot()[0]
    assert (row["state"], row["events"], row["batches"], row["host"], row["pid"]) == (CONNECTED, 15, 2, "h", 123)
    reg.closed("a", by_collector=True, why="closed after 300 s without a message")
    assert reg.snapshot()[0]["state"] == IDLE  # this process (the peer) lives
    reg.opened(_meta("b", "other"), raw, dead.pid)
    reg.closed("b", by_collector=True, why="closed after 300 s without a message")
    assert {r["stream_id"]: r["state"] for r in reg.snapshot()} == {"a": IDLE, "b": DISCONNECTED}
    reg.opened(_meta("c", "other"), raw, os.getpid())  # the engine "other" came back: its old stream goes
    assert [r["stream_id"] for r in reg.snapshot()] == ["c", "a"]
    reg.closed("c", by_collector=False, why="the engine ended its stream")
    reg.opened(_meta("d", "third"), raw, os.getpid())
    reg.closed("d", by_collector=False, why="the engine ended its stream")  # 3 ended, 2 kept: the oldest goes
    rows = reg.snapshot()
    assert {r["stream_id"] for r in rows} == {"c", "d"} and rows[0]["ended_ns"] >= rows[1]["ended_ns"]
    assert reg.counts() == {CONNECTED: 0, IDLE: 0, DISCONNECTED: 2}


def test_the_line_says_what_is_on_and_whether_a_collector_answers(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    missing = tmp_path / "none.sock"
    settings = load_hook_settings({"KVFABRIC_LIFECYCLE": "1", "KVFABRIC_SINK": f"unix://{missing}",
                                   "KVFABRIC_RUN_ID": "x"})
    inst = SimpleNamespace(metadata={S.META_ENGINE: "h/dp0", S.META_RUN_ID: "x"}, policy="lru")
    with caplog.at_level("INFO", logger="vllm.kvfabric"):
        line = plugin.announce(inst, settings)
    assert line.startswith(f"KVFabric {kvfabric.__version__} on engine h/dp0 (run x): recording on, policy lru, "
                           f"sink unix://{missing}, NO collector answers (No such file or directory)")
    assert [(r.name, r.levelname, r.getMessage()) for r in caplog.records] == [("vllm.kvfabric", "INFO", line)]

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(tmp_path / "up.sock"))
    listener.listen(1)
    try:
        up = load_hook_settings({"KVFABRIC_LIFECYCLE": "1", "KVFABRIC_SINK": f"unix://{tmp_path / 'up.sock'}"})
        assert plugin.collector_answer(up) == "collector answered (`kvfabric status` lists this engine)"
    finally:
        listener.close()
    jsonl = load_hook_settings({"KVFABRIC_LIFECYCLE": "1", "KVFABRIC_SINK": f"jsonl://{tmp_path / 'e.jsonl'}"})
    assert plugin.describe(inst, jsonl).endswith(f"sink jsonl://{tmp_path / 'e.jsonl'}, no collector (events go to "
                                                 "a file)")
    steering = load_hook_settings({"KVFABRIC_EVICTION_POLICY": "adaptive_aging"})
    assert "recording off (KVFABRIC_LIFECYCLE unset)" in plugin.describe(
        SimpleNamespace(metadata=inst.metadata, policy="adaptive_aging"), steering)
    held = SimpleNamespace(metadata=inst.metadata, policy="lru", steering=SimpleNamespace(hold=object()))
    assert ": recording off (KVFABRIC_LIFECYCLE unset), policy lru, cache-aware scheduling on, sink none" in \
        plugin.describe(held, steering)
    assert "cache-aware" not in plugin.describe(SimpleNamespace(**{**vars(held), "steering": SimpleNamespace(
        hold=None)}), steering)
    caplog.clear()
    with caplog.at_level("INFO", logger="vllm.kvfabric"):
        plugin.announce(None, settings)
    assert caplog.records[0].levelname == "WARNING" and "NOT installed" in caplog.records[0].getMessage()
