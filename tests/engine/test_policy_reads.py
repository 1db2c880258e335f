"""``EvictionPolicy.reads`` is a contract: inside vLLM a policy that declares only lean columns gets a keeper that
keeps nothing else (``kvfabric/lifecycle/expander.py``, ``StatisticsKeeper``), so an undeclared read would see stale
statistics. Every built-in policy runs here, through vLLM's real KVCacheManager and the hook, on a table that
refuses any column it did not declare (besides the victim index's own and steering's ``protected`` / ``score``)."""

from __future__ import annotations

from typing import Any

import pytest
from support.pools import LIVE_POLICIES, admit, make_manager, make_request

from kvfabric.lifecycle.side_table import INDEX_COLUMNS, SideTable
from kvfabric.policies import make_policy

STEERING_COLUMNS = frozenset({"protected", "score"})  # written and read by steering itself, never by a policy


class UndeclaredRead(AssertionError):
    pass


class GuardedTable:
    """A side table's columns, readable only where ``allowed`` names them."""

    def __init__(self, table: SideTable, allowed: frozenset[str]) -> None:
        self._table = table
        self._allowed = allowed
        self.refused: list[str] = []

    def __getattr__(self, name: str) -> Any:
        if name not in self._allowed:
            self.refused.append(name)
            raise UndeclaredRead(f"read of undeclared column {name!r}")
        return getattr(self._table, name)


class GuardedOwner:
    """What the victim index reads its table from: the keeper's table behind a guard."""

    def __init__(self, keeper: Any, allowed: frozenset[str]) -> None:
        self.keeper = keeper
        self.allowed = allowed
        self.guards: list[GuardedTable] = []

    @property
    def table(self) -> GuardedTable:
        guard = GuardedTable(self.keeper.table, self.allowed)
        self.guards.append(guard)
        return guard


@pytest.mark.parametrize("policy", LIVE_POLICIES)
def test_a_policy_reads_only_the_columns_it_declares(policy: str) -> None:
    manager, _, steering = make_manager(14, policy, anchor=0)
    assert steering is not None and steering.index is not None and steering.policy is not None
    owner = GuardedOwner(steering.keeper, steering.policy.reads | INDEX_COLUMNS | STEERING_COLUMNS)
    steering.index.owner = owner
    for i in range(30):
        extra = {"kvfabric_family": f"f{i % 3}", "kvfabric_session": f"s{i % 4}", "kvfabric_session_end": i % 5 == 4}
        req = make_request(f"q{i}", [1 + i % 3] * 32 + [50 + i] * 40, extra)
        assert admit(manager, req) is not None
        manager.free(req)
    refused = sorted({name for guard in owner.guards for name in guard.refused})
    assert refused == [], f"{policy} read {refused} without declaring them"
    assert steering.errors == 0
    assert steering.victims > 0 and len(owner.guards) > 0  # the guarded table was really read from


def test_the_guard_refuses_an_undeclared_read() -> None:
    """The check above can fail: a policy reading ``family`` while declaring only ``hits`` is caught."""
    manager, _, steering = make_manager(14, "adaptive_aging", anchor=0)
    assert steering is not None and steering.index is not None and steering.policy is not None
    original = steering.policy.keys  # what the index calls, once per free

    def sneaky_keys(t: Any, ids: list[int], now: int, ctx: Any) -> list[float]:
        for b in ids:
            t.family[b]  # an undeclared read
        return original(t, ids, now, ctx)

    steering.policy.keys = sneaky_keys  # type: ignore[method-assign]
    owner = GuardedOwner(steering.keeper, steering.policy.reads | INDEX_COLUMNS | STEERING_COLUMNS)
    steering.index.owner = owner
    req = make_request("q", [1] * 32 + [2] * 40)
    admit(manager, req)
    manager.free(req)
    assert {name for guard in owner.guards for name in guard.refused} == {"family"}
    assert steering.errors > 0  # the hook contained it: vLLM's call went on


def test_the_optimum_reads_only_what_it_declares() -> None:
    """``optimal`` runs only in replays (it needs the future); its key and observer on a guarded table."""
    policy = make_policy("optimal", oracle={7: [3, 9]})
    policy.bind(4)
    table = SideTable(4)
    table.hash[1] = 7
    table.depth[1] = 2
    guard = GuardedTable(table, policy.reads | INDEX_COLUMNS)
    assert policy.key(guard, 1, 0, None) == -float(3 * (1 << 20) + 2)
    policy.on_evicted(guard, 1, 0)
    assert guard.refused == []
