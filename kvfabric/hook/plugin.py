"""The ``vllm.general_plugins`` entry point.

vLLM calls :func:`register` with no arguments in every process that loads plugins (the API server and, with the
spawn start method, each EngineCore) before any Scheduler exists. When KVFabric is off (no ``KVFABRIC_*``
setting asks for anything) it returns without touching vLLM. Otherwise it wraps ``Scheduler.__init__`` (which
also covers ``AsyncScheduler``) so each scheduler, once built, gets per-instance hooks in the process that owns it:
with fork, the EngineCore inherits the wrapped class and installs lazily there.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from kvfabric.config import HookSettings, load_hook_settings

log = logging.getLogger("kvfabric.hook")

_MARK = "__kvfabric_wrapped__"


def register() -> None:
    """Entry point. Never raises: a broken plugin must not stop vLLM from serving."""
    try:
        settings = load_hook_settings()
        for warning in settings.warnings:
            log.warning("kvfabric: %s", warning)
        if not settings.active:
            return
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
            from kvfabric.hook.install import install

            # Settings are read here, in the process that owns the scheduler, not at registration time.
            active = settings if settings is not None else load_hook_settings()
            if active.active:
                install(self, active)
        except Exception:
            log.exception("kvfabric: hook installation failed; this scheduler runs without KVFabric")

    setattr(__init__, _MARK, True)
    __init__.__kvfabric_original__ = original  # type: ignore[attr-defined]
    cls.__init__ = __init__  # type: ignore[method-assign]


def unwrap_scheduler_class(cls: type) -> None:
    """Undo :func:`wrap_scheduler_class` (tests compare runs with and without the hook in one process)."""
    original = getattr(cls.__init__, "__kvfabric_original__", None)
    if original is not None:
        cls.__init__ = original  # type: ignore[method-assign]
