"""Test helpers: a real ``kvfabric sim-serve`` process (vLLM's OpenAI server on CPU) on a free port."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvfabric.bench.servers import ServerProcess


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def sim_server(log_dir: Path, *args: str, env: dict[str, str] | None = None) -> Iterator[ServerProcess]:
    """``python -m kvfabric.cli sim-serve --port P *args`` until ready; stopped (its whole group) on exit.

    The environment is this process's without ``KVFABRIC_*`` (plus ``env``), so only the options configure the hook.
    """
    port = free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVFABRIC_")}
    server = ServerProcess(
        [sys.executable, "-m", "kvfabric.cli", "sim-serve", "--port", str(port), *args],
        url=f"http://127.0.0.1:{port}", env={**base, **(env or {})}, log_path=str(log_dir / "sim-serve.log"),
        ready_timeout=240.0,
    )
    with server:
        yield server
