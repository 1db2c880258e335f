"""Eviction policies and the admission gate (importable without vLLM)."""

POLICY_NAMES: tuple[str, ...] = ("lru", "family_protect", "shared_aware")
