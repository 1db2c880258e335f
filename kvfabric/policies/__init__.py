"""Eviction policies and the admission gate (importable without vLLM).

Every policy is a key function over block statistics (:mod:`kvfabric.policies.builtin`); the structures that order
candidates live in :mod:`kvfabric.policies.index`. ``lru`` is vLLM's own order: inside vLLM it attaches nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvfabric.policies.base import EvictionPolicy, PolicySettings

POLICY_NAMES: tuple[str, ...] = ("lru", "family_protect", "shared_aware", "adaptive_aging")
"""Names accepted by ``KVFABRIC_EVICTION_POLICY`` (config.py validates against this tuple)."""


def make_policy(name: str, settings: PolicySettings | Any | None = None) -> EvictionPolicy:
    """The policy called ``name``; ``settings`` is a :class:`PolicySettings` or the hook's ``HookSettings``."""
    from kvfabric.policies import builtin
    from kvfabric.policies.base import PolicySettings

    if settings is not None and not isinstance(settings, PolicySettings):
        settings = PolicySettings.from_hook_settings(settings)
    classes: dict[str, type[EvictionPolicy]] = {
        "lru": builtin.LRUPolicy,
        "family_protect": builtin.FamilyProtectPolicy,
        "shared_aware": builtin.SharedAwarePolicy,
        "adaptive_aging": builtin.AdaptiveAgingPolicy,
    }
    try:
        cls = classes[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r} (known: {', '.join(POLICY_NAMES)})") from None
    return cls(settings)
