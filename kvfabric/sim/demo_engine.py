"""The demo's engine: its workload through vLLM's real scheduler on a CPU, observed in one of two ways.

* :func:`run_with_plugin`: the KVFabric plugin, loaded through vLLM's ``vllm.general_plugins`` entry point, streams
  its events to the collector's socket.
* :func:`run_with_kv_events`: no plugin; vLLM's own KV-event publisher (``--kv-events-config``, a ZMQ PUB socket
  and its replay socket) publishes what the scheduler's prefix cache stored and removed, for a collector started
  with ``--kv-events`` to subscribe to.

Both run on the calling thread and return the engine's own counters (:meth:`SimulatedEngine.summary`: evictions
and rebuilds vLLM's pool itself reported), which the demo compares with what the collector stored. Each takes an
``on_ready`` callback, called once the engine exists and before its first step, so a caller can wait for the
subscriber; the kv-events variant takes ``wait_stored`` to hold the publisher open until the collector has
everything (vLLM's shutdown closes its sockets without waiting, so what ZMQ still queued would be lost).
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

from tqdm import tqdm

from kvfabric.sim.harness import SimulatedEngine
from kvfabric.sim.publisher import Published, count_published, kv_events_config

Say = Callable[[str], None]
"""Where progress lines go (the demo prints them to stdout, as part of its report)."""

LOAD_NOTE = "  loading vLLM (about 10-15 s on 2 cores)..."


@contextlib.contextmanager
def quiet_stderr() -> Iterator[Callable[[], list[str]]]:
    """Send file descriptor 2 to a temporary file (torch logs from C++ and from handlers bound at import)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        lines: list[str] = []
        try:
            yield lambda: lines
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            lines.extend(tmp.read().decode(errors="replace").splitlines())


@contextlib.contextmanager
def environment(**values: str) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _build(blocks: int, say: Say, kv_events: tuple[str, str] | None = None, **kwargs: Any) -> SimulatedEngine:
    """The engine on ``blocks`` blocks; ``kv_events``: (endpoint, replay endpoint) of vLLM's ZMQ publisher."""
    say(LOAD_NOTE)
    # torch and vLLM print harmless CPU-only warnings at import (no CUDA runtime, no vllm._C): keep the report
    # readable; real errors still surface.
    with quiet_stderr() as noise:
        if kv_events is not None:
            kwargs["kv_events"] = kv_events_config(*kv_events)
        engine = SimulatedEngine.create(blocks, **kwargs)
    for line in noise():
        if "Traceback" in line or ("Error" in line and "vllm._C" not in line):
            print(line, file=sys.stderr)
    return engine


def _drive(engine: SimulatedEngine, items: list[Any]) -> None:
    # The progress bar is for a person watching: stderr, so stdout stays the report (and --json parses).
    with tqdm(total=len(items), unit="req", desc="  requests", leave=True, file=sys.stderr) as bar:
        done = 0

        def progress(_: Any) -> None:
            nonlocal done
            n = engine.stats.requests_finished
            if n != done:
                bar.update(n - done)
                done = n

        engine.run_until_done(progress)


def _vllm_env() -> dict[str, str]:
    return {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
            "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "ERROR")}


def run_with_plugin(sock: str, run_id: str, policy: str, items: list[Any], blocks: int, say: Say) -> dict[str, Any]:
    """Run ``items`` (the demo workload) on a pool of ``blocks`` blocks with the plugin streaming to ``sock``."""
    with environment(KVFABRIC_LIFECYCLE="1", KVFABRIC_SINK=f"unix://{sock}", KVFABRIC_RUN_ID=run_id,
                     KVFABRIC_EVICTION_POLICY=policy, **_vllm_env()):
        t0 = time.monotonic()
        engine = _build(blocks, say)  # build_scheduler loads vLLM's general plugins: ours included
        installation = getattr(engine.scheduler, "_kvfabric", None)
        if installation is None:
            raise RuntimeError("the kvfabric plugin did not install itself into vLLM's scheduler "
                               "(is the package installed, so that its vllm.general_plugins entry point exists?)")
        engine.add_workload(items)
        say(f"  vLLM ready in {time.monotonic() - t0:.1f} s; workload: {len(items)} requests on "
            f"{blocks} blocks x {engine.block_size} tokens")
        _drive(engine, items)
        installation.close()  # flush every event to the collector
        outlet = installation.outlet
        return {
            "engine": engine.summary(),
            "events_emitted": getattr(outlet, "expanded_events", 0),
            "rows_sent": getattr(outlet, "delivered_events", 0),
            "events_lost": outlet.lost_events,
        }


def run_with_kv_events(endpoint: str, replay: str, items: list[Any], blocks: int, say: Say, *,
                       on_ready: Callable[[Published], None],
                       wait_stored: Callable[[Published], None]) -> dict[str, Any]:
    """Run ``items`` on a pool of ``blocks`` blocks with vLLM's ZMQ KV-event publisher on ``endpoint`` (replays on
    ``replay``) and no plugin. ``on_ready(published)`` runs before the first step; ``wait_stored(published)`` after
    the last, before the publisher is shut down. Hashes are published as bytes
    (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``), so the collector stores the plugin's digests."""
    # KVFABRIC_LIFECYCLE=0 and no plugins loaded: this engine is observed through vLLM's events only.
    with environment(KVFABRIC_LIFECYCLE="0", VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES="0", **_vllm_env()):
        t0 = time.monotonic()
        engine = _build(blocks, say, (endpoint, replay), load_plugins=False)
        if getattr(engine.scheduler, "_kvfabric", None) is not None:
            raise RuntimeError("the kvfabric plugin installed itself into the scheduler of the kv-events demo")
        published = count_published(engine.scheduler)
        try:
            engine.add_workload(items)
            on_ready(published)
            say(f"  vLLM ready in {time.monotonic() - t0:.1f} s; workload: {len(items)} requests on "
                f"{blocks} blocks x {engine.block_size} tokens; KV events on {endpoint} (replay {replay})")
            _drive(engine, items)
            wait_stored(published)
        finally:
            engine.scheduler.shutdown()  # stops vLLM's publisher thread and closes its sockets
        return {"engine": engine.summary(), "published": vars(published)}
