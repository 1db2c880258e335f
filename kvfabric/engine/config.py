"""The engine's settings, read from the environment (a vLLM general plugin receives no arguments).

Every variable is declared in :data:`kvfabric.settings.SETTINGS` (type, default, accepted values) and parsed by
:func:`kvfabric.settings.read`. Unset ``KVFABRIC_LIFECYCLE``, ``KVFABRIC_LIFECYCLE_LOG_PATH`` and
``KVFABRIC_EVICTION_POLICY`` (or ``lru``) means the plugin installs nothing at all and vLLM behaves exactly as
without it. Bad values never raise into vLLM: they fall back to the documented default and are reported once in
:attr:`HookSettings.warnings`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvfabric.contract.protocol import default_socket_path
from kvfabric.settings import BY_NAME, SETTINGS, is_set, read, shown


@dataclass(frozen=True)
class HookSettings:
    """Everything the hook needs, parsed once per process (defaults: :data:`kvfabric.settings.SETTINGS`)."""

    lifecycle: bool = False
    sink: str = "none"  # "unix:///path", "jsonl:///path" or "none"
    policy: str = "lru"
    protect_min_hit_count: int = 1
    tlru_threshold_tokens: int = 2048  # KVFABRIC_TLRU_THRESHOLD_TOKENS: the tlru policy's xi
    tlru_next_prompt_tokens: int = 256  # KVFABRIC_TLRU_NEXT_PROMPT_TOKENS: the tlru policy's Q_hat
    admission_anchor_blocks: int = 0  # 0: the admission gate is off
    family_depth: int | None = None  # None: the widest-branch-point rule (docs/design.md §5)
    run_id: str = "default"
    batch_events: int = 4096  # a batch is sent every batch_events events ...
    flush_ms: int = 100  # ... or every flush_ms, whichever comes first
    buffer_events: int = 1_000_000  # bound on events held in memory; beyond it events are dropped and counted
    evicted_memory: int = 0  # recently evicted hashes kept for rebuilt/regret detection (0: by pool size)
    regret_window_s: float = 60.0
    cache_aware_scheduling: bool = False
    family_from_request_id: bool = False  # KVFABRIC_FAMILY_FROM_REQUEST_ID: "<family>/<rest>" request ids (opt-in)
    policy_model: str = ""  # KVFABRIC_POLICY_MODEL: the learned policy's model file ("" = the built-in default)
    native: bool = True  # KVFABRIC_NATIVE=0: the Python code even where the compiled parts are built
    engine_id: str = ""  # KVFABRIC_ENGINE_ID ("" = <host>/dp<rank>)
    host: str = ""  # KVFABRIC_HOST ("" = socket.gethostname())
    warnings: tuple[str, ...] = field(default=(), compare=False)

    @property
    def admission_gate_on(self) -> bool:
        """The gate runs only when ``KVFABRIC_ADMISSION_ANCHOR_BLOCKS`` is set (> 0): off by default, because on the
        synthetic trace at 30-50 % capacity a gate of 24 costs 2.3-9.3 points of hit rate (families of 2-5
        requests lose their only reuse)."""
        return self.admission_anchor_blocks > 0

    @property
    def steers(self) -> bool:
        """Whether KVFabric changes any vLLM decision (otherwise it only observes)."""
        return self.policy != "lru" or self.admission_gate_on or self.cache_aware_scheduling

    @property
    def active(self) -> bool:
        """Whether the plugin installs anything: lifecycle recording or a non-LRU policy or gate."""
        return self.lifecycle or self.steers

    def as_metadata(self) -> dict[str, object]:
        """The settings in force, as a stream records them (``kvfabric.settings`` metadata): every hook setting of
        :data:`kvfabric.settings.SETTINGS` under its field name, whether the admission gate runs, and the
        warnings of bad values. Two runs that behave differently never record the same settings."""
        meta: dict[str, object] = {s.field: getattr(self, s.field) for s in SETTINGS if s.field}
        meta["admission_gate"] = self.admission_gate_on
        meta["admission_anchor_blocks"] = self.admission_anchor_blocks if self.admission_gate_on else 0
        meta["warnings"] = list(self.warnings)
        return meta


def _policy_model(env: Mapping[str, str], policy: str, warnings: list[str]) -> str | None:
    """``KVFABRIC_POLICY_MODEL``, checked once here so a bad file never reaches vLLM's scheduler: an unreadable or
    invalid file falls back to the built-in model (one warning); None when the learned policy has no usable model
    at all (it then falls back to lru)."""
    path = read("KVFABRIC_POLICY_MODEL", env, warnings)
    if not path and policy != "learned":
        return ""
    # (Imported only when a model is asked for: most processes never read one.)
    from kvfabric.policies.reuse_model import load_model

    if path:
        try:
            load_model(path)
            return path
        except Exception as exc:  # ModelError, and anything else a broken file raises: never into vLLM
            problem = " ".join(str(exc).split())
            warnings.append(f"KVFABRIC_POLICY_MODEL={shown(path)} is not a usable reuse model ({problem}) "
                            f"(accepted: a `kvfabric learn --out` file); using the default "
                            f"{BY_NAME['KVFABRIC_POLICY_MODEL'].default_text()}")
    if policy != "learned":
        return ""
    try:
        load_model(None)
    except Exception as exc:
        warnings.append(f"the learned policy's built-in model is unusable ({exc}); using lru")
        return None
    return ""


def load_hook_settings(env: Mapping[str, str] | None = None) -> HookSettings:
    """Parse the hook's ``KVFABRIC_*`` variables (:data:`kvfabric.settings.SETTINGS`). Never raises for a value:
    a bad one gives the documented default and one line in :attr:`HookSettings.warnings`."""
    env = os.environ if env is None else env
    warnings: list[str] = []

    def get(name: str, **kwargs: object) -> object:
        return read(name, env, warnings, **kwargs)

    # KVFABRIC_LIFECYCLE_LOG_PATH is shorthand for KVFABRIC_LIFECYCLE=1 KVFABRIC_SINK=jsonl://PATH: it decides
    # both defaults, and an explicit value of either still wins.
    log_path = str(get("KVFABRIC_LIFECYCLE_LOG_PATH"))
    by_log_path = " (KVFABRIC_LIFECYCLE_LOG_PATH is set)"
    lifecycle = bool(get("KVFABRIC_LIFECYCLE", default=True, default_text="1" + by_log_path) if log_path
                     else get("KVFABRIC_LIFECYCLE"))
    default_sink = f"jsonl://{log_path}" if log_path else f"unix://{default_socket_path()}"
    sink = str(get("KVFABRIC_SINK", default=default_sink,
                   default_text=repr(default_sink) + (by_log_path if log_path else "")))
    if log_path and sink != default_sink and is_set("KVFABRIC_SINK", env):
        warnings.append(f"KVFABRIC_LIFECYCLE_LOG_PATH={shown(log_path)} is not used: KVFABRIC_SINK={shown(sink)} "
                        f"takes precedence")
    policy = str(get("KVFABRIC_EVICTION_POLICY"))
    policy_model = _policy_model(env, policy, warnings)
    if policy_model is None:
        policy = "lru"
        policy_model = ""
    return HookSettings(
        lifecycle=lifecycle,
        sink=sink,
        policy=policy,
        protect_min_hit_count=get("KVFABRIC_PROTECT_MIN_HIT_COUNT"),  # type: ignore[arg-type]
        tlru_threshold_tokens=get("KVFABRIC_TLRU_THRESHOLD_TOKENS"),  # type: ignore[arg-type]
        tlru_next_prompt_tokens=get("KVFABRIC_TLRU_NEXT_PROMPT_TOKENS"),  # type: ignore[arg-type]
        admission_anchor_blocks=get("KVFABRIC_ADMISSION_ANCHOR_BLOCKS"),  # type: ignore[arg-type]
        family_depth=get("KVFABRIC_FAMILY_DEPTH"),  # type: ignore[arg-type]
        run_id=get("KVFABRIC_RUN_ID"),  # type: ignore[arg-type]
        engine_id=get("KVFABRIC_ENGINE_ID"),  # type: ignore[arg-type]
        host=get("KVFABRIC_HOST"),  # type: ignore[arg-type]
        batch_events=get("KVFABRIC_BATCH_EVENTS"),  # type: ignore[arg-type]
        flush_ms=get("KVFABRIC_FLUSH_MS"),  # type: ignore[arg-type]
        buffer_events=get("KVFABRIC_BUFFER_EVENTS"),  # type: ignore[arg-type]
        evicted_memory=get("KVFABRIC_EVICTED_MEMORY"),  # type: ignore[arg-type]
        regret_window_s=float(get("KVFABRIC_REGRET_WINDOW_S")),  # type: ignore[arg-type]
        cache_aware_scheduling=get("KVFABRIC_CACHE_AWARE_SCHEDULING"),  # type: ignore[arg-type]
        family_from_request_id=get("KVFABRIC_FAMILY_FROM_REQUEST_ID"),  # type: ignore[arg-type]
        policy_model=policy_model,
        native=get("KVFABRIC_NATIVE"),  # type: ignore[arg-type]
        warnings=tuple(warnings),
    )
