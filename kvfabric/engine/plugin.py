"""The ``vllm.general_plugins`` entry point.

vLLM calls :func:`register` with no arguments in every process that loads plugins (the API server and, with the
spawn start method, each EngineCore) before any Scheduler exists. When KVFabric is off (no ``KVFABRIC_*``
setting asks for anything) it returns without touching vLLM. Otherwise it wraps ``Scheduler.__init__`` (which
also covers ``AsyncScheduler``) so each scheduler, once built, gets per-instance hooks in the process that owns it:
with fork, the EngineCore inherits the wrapped class and installs lazily there.

Visibly on: each scheduler the hook is installed on prints one line through vLLM's own logger, at INFO (vLLM's
default level), in the EngineCore's log: KVFabric's version, the engine, recording on or off, the policy, the sink,
and whether a collector answered on its socket (:func:`announce`). The API server process, which also loads the
plugin but builds no scheduler, prints nothing. With KVFabric off (no ``KVFABRIC_*`` setting) nothing is printed.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import kvfabric
from kvfabric.contract import protocol as P
from kvfabric.contract import schema as S
from kvfabric.engine.config import HookSettings, load_hook_settings

log = logging.getLogger("kvfabric.engine")

announce_log = logging.getLogger("vllm.kvfabric")
"""The logger of :func:`announce`: a child of vLLM's ``vllm`` logger, so vLLM's handler prints it in vLLM's format
at vLLM's level. ``kvfabric.engine`` has no handler in a vLLM process: its INFO lines are printed nowhere."""

PROBE_TIMEOUT_S = 1.0
"""Bound on the start-up check that a collector listens (one connect on a Unix socket: microseconds when it does,
an immediate error when nothing is there; the bound covers a listener whose backlog is full)."""

_MARK = "__kvfabric_wrapped__"


def register() -> None:
    """Entry point. Never raises: a broken plugin must not stop vLLM from serving."""
    try:
        settings = load_hook_settings()
        for warning in settings.warnings:
            log.warning("kvfabric: %s", warning)
        if not settings.active:
            return
        # (Imported here: vLLM loads this module in every process, and with KVFabric off nothing of vLLM's
        # scheduler needs importing; the import also keeps this module loadable without vLLM, for tests.)
        from vllm.v1.core.sched.scheduler import Scheduler

        wrap_scheduler_class(Scheduler)
    except Exception:
        log.exception("kvfabric: plugin registration failed; vLLM runs without KVFabric")


def wrap_scheduler_class(cls: type, settings: HookSettings | None = None) -> None:
    """Wrap ``cls.__init__`` once so every new scheduler gets the hook (idempotent)."""
    original = cls.__init__
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        try:
            # (Imported here, in the process that owns the scheduler: the API server process loads the plugin too
            # and never needs the engine's machinery, policies and compiled parts.)
            from kvfabric.engine.install import install

            # Settings are read here, in the process that owns the scheduler, not at registration time.
            active = settings if settings is not None else load_hook_settings()
            if active.active:
                announce(install(self, active), active)
        except Exception:
            log.exception("kvfabric: hook installation failed; this scheduler runs without KVFabric")
            announce_log.error("KVFabric %s: installation failed, this engine runs without it (traceback above)",
                               kvfabric.__version__)

    setattr(__init__, _MARK, True)
    __init__.__kvfabric_original__ = original  # type: ignore[attr-defined]
    cls.__init__ = __init__  # type: ignore[method-assign]


def unwrap_scheduler_class(cls: type) -> None:
    """Undo :func:`wrap_scheduler_class` (tests compare runs with and without the hook in one process)."""
    original = getattr(cls.__init__, "__kvfabric_original__", None)
    if original is not None:
        cls.__init__ = original  # type: ignore[method-assign]


def collector_answer(settings: HookSettings) -> str:
    """What the line says about the collector: whether one answered on the sink's socket (a connect, nothing sent:
    :func:`kvfabric.contract.protocol.probe_listener`), or that the sink has none."""
    sink = settings.sink
    if not settings.lifecycle or sink == "none":
        return "no collector (nothing is sent)"
    if sink.startswith("jsonl://"):
        return "no collector (events go to a file)"
    if not sink.startswith("unix://"):
        return "no collector"
    why = P.probe_listener(sink[len("unix://"):], PROBE_TIMEOUT_S)
    if why is None:
        return "collector answered (`kvfabric status` lists this engine)"
    return (f"NO collector answers ({why}): events wait, bounded, until one does; what cannot wait is counted "
            "as lost")


def describe(installation: Any, settings: HookSettings) -> str:
    """The one line for an engine (see the module docstring)."""
    version = kvfabric.__version__
    if installation is None:
        return (f"KVFabric {version}: NOT installed on this engine: it has no prefix-caching block pool (is "
                "--enable-prefix-caching off?)")
    meta = installation.metadata
    recording = "recording on" if settings.lifecycle else "recording off (KVFABRIC_LIFECYCLE unset)"
    sink = settings.sink if settings.lifecycle else "none"
    # The hold is named only where it attached (it needs the scheduler), not where it was merely asked for.
    hold = getattr(getattr(installation, "steering", None), "hold", None)
    scheduling = ", cache-aware scheduling on" if hold is not None else ""
    return (f"KVFabric {version} on engine {meta[S.META_ENGINE]} (run {meta[S.META_RUN_ID]}): {recording}, "
            f"policy {installation.policy}{scheduling}, sink {sink}, {collector_answer(settings)}")


def announce(installation: Any, settings: HookSettings) -> str:
    """Log :func:`describe`'s line through vLLM's logger (a warning when nothing was installed); returns it.
    Never raises: it runs in vLLM's scheduler construction."""
    try:
        line = describe(installation, settings)
        announce_log.log(logging.WARNING if installation is None else logging.INFO, "%s", line)
        return line
    except Exception:
        log.exception("kvfabric: could not describe the installation")
        return ""
