"""Starting and stopping the server under test for ``kvfabric ab`` (and the soak benchmark).

The server is a child process in a session of its own (``start_new_session``), so stopping it reaches the whole
tree it started (vLLM's EngineCore, the hook's forwarder) through its process group, and nothing else. It is
ready when ``/v1/models`` answers 200. Two kinds:

* ``sim-serve`` (default): ``python -m kvfabric.cli sim-serve`` with the scenario's model shape and capacity;
* ``--serve-cmd``: any command line (a real ``vllm serve``) with placeholders filled in: ``{port}``, ``{policy}``,
  ``{run_id}``, ``{socket}``, ``{kv_blocks}``, ``{block_size}``, ``{max_model_len}``, ``{model}``. The KVFabric
  settings also go into its environment (``KVFABRIC_EVICTION_POLICY``, ``KVFABRIC_CACHE_AWARE_SCHEDULING``,
  ``KVFABRIC_LIFECYCLE=1``, ``KVFABRIC_SINK``, ``KVFABRIC_RUN_ID``), so a plain ``vllm serve`` loads the plugin
  configured for the arm.

An arm is named by its configuration: an eviction policy, or ``POLICY+hold`` for the policy with cache-aware
scheduling on (:mod:`kvfabric.engine.steering.hold`); see :func:`split_arm`.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from kvfabric.engine.steering.hold import parse_summary

__all__ = ["HOLD_SUFFIX", "ServerProcess", "ServerSpecError", "hold_summary", "process_tree", "serve_command",
           "split_arm"]

PLACEHOLDERS = ("port", "policy", "run_id", "socket", "kv_blocks", "block_size", "max_model_len", "model")
HOLD_SUFFIX = "+hold"


def hold_summary(log_path: str | Path | None) -> dict[str, int] | None:
    """What cache-aware scheduling held in one server's life, from its log: ``{"requests", "steps"}``, or None
    when the log has no such line (no hold attached, or it never held and the engine died before vLLM shut its
    scheduler down)."""
    if log_path is None:
        return None
    try:
        text = Path(log_path).read_text(errors="replace")
    except OSError:
        return None
    return parse_summary(text)


def split_arm(name: str) -> tuple[str, bool]:
    """An arm's configuration from its name: (eviction policy, cache-aware scheduling on). ``POLICY+hold`` turns the
    hold on; any other name is the policy alone, hold off. The policy is not checked here (callers know the list)."""
    if name.endswith(HOLD_SUFFIX):
        return name[: -len(HOLD_SUFFIX)], True
    return name, False


class ServerSpecError(ValueError):
    """A --serve-cmd that cannot be used (unknown placeholder, empty)."""


@dataclass(frozen=True)
class ArmSettings:
    """What one A/B arm's server must be told."""

    port: int
    policy: str  # the arm's name: a policy, or POLICY+hold (split_arm)
    run_id: str
    socket: str
    kv_blocks: int
    block_size: int
    max_model_len: int
    model: str
    latency_scale: float = 1.0
    host: str = "127.0.0.1"

    @property
    def eviction_policy(self) -> str:
        return split_arm(self.policy)[0]

    def kvfabric_env(self) -> dict[str, str]:
        """Every KVFabric setting an arm differs by, set both ways (an arm never inherits the hold from the
        environment ``kvfabric ab`` runs in)."""
        policy, hold = split_arm(self.policy)
        return {
            "KVFABRIC_EVICTION_POLICY": policy,
            "KVFABRIC_CACHE_AWARE_SCHEDULING": "1" if hold else "0",
            "KVFABRIC_LIFECYCLE": "1",
            "KVFABRIC_SINK": f"unix://{self.socket}",
            "KVFABRIC_RUN_ID": self.run_id,
        }


def serve_command(arm: ArmSettings, serve_cmd: str | None) -> list[str]:
    """The argv that starts ``arm``'s server (sim-serve unless ``serve_cmd`` is given)."""
    if serve_cmd is None:
        return [
            sys.executable, "-m", "kvfabric.cli", "sim-serve",
            "--model", arm.model, "--kv-blocks", str(arm.kv_blocks), "--block-size", str(arm.block_size),
            "--max-model-len", str(arm.max_model_len), "--policy", arm.eviction_policy,
            "--collector-socket", arm.socket, "--run-id", arm.run_id, "--host", arm.host, "--port", str(arm.port),
            "--latency-scale", repr(arm.latency_scale),
        ]
    # {policy} is the eviction policy alone: it goes where a policy name goes (the hold travels in the environment).
    values = {k: str(getattr(arm, k)) for k in PLACEHOLDERS} | {"policy": arm.eviction_policy}
    try:
        text = serve_cmd.format(**values)
    except (KeyError, IndexError, ValueError) as exc:
        raise ServerSpecError(f"--serve-cmd: bad placeholder {exc} (known: "
                              + ", ".join("{" + k + "}" for k in PLACEHOLDERS) + ")") from None
    argv = shlex.split(text)
    if not argv:
        raise ServerSpecError("--serve-cmd is empty")
    return argv


def check_serve_cmd(serve_cmd: str) -> None:
    """Raise :class:`ServerSpecError` now rather than after the first arm."""
    dummy = ArmSettings(port=1, policy="lru", run_id="r", socket="/s", kv_blocks=2, block_size=16, max_model_len=16,
                        model="m")
    serve_command(dummy, serve_cmd)
    if "{port}" not in serve_cmd:
        raise ServerSpecError("--serve-cmd must contain {port} (each arm's server listens on a port ab chooses)")


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (Linux ``/proc/<pid>/task/<tid>/children``), parents first."""
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop(0)
        out.append(p)
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{p}/task/{tid}/children") as fh:
                    todo.extend(int(c) for c in fh.read().split())
            except OSError:
                continue
    return out


def process_stats(pid: int) -> dict[str, float | int | str] | None:
    """``comm``, CPU seconds (user + system), RSS bytes and open file descriptors of ``pid`` (Linux /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            stat = fh.read()
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        ticks = os.sysconf("SC_CLK_TCK")
        cpu = (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
        rss = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            cmdline = fh.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except (OSError, ValueError, IndexError):
        return None
    return {"pid": pid, "comm": comm, "cmdline": cmdline[:200], "cpu_s": cpu, "rss_bytes": rss, "fds": fds}


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2.0) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


class ServerProcess:
    """A server child process group. Context manager: started (and ready) on enter, stopped on exit."""

    def __init__(self, argv: list[str], *, url: str, env: dict[str, str] | None = None, log_path: str | None = None,
                 ready_timeout: float = 600.0) -> None:
        self.argv = argv
        self.url = url.rstrip("/")
        self.env = env
        self.log_path = log_path
        self.ready_timeout = ready_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.ready_s: float | None = None
        self._t0 = 0.0
        self._log: IO[bytes] | None = None

    def launch(self) -> ServerProcess:
        """Spawn the server without waiting for it (see :meth:`wait_ready`)."""
        if self.log_path is not None:
            Path(self.log_path).parent.mkdir(parents=True, exist_ok=True)
            self._log = open(self.log_path, "ab")
        self._t0 = time.monotonic()
        self.proc = subprocess.Popen(
            self.argv, stdin=subprocess.DEVNULL, stdout=self._log or subprocess.DEVNULL, stderr=subprocess.STDOUT,
            env=self.env, start_new_session=True,
        )
        return self

    def wait_ready(self) -> ServerProcess:
        """Wait until ``/v1/models`` answers; raise RuntimeError (with the log's tail) if the server dies, or
        TimeoutError ``ready_timeout`` after the launch (the process group is stopped either way)."""
        assert self.proc is not None, "not launched"
        try:
            while not _http_ok(f"{self.url}/v1/models"):
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited with code {self.proc.returncode} before it was ready"
                                       + self._tail())
                if time.monotonic() - self._t0 > self.ready_timeout:
                    raise TimeoutError(f"server not ready within {self.ready_timeout:g} s" + self._tail())
                time.sleep(0.5)
        except BaseException:
            self.stop(timeout=10.0)
            raise
        self.ready_s = time.monotonic() - self._t0
        return self

    def start(self) -> ServerProcess:
        """:meth:`launch` then :meth:`wait_ready`."""
        return self.launch().wait_ready()

    def _tail(self, n: int = 12) -> str:
        if self.log_path is None or not Path(self.log_path).exists():
            return ""
        lines = Path(self.log_path).read_text(errors="replace").splitlines()[-n:]
        return "; log tail:\n  " + "\n  ".join(lines)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def stats(self) -> list[dict[str, float | int | str]]:
        """:func:`process_stats` of every live process of the server's tree (server first)."""
        if self.proc is None or self.proc.poll() is not None:
            return []
        return [s for p in process_tree(self.proc.pid) if (s := process_stats(p)) is not None]

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM the process group we created, wait; SIGKILL the group past ``timeout``."""
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                proc.wait()
        # vLLM's children normally die with it; make sure no member of our group outlives the arm.
        deadline = time.monotonic() + 5.0
        while self._group_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        if self._group_alive():
            self._signal_group(signal.SIGKILL)
        if self._log is not None:
            self._log.close()
            self._log = None
        return proc.returncode

    def _signal_group(self, sig: int) -> None:
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, sig)  # the group id is our child's pid (start_new_session)
        except ProcessLookupError:
            pass

    def _group_alive(self) -> bool:
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
