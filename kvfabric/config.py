"""Settings read from the environment (a vLLM general plugin receives no arguments).

Unset ``KVFABRIC_LIFECYCLE`` and ``KVFABRIC_EVICTION_POLICY`` (or ``lru``) means the plugin installs nothing at
all and vLLM behaves exactly as without it. Bad values never raise into vLLM: they fall back to the default and are
reported once in :attr:`HookSettings.warnings`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

DEFAULT_SOCKET_NAME = "kvfabric.sock"
DEFAULT_HTTP_HOST = "127.0.0.1"
DEFAULT_HTTP_PORT = 8321
DEFAULT_DB_PATH = "kvfabric.duckdb"


def default_socket_path() -> str:
    """Where the hook's sink and the collector meet by default: a directory private to this user.

    ``$XDG_RUNTIME_DIR/kvfabric/kvfabric.sock`` when ``$XDG_RUNTIME_DIR`` is a directory of this user (systemd
    creates it per login, mode 0700), else ``/tmp/kvfabric-<uid>/kvfabric.sock``. The collector creates the
    directory 0700 and refuses one that another user owns or may write to. Never a shared path such as
    ``/tmp/kvfabric.sock``: any local user could listen there first and receive a run's metadata and events (the
    sink also refuses a listener of another user: see :func:`kvfabric.protocol.untrusted_listener`).
    """
    uid = os.geteuid()
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isabs(runtime):
        try:
            st = os.stat(runtime)
        except OSError:
            st = None
        if st is not None and os.path.isdir(runtime) and st.st_uid == uid:
            return os.path.join(runtime, "kvfabric", DEFAULT_SOCKET_NAME)
    return os.path.join("/tmp", f"kvfabric-{uid}", DEFAULT_SOCKET_NAME)


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


@dataclass(frozen=True)
class HookSettings:
    """Everything the hook needs, parsed once per process."""

    lifecycle: bool = False
    sink: str = "none"  # "unix:///path", "jsonl:///path" or "none"
    policy: str = "lru"
    protect_min_hit_count: int = 1
    admission_anchor_blocks: int = 24
    family_depth: int = 0
    run_id: str = "default"
    batch_events: int = 4096  # a batch is sent every batch_events events ...
    flush_ms: int = 100  # ... or every flush_ms, whichever comes first
    buffer_events: int = 1_000_000  # bound on events held in memory; beyond it events are dropped and counted
    evicted_memory: int = 0  # recently evicted hashes kept for rebuilt/regret detection (0: by pool size)
    regret_window_s: float = 60.0
    cache_aware_scheduling: bool = False
    family_from_request_id: bool = False  # KVFABRIC_FAMILY_FROM_REQUEST_ID: "<family>/<rest>" request ids (opt-in)
    admission_gate_explicit: bool = False  # KVFABRIC_ADMISSION_ANCHOR_BLOCKS was set
    policy_model: str = ""  # KVFABRIC_POLICY_MODEL: the learned policy's model file ("" = the built-in default)
    native: bool = True  # KVFABRIC_NATIVE=0: the Python code even where the compiled parts are built
    warnings: tuple[str, ...] = field(default=(), compare=False)

    @property
    def admission_gate_on(self) -> bool:
        """The gate runs only when ``KVFABRIC_ADMISSION_ANCHOR_BLOCKS`` is set (> 0). docs/design.md §3 gives it a
        default of 24 with any policy; replaying the synthetic trace showed that default costing 2.3-9.3 points
        of hit rate at 30-50 % capacity (families of 2-5 requests lose their only reuse), so it is opt-in."""
        return self.admission_anchor_blocks > 0 and self.admission_gate_explicit

    @property
    def steers(self) -> bool:
        """Whether KVFabric changes any vLLM decision (otherwise it only observes)."""
        return self.policy != "lru" or self.admission_gate_on or self.cache_aware_scheduling

    @property
    def active(self) -> bool:
        """Whether the plugin installs anything: lifecycle recording or a non-LRU policy or gate."""
        return self.lifecycle or self.steers

    def as_metadata(self) -> dict[str, object]:
        return {
            "policy": self.policy,
            "protect_min_hit_count": self.protect_min_hit_count,
            "admission_anchor_blocks": self.admission_anchor_blocks,
            "family_depth": self.family_depth,
            "regret_window_s": self.regret_window_s,
            "cache_aware_scheduling": self.cache_aware_scheduling,
            "family_from_request_id": self.family_from_request_id,
            "policy_model": self.policy_model,
        }


def _int(env: Mapping[str, str], name: str, default: int, warnings: list[str], minimum: int = 0) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        warnings.append(f"{name}={raw!r} is not an integer; using {default}")
        return default
    if value < minimum:
        warnings.append(f"{name}={value} is below {minimum}; using {default}")
        return default
    return value


def _policy_model(path: str, policy: str, warnings: list[str]) -> str | None:
    """``KVFABRIC_POLICY_MODEL``, checked once here so a bad file never reaches vLLM's scheduler: an unreadable or
    invalid file falls back to the built-in model (one warning); None when the learned policy has no usable model
    at all (it then falls back to lru)."""
    if not path and policy != "learned":
        return ""
    from kvfabric.policies.reuse_model import ModelError, load_model

    if path:
        try:
            load_model(path)
            return path
        except ModelError as exc:
            warnings.append(f"KVFABRIC_POLICY_MODEL: {exc}; using the built-in model")
    if policy != "learned":
        return ""
    try:
        load_model(None)
    except ModelError as exc:
        warnings.append(f"the learned policy's built-in model is unusable ({exc}); using lru")
        return None
    return ""


def load_hook_settings(env: Mapping[str, str] | None = None) -> HookSettings:
    """Parse ``KVFABRIC_*`` variables (docs/design.md §3)."""
    env = os.environ if env is None else env
    warnings: list[str] = []
    lifecycle = env.get("KVFABRIC_LIFECYCLE", "").strip().lower() in _TRUE
    log_path = env.get("KVFABRIC_LIFECYCLE_LOG_PATH", "").strip()
    sink = env.get("KVFABRIC_SINK", "").strip()
    if not sink:
        sink = f"jsonl://{os.path.abspath(log_path)}" if log_path else f"unix://{default_socket_path()}"
    if not (sink == "none" or sink.startswith("unix://") or sink.startswith("jsonl://")):
        warnings.append(f"KVFABRIC_SINK={sink!r} is not unix://PATH, jsonl://PATH or none; events are not sent")
        sink = "none"
    from kvfabric.policies import POLICY_NAMES  # local: keeps config importable without policies' deps

    policy = env.get("KVFABRIC_EVICTION_POLICY", "lru").strip().lower() or "lru"
    if policy not in POLICY_NAMES:
        warnings.append(f"KVFABRIC_EVICTION_POLICY={policy!r} is unknown (known: {', '.join(POLICY_NAMES)}); using lru")
        policy = "lru"
    policy_model = _policy_model(env.get("KVFABRIC_POLICY_MODEL", "").strip(), policy, warnings)
    if policy_model is None:
        policy = "lru"
        policy_model = ""
    try:
        regret = float(env.get("KVFABRIC_REGRET_WINDOW_S", "60") or 60)
    except ValueError:
        warnings.append("KVFABRIC_REGRET_WINDOW_S is not a number; using 60")
        regret = 60.0
    return HookSettings(
        lifecycle=lifecycle,
        sink=sink,
        policy=policy,
        protect_min_hit_count=_int(env, "KVFABRIC_PROTECT_MIN_HIT_COUNT", 1, warnings, minimum=1),
        admission_anchor_blocks=_int(env, "KVFABRIC_ADMISSION_ANCHOR_BLOCKS", 24, warnings),
        family_depth=_int(env, "KVFABRIC_FAMILY_DEPTH", 0, warnings),
        run_id=env.get("KVFABRIC_RUN_ID", "").strip() or "default",
        batch_events=_int(env, "KVFABRIC_BATCH_EVENTS", 4096, warnings, minimum=1),
        flush_ms=_int(env, "KVFABRIC_FLUSH_MS", 100, warnings, minimum=1),
        buffer_events=_int(env, "KVFABRIC_BUFFER_EVENTS", 1_000_000, warnings, minimum=1),
        evicted_memory=_int(env, "KVFABRIC_EVICTED_MEMORY", 0, warnings, minimum=0),
        regret_window_s=regret,
        cache_aware_scheduling=env.get("KVFABRIC_CACHE_AWARE_SCHEDULING", "").strip().lower() in _TRUE,
        family_from_request_id=env.get("KVFABRIC_FAMILY_FROM_REQUEST_ID", "").strip().lower() in _TRUE,
        admission_gate_explicit=bool(env.get("KVFABRIC_ADMISSION_ANCHOR_BLOCKS", "").strip()),
        policy_model=policy_model,
        native=env.get("KVFABRIC_NATIVE", "1").strip().lower() not in _FALSE,
        warnings=tuple(warnings),
    )
