"""The peer policies (``lfu``, ``slru``, ``fifo``, ``tlru``: :mod:`kvfabric.policies.peers`) against a reference model.

The reference is written here from the sources' rules, independently of KVFabric's code: a dict-based prefix cache
whose nodes are cache blocks, evicting SGLang-style (the evictable *leaf* with the lowest priority, a node becoming
a leaf when its last child goes), with SGLang's fields updated as ``radix_cache.py`` does (``hit_count`` +1 on every
node an insert walks through, the new ones included; ``last_access_time`` and ``creation_time`` on a clock; T-LRU's
high-water history length). Requests run one at a time; each caches ``len(chain)`` full blocks and holds one more,
partial block (never cached) while it runs, as vLLM and the offline replay do with a prompt of
``len(chain) * block_size + 1`` tokens. The victims KVFabric chooses through the real offline replay
(:func:`kvfabric.sim.offline.replay_chains`) must be the reference's, in order, on seeded random traces and on
hand-written ones where LRU chooses differently; and through vLLM's real KVCacheManager with the hook, every
request's prefix hits must be the reference's.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvfabric.policies import POLICY_NAMES, make_policy
from kvfabric.policies.base import EvictionPolicy, PolicySettings
from kvfabric.sim.offline import replay_chains

PEERS = ("lfu", "slru", "fifo", "tlru")
BS = 16
XI = 64  # T-LRU's budget in tokens (4 blocks) ...
QHAT = 16  # ... and next-prompt estimate (1 block): a conversation's last 3 blocks are TEL-safe
SETTINGS = PolicySettings(block_size=BS, tlru_threshold_tokens=XI, tlru_next_prompt_tokens=QHAT)


# ------------------------------------------------------------------------------------------ the reference model


@dataclass
class Node:
    parent: int | None
    depth: int
    created: int
    hit_count: int = 0
    last_access: int = 0
    history: int = 0  # T-LRU: high-water length (blocks) of the requests through it
    children: set[int] = field(default_factory=set)


class Reference:
    """SGLang's radix cache at block granularity, ``capacity`` blocks, under one rule (or ``lru``)."""

    def __init__(self, rule: str, capacity: int) -> None:
        self.rule = rule
        self.nodes: dict[int, Node] = {}
        self.free = capacity
        self.clock = 0
        self.victims: list[int] = []

    def priority(self, n: Node) -> tuple[float, ...]:
        if self.rule == "lru":
            return (n.last_access,)
        if self.rule == "lfu":
            return (n.hit_count, n.last_access)
        if self.rule == "slru":
            return (1 if n.hit_count >= 2 else 0, n.last_access)
        if self.rule == "fifo":
            return (n.created, n.last_access)
        if self.rule == "tlru":
            budget = max(n.history * BS + QHAT - XI, 0)
            tel_safe = n.depth * BS >= budget  # the node's first token is past what the next turn needs
            return (-1 if tel_safe else 0, n.last_access)
        raise AssertionError(self.rule)

    def evict_one(self, pinned: set[int]) -> None:
        leaves = [k for k, n in self.nodes.items() if k not in pinned and not n.children]
        victim = min(leaves, key=lambda k: self.priority(self.nodes[k]))
        node = self.nodes.pop(victim)
        if node.parent is not None:
            self.nodes[node.parent].children.discard(victim)
        self.victims.append(victim)
        self.free += 1

    def request(self, chain: list[int]) -> int:
        """Admit, run and finish one request; returns its prefix hit in blocks."""
        self.clock += 1
        hit = 0
        while hit < len(chain) and chain[hit] in self.nodes:
            hit += 1
        pinned = set(chain[:hit])
        need = len(chain) - hit + 1  # its new blocks and the partial one
        while self.free < need:
            self.evict_one(pinned)
        self.free -= need
        for d in range(hit, len(chain)):
            parent = chain[d - 1] if d else None
            self.nodes[chain[d]] = Node(parent, d, created=self.clock)
            if parent is not None:
                self.nodes[parent].children.add(chain[d])
        # The finished request's insert walks its whole path.
        for k in chain:
            n = self.nodes[k]
            n.hit_count += 1
            n.last_access = self.clock
            n.history = max(n.history, len(chain))
        self.free += 1  # the partial block goes back, uncached
        return hit


def reference(rule: str, chains: list[list[int]], capacity: int) -> tuple[list[int], list[int]]:
    ref = Reference(rule, capacity)
    hits = [ref.request(c) for c in chains]
    return ref.victims, hits


# -------------------------------------------------------------------------------------------- KVFabric's side


def kvfabric_victims(name: str, chains: list[list[int]], num_blocks: int) -> tuple[list[int], dict[str, Any]]:
    """The victims (chain keys, in order) of the real offline replay under policy ``name``."""
    policy: EvictionPolicy = make_policy(name, SETTINGS)
    victims: list[int] = []
    evicted_one = policy.on_evicted

    def record(t: Any, b: int, now: int) -> None:
        victims.append(t.hash[b])
        evicted_one(t, b, now)

    policy.on_evicted = record  # type: ignore[method-assign]
    out = replay_chains(chains, [len(c) * BS + 1 for c in chains], [BS - 2] * len(chains), policy, num_blocks,
                        block_size=BS)
    return victims, out


def random_chains(seed: int, n: int, first: int = 1) -> list[list[int]]:
    """Conversations that return and grow, shared system prompts, one-off requests: prefix-chained block keys
    (from ``first`` up: one key is one content under one parent)."""
    rng = random.Random(seed)
    ids: dict[tuple[int, ...], int] = {}

    def keys(path: tuple[int, ...]) -> list[int]:
        return [ids.setdefault(path[: i + 1], len(ids) + first) for i in range(len(path))]

    convs: list[tuple[int, ...]] = []
    chains = []
    for _ in range(n):
        r = rng.random()
        if convs and r < 0.45:  # a conversation comes back with a new turn
            i = rng.randrange(len(convs))
            convs[i] = (*convs[i], *(rng.randrange(1000, 10**6) for _ in range(rng.randint(1, 3))))
            path = convs[i]
        elif r < 0.8:  # a new conversation under one of three system prompts
            path = (rng.randrange(3), *(rng.randrange(1000, 10**6) for _ in range(rng.randint(1, 4))))
            convs.append(path)
        else:  # one-off traffic
            path = tuple(rng.randrange(10**6, 10**7) for _ in range(rng.randint(1, 5)))
        chains.append(keys(path[:12]))
    return chains


# ---------------------------------------------------------------------------------------------------- tests


def test_peers_are_registered_for_live_servers_and_replays() -> None:
    for name in PEERS:
        assert name in POLICY_NAMES
        p = make_policy(name, block_size=32)
        assert p.name == name and p.settings.block_size == 32


#: Pool sizes of the random traces (slot 0 is vLLM's null block): from barely the longest request to moderate.
CAPACITIES = (14, 20, 30, 45, 60, 80)


@pytest.mark.parametrize("name", PEERS)
@pytest.mark.parametrize("seed", range(len(CAPACITIES)))
def test_peer_victims_equal_the_reference_on_random_traces(name: str, seed: int) -> None:
    chains = random_chains(seed, 200)
    num_blocks = CAPACITIES[seed]
    assert num_blocks > max(len(c) for c in chains) + 1
    got, out = kvfabric_victims(name, chains, num_blocks)
    want, hits = reference(name, chains, num_blocks - 1)
    assert len(want) > 50, "the trace must evict"
    assert got == want
    assert out["prefix_hit_tokens"] == sum(hits) * BS


@pytest.mark.parametrize("name", PEERS)
def test_the_random_traces_tell_each_peer_from_lru(name: str) -> None:
    """The random cases can fail: on some of them the peer's victims are not LRU's."""
    differ = [reference(name, random_chains(seed, 200), n - 1)[0] != reference("lru", random_chains(seed, 200),
                                                                              n - 1)[0]
              for seed, n in enumerate(CAPACITIES)]
    assert sum(differ) >= 3, differ


def test_the_reference_lru_is_the_replays_lru() -> None:
    """The harness itself: the reference's LRU and the replay's agree, so a peer's match is not the harness's."""
    chains = random_chains(11, 160)
    assert kvfabric_victims("lru", chains, 16)[0] == reference("lru", chains, 15)[0]


# Hand-written cases where the peer and LRU disagree (so each test can fail): (chains, usable blocks, the peer's
# first victims, LRU's first victims); each ends with a request for what only one of them kept.
HAND: dict[str, tuple[list[list[int]], int, list[int], list[int]]] = {
    # A (1,2) used twice; B (3,4) once, more recently; C needs room: LFU drops B, LRU drops A.
    "lfu": ([[1, 2], [1, 2], [3, 4], [5, 6, 7], [1, 2]], 6, [4, 3], [2, 1]),
    # The same traffic: SLRU protects A (used twice), so the probationary B goes.
    "slru": ([[1, 2], [1, 2], [3, 4], [5, 6, 7], [1, 2]], 6, [4, 3], [2, 1]),
    # A made first but reused last: FIFO drops it (oldest content), LRU drops B.
    "fifo": ([[1, 2], [3, 4], [1, 2], [5, 6, 7], [3, 4]], 6, [2, 1], [4, 3]),
    # A long conversation (6 blocks), then a short one (2): both go tail first while TEL-safe, but once the long
    # one is down to what its next turn needs (its first 3 blocks), T-LRU takes the short, newer one, LRU does not.
    "tlru": ([[3, 4, 5, 6, 7, 8], [1, 2], [9, 10, 11, 12, 13], [3, 4, 5, 14]], 8, [8, 7, 6, 2, 1], [8, 7, 6, 5, 4]),
}


@pytest.mark.parametrize("name", PEERS)
def test_peer_differs_from_lru_where_the_rule_says(name: str) -> None:
    chains, usable, peer_first, lru_first = HAND[name]
    got, _ = kvfabric_victims(name, chains, usable + 1)
    want, _ = reference(name, chains, usable)
    lru, _ = reference("lru", chains, usable)
    assert got == want
    assert got[: len(peer_first)] == peer_first and lru[: len(lru_first)] == lru_first
    assert reference(name, chains, usable)[1][-1] != reference("lru", chains, usable)[1][-1]


def test_tlru_with_no_budget_slack_is_lru() -> None:
    """``xi <= Q_hat``: nothing is TEL-safe, and T-LRU is exactly LRU (the sources' fallback)."""
    chains = random_chains(3, 120)
    policy = make_policy("tlru", PolicySettings(block_size=BS, tlru_threshold_tokens=16, tlru_next_prompt_tokens=16))
    victims: list[int] = []
    original = policy.on_evicted
    policy.on_evicted = lambda t, b, now: (victims.append(t.hash[b]), original(t, b, now))  # type: ignore[method-assign]
    replay_chains(chains, [len(c) * BS + 1 for c in chains], [BS - 2] * len(chains), policy, 14, block_size=BS)
    assert victims == reference("lru", chains, 13)[0]


# ------------------------------------------------------------------------------- vLLM's real KVCacheManager


def run_in_vllm(name: str, chains: list[list[int]], num_blocks: int) -> tuple[list[int], Any]:
    """Each chain as one request through vLLM's real KVCacheManager (``num_blocks`` blocks of 16 tokens) with the
    hook and ``KVFABRIC_EVICTION_POLICY=name``, one at a time; returns the prefix hits (blocks) and the steering."""
    from support.pools import BLOCK, bare_manager, make_request

    from kvfabric.engine.config import load_hook_settings
    from kvfabric.engine.install import build_hook

    assert BLOCK == BS
    manager = bare_manager(num_blocks)
    env = {"KVFABRIC_LIFECYCLE": "1", "KVFABRIC_SINK": "none", "KVFABRIC_EVICTION_POLICY": name,
           "KVFABRIC_TLRU_THRESHOLD_TOKENS": str(XI), "KVFABRIC_TLRU_NEXT_PROMPT_TOKENS": str(QHAT)}
    settings = load_hook_settings(env)
    assert settings.policy == name and not settings.warnings
    inst = build_hook(manager, settings, block_size=BS, engine="test", outlet="local")
    assert inst is not None and inst.steering is not None and inst.steering.policy is not None
    assert inst.steering.policy.name == name
    hits = []
    for i, chain in enumerate(chains):
        # Block k of a chain is 16 copies of its key, and one more token makes the partial block: vLLM's chained
        # block hashes are then as prefix-chained as the keys (a key is one content under one parent).
        req = make_request(f"r{i}", [k for k in chain for _ in range(BS)] + [0])
        computed, num_computed = manager.get_computed_blocks(req, req.num_tokens - 1)[:2]
        assert manager.allocate_slots(req, req.num_tokens - num_computed, num_computed, computed) is not None
        hits.append(num_computed // BS)
        manager.free(req)
        inst.flush()
    return hits, inst.steering


@pytest.mark.vllm
@pytest.mark.parametrize("name", PEERS)
def test_peer_runs_inside_vllms_kv_cache_manager_in_the_reference_order(name: str) -> None:
    """Through vLLM 0.33's real KVCacheManager with the hook (``KVFABRIC_EVICTION_POLICY=<peer>``), under pressure:
    every request's prefix hit is the reference's (so every eviction before it was), on the hand-written case
    (where LRU's hits differ) and on a random trace."""
    chains, usable, _, _ = HAND[name]
    hits, steering = run_in_vllm(name, chains, usable + 1)
    assert hits == reference(name, chains, usable)[1]
    assert hits != reference("lru", chains, usable)[1]  # the case is one where the order matters
    assert steering.errors == 0
    chains = random_chains(5, 120)
    hits, steering = run_in_vllm(name, chains, 20)
    victims, want = reference(name, chains, 19)
    assert hits == want and len(victims) > 100
    assert steering.errors == 0 and steering.victims > 100
