"""Who may reach the collector (issue #9 defect 8): the HTTP bind, the connecting uid on the socket, the socket's
directory, and the default socket path. The sink's own check of the listener is in tests/forwarder/test_sinks.py."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import pytest
from support.collector_testkit import (
    bulk_batches,
    collector_files,
    free_port,
    meta,
    metric,
    scrape,
    send_stream,
    stream_bytes,
    wait_until,
)

from kvfabric.collector import wait_ready
from kvfabric.engine.config import default_socket_path

NOBODY = 65534


def _collector_argv(files, *extra: str) -> list[str]:
    return [sys.executable, "-m", "kvfabric.collector", "--db", files.db_path, "--socket", files.socket_path,
            "--port", str(files.port), *extra]


def test_a_non_loopback_bind_without_a_token_is_refused() -> None:
    """Before: ``--host 0.0.0.0`` without a token served every run's data to the network, silently."""
    with collector_files() as files:
        env = {k: v for k, v in os.environ.items() if k != "KVFABRIC_API_TOKEN"}
        out = subprocess.run(_collector_argv(files, "--host", "0.0.0.0"), capture_output=True, text=True,
                             timeout=60, env=env)
        assert out.returncode == 2
        lines = [x for x in out.stderr.splitlines() if "could not start" in x]
        assert len(lines) == 1 and "not a loopback address and no token is set" in lines[0]
        assert not os.path.exists(files.socket_path)  # refused before anything was opened


@pytest.mark.parametrize("how", ["token", "explicit-flag"])
def test_a_non_loopback_bind_starts_with_a_token_or_an_explicit_flag(how: str) -> None:
    with collector_files() as files:
        env = {k: v for k, v in os.environ.items() if k != "KVFABRIC_API_TOKEN"}
        extra = ["--host", "0.0.0.0"]
        if how == "token":
            env["KVFABRIC_API_TOKEN"] = "t0ken"
        else:
            extra.append("--allow-remote-without-token")
        with open(files.log_path, "wb") as log:
            proc = subprocess.Popen(_collector_argv(files, *extra), stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            wait_ready(files.socket_path, files.http_url, 60, proc=proc)
        finally:
            proc.terminate()
            proc.wait(30)


def test_a_peer_of_another_uid_is_refused_even_if_the_socket_mode_lets_it_in() -> None:
    """SO_PEERCRED on the collector side: a chmod/umask mistake on the socket does not open the collector to other
    users. Unless --allow-uid names them."""
    if os.geteuid() != 0:
        pytest.skip("needs root to connect as another user")
    with collector_files() as files:
        data = stream_bytes(meta("intruder", "run-intruder", "e0"), bulk_batches("run-intruder", "e0", 2, 10))
        for allow in (False, True):
            extra = {"allow_uids": (str(NOBODY),)} if allow else {}
            with files.process(**extra):
                for d in (files.root, os.path.dirname(files.socket_path)):
                    os.chmod(d, 0o755)
                os.chmod(files.socket_path, 0o666)  # the mistake
                _send_as(NOBODY, files.socket_path, data)
                url = files.http_url
                if allow:
                    wait_until(lambda u=url: _runs(u).get("run-intruder") == 20, what="allowed uid stored")
                else:
                    wait_until(lambda u=url: metric(scrape(httpx.get(u + "/metrics").text),
                                                    "kvfabric_connections_refused_total",
                                                    reason="peer_not_allowed") == 1, what="refusal counted")
                    time.sleep(0.3)
                    assert "run-intruder" not in _runs(url)
                    assert "uid 65534 may not stream into this collector" in files.log()
                    # Its own user still streams.
                    send_stream(files.socket_path, meta("owner", "run-owner", "e0"),
                                bulk_batches("run-owner", "e0", 1, 10))
                    wait_until(lambda u=url: _runs(u).get("run-owner") == 10, what="owner stored")


def _runs(url: str) -> dict[str, int]:
    return {r["run_id"]: r["events"] for r in httpx.get(url + "/api/v1/runs").json()}


def _send_as(uid: int, path: str, data: bytes) -> None:
    pid = os.fork()
    if pid == 0:
        try:
            os.setgid(uid)
            os.setuid(uid)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(path)
                try:
                    s.sendall(data)
                except OSError:
                    pass
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def test_a_socket_directory_others_can_write_is_refused() -> None:
    with collector_files() as files:
        shared = os.path.join(files.root, "shared")
        os.makedirs(shared)
        os.chmod(shared, 0o777)  # anyone could replace the socket
        argv = [sys.executable, "-m", "kvfabric.collector", "--db", files.db_path, "--socket",
                os.path.join(shared, "kvf.sock"), "--port", str(free_port())]
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and "is writable by other users" in out.stderr


def test_the_default_socket_path_is_in_a_private_directory(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """Before: ``/tmp/kvfabric.sock``, where any local user could listen first."""
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    path = default_socket_path()
    assert path == f"/tmp/kvfabric-{os.geteuid()}/kvfabric.sock"
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert default_socket_path() == str(tmp_path / "kvfabric" / "kvfabric.sock")
    other = tmp_path / "not-mine"
    other.mkdir()
    if os.geteuid() == 0:
        os.chown(other, NOBODY, NOBODY)  # a runtime dir of another user is not used
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(other))
        assert default_socket_path() == path
