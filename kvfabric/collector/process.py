"""Running a collector as a child process: start it, know when it is ready, stop it with a flush.

Used by ``kvfabric demo``/``ab``, the benchmarks and the tests, so they all exercise the real process form
(``python -m kvfabric.collector``) including its SIGTERM handling.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import IO

from kvfabric.collector.config import TOKEN_ENV, CollectorConfig


def _socket_accepts(path: str) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(1.0)
        s.connect(path)
        return True  # the collector sees a connection that sends nothing: it ignores it (debug log only)
    except OSError:
        return False
    finally:
        s.close()


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/healthz", timeout=1.0) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def wait_ready(
    socket_path: str,
    http_url: str | None,
    timeout: float = 30.0,
    *,
    proc: subprocess.Popen[bytes] | None = None,
) -> None:
    """Block until the collector's socket accepts connections and (if ``http_url``) ``/healthz`` answers 200.

    Raises TimeoutError after ``timeout`` seconds, or RuntimeError as soon as ``proc`` (if given) has exited.
    """
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"collector exited with code {proc.returncode} before it was ready")
        if _socket_accepts(socket_path) and (http_url is None or _http_ok(http_url)):
            return
        if time.monotonic() >= deadline:
            raise TimeoutError(f"collector not ready within {timeout:g} s (socket {socket_path}, http {http_url})")
        time.sleep(0.05)


class CollectorProcess:
    """A ``python -m kvfabric.collector`` child. Context manager: started on enter, SIGTERM'ed on exit."""

    def __init__(
        self,
        config: CollectorConfig,
        *,
        log_path: str | None = None,
        env: dict[str, str] | None = None,
        python: str = sys.executable,
        ready_timeout: float = 30.0,
    ) -> None:
        if config.http and config.port == 0:
            raise ValueError("a child collector needs a fixed port (wait_ready must know where to look)")
        self.config = config
        self.log_path = log_path
        self.env = env
        self.python = python
        self.ready_timeout = ready_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def http_url(self) -> str | None:
        host = f"[{self.config.host}]" if ":" in self.config.host else self.config.host
        return f"http://{host}:{self.config.port}" if self.config.http else None

    def start(self) -> CollectorProcess:
        """Spawn the child and wait until it is ready (see :func:`wait_ready`)."""
        env = dict(os.environ if self.env is None else self.env)
        token = self.config.token
        if token is not None:
            env[TOKEN_ENV] = token  # not on argv, where every local user could read it
        if self.log_path is not None:
            self._log = open(self.log_path, "ab")  # closed in stop()/kill()
        self.proc = subprocess.Popen(
            [self.python, "-m", "kvfabric.collector", *self.config.to_argv()],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT if self._log is not None else None,
            env=env,
        )
        try:
            wait_ready(self.config.socket_path, self.http_url, self.ready_timeout, proc=self.proc)
        except BaseException:
            self.kill()
            raise
        return self

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM (the collector flushes everything received), wait; SIGKILL only past ``timeout``."""
        assert self.proc is not None, "not started"
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._close_log()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._close_log()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> CollectorProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.stop()
