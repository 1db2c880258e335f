"""The README's "Troubleshooting" section, symptom by symptom, reproduced with real parts: vLLM's real Scheduler on
CPU with the hook, the forwarder's real Unix sink, a real collector process on a real socket.

Each test shows the symptom *and* the signal the README tells an operator to look at (the engine's log line,
the sink's log line and failure reason, ``/metrics``, REST, ``kvfabric status``), so a README that names a signal
the product does not give fails here. The one symptom that needs vLLM 0.26 (unstable block hashes without
``PYTHONHASHSEED``) is a documented command in the README instead.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.collector_testkit import collector_files, hook_row, hook_sink, metric, scrape, stored, wait_until

from kvfabric import cli
from kvfabric.contract import schema as S
from kvfabric.engine import plugin
from kvfabric.engine.config import load_hook_settings

TESTS = str(Path(__file__).resolve().parent)

# ------------------------------------------------------------------------------- hit rate reads 0 (vLLM side)


def _request(rid: str, tokens: list[int], block_size: int, salt: str | None = None) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    return Request(request_id=rid, prompt_token_ids=tokens,
                   sampling_params=SamplingParams(max_tokens=2, ignore_eos=True, detokenize=False),
                   pooling_params=None, cache_salt=salt, block_hasher=get_request_block_hasher(block_size, sha256))


def lookups(waves: list[list[tuple[str, list[int], str | None]]], *, block_size: int = 16) -> dict[str, dict]:
    """Run ``waves`` of (request id, prompt, cache_salt) one wave after the other through vLLM's real Scheduler
    with the hook recording (as the plugin installs it); the hook's ``prefix_lookup`` row of each request."""
    from kvfabric.engine.install import build_hook
    from kvfabric.sim.harness import SimulatedEngine, build_scheduler

    sched = build_scheduler(64, block_size=block_size, max_model_len=1024, load_plugins=False)
    settings = load_hook_settings({"KVFABRIC_LIFECYCLE": "1", "KVFABRIC_SINK": "none"})
    inst = build_hook(sched.kv_cache_manager, settings, scheduler=sched, outlet="local", engine="trouble")
    assert inst is not None and inst.metadata[S.META_BLOCK_SIZE] == str(block_size)
    engine = SimulatedEngine(sched, "qwen")
    for wave in waves:
        for rid, tokens, salt in wave:
            engine.add_request(_request(rid, tokens, block_size, salt))
        engine.run_until_done(max_steps=1000)
    assert inst.recorder.errors == 0
    rows = [dict(zip(S.EMIT_COLUMNS, row, strict=True)) for row in inst.drain()]
    return {r["request_id"]: r for r in rows if r["event"] == S.PREFIX_LOOKUP}


PROMPT = list(range(1000, 1000 + 4 * 16 + 5))  # four full 16-token blocks and a partial one


@pytest.mark.vllm
def test_hit_rate_0_with_a_salt_per_request() -> None:
    """A ``cache_salt`` that differs per request (a per-request or per-user salt where one per tenant was meant):
    vLLM hashes the salt into every block, so the same prompt never hits. The rows say it in ``tenant``."""
    got = lookups([[("a", PROMPT, "tenant-1")],
                   [("same-salt", PROMPT, "tenant-1"), ("other-salt", PROMPT, "req-2"), ("no-salt", PROMPT, None)]])
    assert got["same-salt"]["hit_tokens"] == 4 * 16  # the control: one salt, the prompt's full blocks hit
    assert got["other-salt"]["hit_tokens"] == 0 and got["no-salt"]["hit_tokens"] == 0
    assert [got[r]["tenant"] for r in ("a", "same-salt", "other-salt", "no-salt")] == [
        "tenant-1", "tenant-1", "req-2", None]


@pytest.mark.vllm
@pytest.mark.parametrize(("block_size", "hit"), [(16, 32), (64, 0)])
def test_hit_rate_0_when_the_shared_prefix_is_shorter_than_a_block(block_size: int, hit: int) -> None:
    """Requests sharing a 40-token prefix: with 16-token blocks the two full blocks inside it hit; with 64-token
    blocks (a larger ``--block-size``, or a model whose attention forces one) no full block is shared: 0. The
    engine's block size is in the stream metadata (``kvfabric status``, ``GET /api/v1/engines``: ``block_size``)."""
    shared = list(range(7000, 7040))
    got = lookups([[("first", shared + list(range(100, 130)), None)],
                   [("second", shared + list(range(200, 230)), None)]], block_size=block_size)
    assert got["second"]["prompt_tokens"] == 70 and got["second"]["hit_tokens"] == hit


@pytest.mark.vllm
def test_prefix_caching_off_gives_a_warning_line_and_no_hook(monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    """With prefix caching off there is no prefix-caching pool: the plugin installs nothing and says so in vLLM's
    log (a WARNING of ``vllm.kvfabric``); with it on, the usual INFO line."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from kvfabric.sim.harness import build_scheduler

    monkeypatch.setenv("KVFABRIC_LIFECYCLE", "1")
    monkeypatch.setenv("KVFABRIC_SINK", "none")
    monkeypatch.setenv("KVFABRIC_RUN_ID", "trouble")
    was_wrapped = getattr(Scheduler.__init__, "__kvfabric_wrapped__", False)
    plugin.wrap_scheduler_class(Scheduler)  # what the plugin's register() does
    try:
        with caplog.at_level(logging.INFO, logger="vllm.kvfabric"):
            off = build_scheduler(16, enable_prefix_caching=False, load_plugins=False)
            on = build_scheduler(16, enable_prefix_caching=True, load_plugins=False)
    finally:
        if not was_wrapped:
            plugin.unwrap_scheduler_class(Scheduler)
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "vllm.kvfabric"]
    assert len(lines) == 2, lines
    assert lines[0][0] == "WARNING" and "NOT installed" in lines[0][1] and "--enable-prefix-caching" in lines[0][1]
    assert lines[1][0] == "INFO" and "(run trouble): recording on" in lines[1][1]
    assert getattr(off, "_kvfabric", None) is None and getattr(on, "_kvfabric", None) is not None
    on._kvfabric.close()


# ------------------------------------------------------------------ collector unreachable, events lost


def test_collector_unreachable_then_events_lost_are_counted(caplog: pytest.LogCaptureFixture,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """No collector on the socket: the engine's line says ``NO collector answers``, ``kvfabric status`` exits 2,
    the sink logs ``failed (unreachable)`` once naming the socket, events wait in the bounded buffer and the rest
    are dropped. Once a collector listens, what waited is stored and the drop reaches ``/metrics``
    (``kvfabric_sink_dropped_events_total``) and ``GET /api/v1/fleet`` (``sink_dropped_events``)."""
    with collector_files() as files:
        settings = load_hook_settings({"KVFABRIC_LIFECYCLE": "1", "KVFABRIC_SINK": f"unix://{files.socket_path}"})
        assert plugin.collector_answer(settings).startswith("NO collector answers (No such file or directory)")
        code = cli.main(["status", "--url", files.http_url, "--timeout", "2"])
        assert code == 2 and "no collector answers at" in capsys.readouterr().err

        with caplog.at_level(logging.WARNING, logger="kvfabric.forwarder"):
            sink = hook_sink(files.socket_path, "unreachable", capacity=200, batch_events=50, flush_ms=20)
            try:
                for i in range(1000):
                    sink.buffer.append(hook_row(i, "unreachable", "e0"))
                wait_until(lambda: sink.failures.get("unreachable", 0) >= 1, timeout=10, what="a failed connect")
                assert sink.buffer.dropped == 800 and sink.accounted_events() == 0
                lines = [r.getMessage() for r in caplog.records if r.name == "kvfabric.forwarder"]
                assert len([x for x in lines if "failed (unreachable)" in x and files.socket_path in x]) == 1
                proc = files.process()
                proc.start()
                try:
                    wait_until(lambda: sink.accounted_events() == 1000, timeout=30, what="delivery once it is up")
                    samples = scrape(httpx.get(f"{files.http_url}/metrics", timeout=10).text)
                    assert metric(samples, "kvfabric_sink_dropped_events_total", run="unreachable",
                                  engine="e0") == 800
                    fleet = httpx.get(f"{files.http_url}/api/v1/fleet", timeout=10).json()
                    assert fleet["totals"]["sink_dropped_events"] == 800
                    assert stored(files.http_url, "unreachable") == 201  # 200 events + the sink_dropped row
                finally:
                    proc.stop()
            finally:
                sink.close()


# ------------------------------------------------------------------------------ permission denied on the socket

SINK_PROCESS = textwrap.dedent(
    """
    import json, logging, os, sys, time
    sys.path.insert(0, sys.argv[1])
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(name)s %(levelname)s %(message)s")
    from support.collector_testkit import hook_row, hook_sink

    path, run, n = sys.argv[2], sys.argv[3], int(sys.argv[4])
    if sys.argv[5] == "other-user":  # imports done: become uid 65534, group 0 (the interpreter may be root's)
        os.setgroups([])
        os.setgid(0)
        os.setuid(65534)
    sink = hook_sink(path, run, capacity=n, batch_events=50, flush_ms=20)
    for i in range(n):
        sink.buffer.append(hook_row(i, run, "e0"))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not sink.failures and sink.accounted_events() < n:
        time.sleep(0.05)
    sink.close(timeout=2)
    print(json.dumps({"failures": sink.failures, "lost": sink.lost_events, "accounted": sink.accounted_events()}))
    """
)


def run_engine_side(socket_path: str, run_id: str, n: int, as_other_user: bool) -> tuple[dict, str]:
    """The forwarder's Unix sink in a process of its own (as uid 65534, group 0, where this test runs as root: an
    engine running as another user than the collector); its counters, and its log."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFABRIC_")}
    who = "other-user" if as_other_user else "same-user"
    done = subprocess.run([sys.executable, "-c", SINK_PROCESS, TESTS, socket_path, run_id, str(n), who], env=env,
                          capture_output=True, text=True, timeout=60, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_permission_denied_on_the_socket_is_one_clear_line_and_counted_loss() -> None:
    """An engine that may not open the collector's socket (another user, the socket's directory private to the
    collector): ``Permission denied`` in the engine's line and the sink's, reason ``permission``, every event
    counted as lost, nothing stored. The fix the README gives (a group-accessible socket, ``--socket-mode 660``, in
    a directory of that group) lets the same engine stream. As a non-root user the test denies by the directory's
    mode instead (root passes any mode), which gives the engine the same error."""
    root = os.geteuid() == 0
    with collector_files() as files:
        socket_dir = os.path.dirname(files.socket_path)
        os.makedirs(socket_dir, mode=0o700)
        if root:
            os.chmod(files.root, 0o711)  # the test's own directory: passable, as /run is
        proc = files.process(socket_mode=0o660)
        proc.start()
        try:
            if not root:
                os.chmod(socket_dir, 0o000)
            got, log = run_engine_side(files.socket_path, "denied", 300, as_other_user=root)
            assert got["failures"].get("permission", 0) >= 1 and set(got["failures"]) == {"permission"}, got
            assert got["lost"] == 300 and got["accounted"] == 0
            first = [x for x in log.splitlines() if "failed (permission)" in x]
            assert len(first) == 1 and "Permission denied" in first[0] and files.socket_path in first[0], log
            assert stored(files.http_url, "denied") == 0

            os.chmod(socket_dir, 0o750)  # the fix: the socket's group (gid 0 here) may pass its directory
            got, log = run_engine_side(files.socket_path, "allowed", 300, as_other_user=root)
            assert got == {"failures": {}, "lost": 0, "accounted": 300}, (got, log)
            wait_until(lambda: stored(files.http_url, "allowed") == 300, timeout=20, what="the events stored")
        finally:
            os.chmod(socket_dir, 0o700)
            proc.stop()


def test_the_engine_line_names_a_denied_socket(tmp_path: Path) -> None:
    """What the engine's own line says when its socket cannot be opened (checked at start, one connect)."""
    if os.geteuid() == 0:
        # root passes any mode: the probe then runs as uid 65534 against a socket in a private directory
        script = ("import os, sys; from kvfabric.engine import plugin; from kvfabric.engine.config import "
                  "load_hook_settings as L; s = L({'KVFABRIC_LIFECYCLE': '1', 'KVFABRIC_SINK': 'unix://' + "
                  "sys.argv[1]}); os.setgroups([]); os.setgid(65534); os.setuid(65534); "
                  "print(plugin.collector_answer(s))")
        with collector_files() as files:
            os.makedirs(os.path.dirname(files.socket_path), mode=0o700)
            os.chmod(files.root, 0o711)
            proc = files.process()
            proc.start()
            try:
                line = subprocess.run([sys.executable, "-c", script, files.socket_path], capture_output=True,
                                      text=True, timeout=60, check=True).stdout.strip()
            finally:
                proc.stop()
    else:
        private = tmp_path / "private"
        private.mkdir(mode=0o700)
        settings = load_hook_settings({"KVFABRIC_LIFECYCLE": "1", "KVFABRIC_SINK": f"unix://{private}/k.sock"})
        private.chmod(0o000)
        try:
            line = plugin.collector_answer(settings)
        finally:
            private.chmod(0o700)
    assert line.startswith("NO collector answers (Permission denied)"), line
