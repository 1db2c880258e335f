"""Eviction policies and the admission gate (importable without vLLM).

Every policy is a key function over block statistics (:mod:`kvfabric.policies.builtin`); the structures that order
candidates live in :mod:`kvfabric.policies.index` (chosen by :mod:`kvfabric.policies.indexes`). No vLLM object
reaches a policy, and nothing here imports the engine. ``lru`` is vLLM's own order: inside vLLM it attaches nothing.
One registry: :func:`make_policy` builds every policy by name, the offline optimum included (it needs an oracle of
future accesses, so only replays can build it).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvfabric.policies.base import EvictionPolicy, PolicySettings

PEER_NAMES: tuple[str, ...] = ("lfu", "slru", "fifo", "tlru")
"""Other engines' policies, as baselines (:mod:`kvfabric.policies.peers`: SGLang's ``lfu``, ``slru``, ``fifo`` and
the tail-optimized LRU)."""

POLICY_NAMES: tuple[str, ...] = ("lru", "family_protect", "shared_aware", "adaptive_aging", "learned", *PEER_NAMES)
"""Policies a live server can run (``KVFABRIC_EVICTION_POLICY``; config.py validates against this tuple)."""

ORACLE_POLICIES: tuple[str, ...] = ("optimal",)
"""Policies that need the future (an oracle of accesses): replays only."""

ALL_POLICIES: tuple[str, ...] = (*POLICY_NAMES, *ORACLE_POLICIES)


def make_policy(name: str, settings: PolicySettings | Any | None = None, *, oracle: Any = None,
                block_size: int | None = None) -> EvictionPolicy:
    """The policy called ``name``; ``settings`` is a :class:`PolicySettings` or the hook's ``HookSettings``.

    ``block_size``: tokens per cache block, where the caller knows it (it replaces ``settings.block_size``; ``tlru``
    converts its token budgets with it).

    ``learned`` reads its model from ``settings.model_path`` (the built-in default when unset); a bad model file
    raises :class:`~kvfabric.policies.reuse_model.ModelError` (a ``ValueError``).
    ``oracle`` is what an oracle policy needs (for ``optimal``: ``{digest: [request positions]}``, see
    :func:`kvfabric.policies.optimal.occurrences_of`).
    """
    # (Imported when a policy is made, not with the package: the settings table reads ``POLICY_NAMES`` in every
    # vLLM process, with KVFabric on or off, and needs none of the policies' modules for it.)
    from kvfabric.policies import builtin
    from kvfabric.policies.base import PolicySettings
    from kvfabric.policies.learned import LearnedPolicy
    from kvfabric.policies.optimal import OptimalPolicy
    from kvfabric.policies.peers import PEER_POLICIES

    if settings is not None and not isinstance(settings, PolicySettings):
        settings = PolicySettings.from_hook_settings(settings)
    if block_size is not None:
        settings = dataclasses.replace(settings or PolicySettings(), block_size=int(block_size))
    if name == "optimal":
        if oracle is None:
            raise ValueError("the optimal policy needs the future: only a replay can build it (oracle=...)")
        return OptimalPolicy(oracle, settings)
    classes: dict[str, type[EvictionPolicy]] = {
        "lru": builtin.LRUPolicy,
        "family_protect": builtin.FamilyProtectPolicy,
        "shared_aware": builtin.SharedAwarePolicy,
        "adaptive_aging": builtin.AdaptiveAgingPolicy,
        "learned": LearnedPolicy,
        **PEER_POLICIES,
    }
    try:
        cls = classes[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r} (known: {', '.join(ALL_POLICIES)})") from None
    return cls(settings)
