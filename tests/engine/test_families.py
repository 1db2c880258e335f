"""The default prefix-family rule (docs/design.md §5): a request's family is its block just below the widest branch
point of its chain, in the prefix tree of the requests its engine named before it.

The rule is checked against a plain block-by-block statement of it (:class:`ReferenceTree`), on shapes of traffic
that lumped everything into one family under a fixed depth (a shared trunk) or that a simpler rule gets wrong (a
minority prefix at the root, templates with one-off tails), and end to end: the slice of the Mooncake conversation
trace in ``tests/data`` replayed through vLLM's real scheduler into a real collector, as a user would.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import Counter, defaultdict
from collections.abc import Hashable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import duckdb
import httpx
import pytest
from support.collector_testkit import collector_files, wait_until

from kvfabric.cli import main
from kvfabric.contract import schema as S
from kvfabric.engine.families import FamilyNamer, FamilyTree, request_family
from kvfabric.policies.base import RequestInfo
from kvfabric.policies.builtin import LRUPolicy
from kvfabric.sim.offline import OfflineCache, block_keys, load_trace

SLICE = Path(__file__).resolve().parents[1] / "data" / "mooncake_conversation_slice.jsonl"


class ReferenceTree:
    """The rule as docs/design.md §5 states it, block by block and without a memory bound."""

    def __init__(self) -> None:
        self.count: Counter[Hashable] = Counter()
        self.children: defaultdict[Hashable, set[Hashable]] = defaultdict(set)

    def add(self, chain: Sequence[Hashable]) -> int:
        parent: Hashable = None  # the start of every chain
        for x in chain:
            self.children[parent].add(x)
            self.count[x] += 1
            parent = x
        best: tuple[int, int, int] | None = None
        for d in range(-1, len(chain) - 1):  # the start, then every block with a continuation on the chain
            kids = self.children[None if d < 0 else chain[d]]
            k = len(kids)
            r = sum(1 for c in kids if self.count[c] >= 2)
            rank = (r if r >= 2 else 0, k if k >= 2 else 0, -d)
            if best is None or rank > best:
                best = rank
        assert best is not None
        return 1 - best[2]


def digest(path: tuple[int, ...]) -> bytes:
    """A vLLM-like block hash of a prefix (bytes, prefix-chained by construction)."""
    return hashlib.sha256(repr(path).encode()).digest()


def chain_of(path: Sequence[int]) -> list[bytes]:
    return [digest(tuple(path[: j + 1])) for j in range(len(path))]


def random_paths(seed: int, n: int = 600) -> list[tuple[int, ...]]:
    """Prefix paths that extend, cut and branch earlier ones (chains ending inside another, repeats, forks)."""
    rnd = random.Random(seed)
    pool: list[tuple[int, ...]] = [()]
    out = []
    for _ in range(n):
        base = rnd.choice(pool) if rnd.random() < 0.8 else ()
        pre = base[: rnd.randint(0, len(base))]
        path = pre + tuple(rnd.randint(0, 3) for _ in range(rnd.randint(0 if pre else 1, 6)))
        pool.append(path)
        out.append(path)
    return out


def slice_chains(block_size: int = 16) -> tuple[list[Any], list[list[int]]]:
    """The slice's rows and their full-block keys at ``block_size`` (what the offline replay uses)."""
    rows = load_trace(SLICE)
    return rows, [block_keys(r, block_size) for r in rows]


def conversation(row: Any) -> int:
    """Every row of the slice starts with hash id 0 (a trunk all share); its second id starts its conversation."""
    return row.hash_ids[1]


def partition(labels: Sequence[Hashable]) -> set[frozenset[int]]:
    groups: defaultdict[Hashable, set[int]] = defaultdict(set)
    for i, label in enumerate(labels):
        groups[label].add(i)
    return {frozenset(g) for g in groups.values()}


def request(rid: str, chain: Sequence[Any], **extra: Any) -> Any:
    return SimpleNamespace(request_id=rid, block_hashes=list(chain),
                           sampling_params=SimpleNamespace(extra_args=extra or None))


# ------------------------------------------------------------------------------------------------ the tree


@pytest.mark.parametrize("seed", range(6))
def test_tree_names_as_the_reference(seed: int) -> None:
    """The radix tree decides as the block-by-block statement on chains that split its segments every way, and a
    tiny memory (pruning after every few chains) keeps every answer a block of the chain and its count exact."""
    ref, tree, small = ReferenceTree(), FamilyTree(), FamilyTree(capacity=24)
    for path in random_paths(seed):
        chain = chain_of(path)
        assert tree.add(chain) == ref.add(chain)
        assert 0 <= small.add(chain) < len(chain)
        assert len(small) == held_by(small)


def held_by(tree: FamilyTree) -> int:
    """Blocks the tree's segments hold, counted by walking it."""
    total, stack = 0, [tree.root]
    while stack:
        node = stack.pop()
        total += len(node.seg)
        stack.extend((node.children or {}).values())
    return total


def test_tree_names_the_slice_as_the_reference() -> None:
    _, chains = slice_chains(block_size=128)
    ref, tree = ReferenceTree(), FamilyTree()
    assert [tree.add(c) for c in chains] == [ref.add(c) for c in chains]


def test_a_shared_trunk_is_not_a_family() -> None:
    """A trunk every request shares (8 blocks), then 40 conversations whose turns extend their previous one: from
    the second request on, each conversation is one family, named by its first block below the trunk."""
    trunk = (0,) * 8
    tree = FamilyTree()
    rnd = random.Random(1)
    order = list(range(40)) + [rnd.randrange(40) for _ in range(160)]  # every first turn, then later turns
    turns: dict[int, tuple[int, ...]] = {}
    names: defaultdict[int, set[Hashable]] = defaultdict(set)
    for i, conv in enumerate(order):
        path = turns.get(conv, (*trunk, 100 + conv)) + tuple(rnd.randrange(5) for _ in range(3))
        turns[conv] = path
        chain = chain_of(path)
        depth = tree.add(chain)
        if i == 0:
            assert depth == 0  # it met no branch yet: its first block names it
            continue
        assert depth == len(trunk)
        names[conv].add(chain[depth])
    assert all(len(n) == 1 for n in names.values()) and len(names) == 40


def test_one_off_tails_do_not_split_a_template() -> None:
    """Templates (3 blocks) with one-off tails, one template taking 60 % of the traffic: each template is one
    family (its one-off tails are not reused continuations), where a rule following the majority's path would have
    made every request of the big template a family of its own."""
    rnd = random.Random(2)
    tree = FamilyTree()
    families: defaultdict[int, set[Hashable]] = defaultdict(set)
    for i in range(500):
        template = 1 if rnd.random() < 0.6 else rnd.randint(2, 5)
        path = (template, 10, 20) + (10_000 + i,) * rnd.randint(1, 4)
        chain = chain_of(path)
        families[template].add(chain[tree.add(chain)])
    assert {t: len(f) for t, f in families.items()} == {t: 1 for t in families}


def test_a_minority_prefix_at_the_root_does_not_capture_the_rest() -> None:
    """A repeated health check (another first block, reused) beside chat traffic under one trunk. Once two
    conversations came back, every chat request is named below the trunk (one family per conversation) and the
    health check is one family. Before that the chat trunk, one of two reused first blocks whose own continuations
    were all one-off so far, is a family like a template's (docs/design.md §5)."""
    rnd = random.Random(3)
    tree = FamilyTree()
    trunk = (0,) * 6
    order = list(range(60)) + [rnd.randrange(60) for _ in range(340)]
    turns: dict[int, tuple[int, ...]] = {}
    chat: defaultdict[int, set[Hashable]] = defaultdict(set)
    health: set[Hashable] = set()
    returned = 0
    for i, conv in enumerate(order):
        if i % 25 == 3:
            chain = chain_of((7, 7))
            health.add(chain[tree.add(chain)])
        returned += conv in turns
        path = (*turns.get(conv, (*trunk, 100 + conv)), rnd.randrange(4))
        turns[conv] = path
        chain = chain_of(path)
        depth = tree.add(chain)
        if returned >= 2:
            assert depth == len(trunk)
            chat[conv].add(chain[depth])
        elif i > 28:  # (the second health check made two reused first blocks)
            assert depth == 0
    assert len(health) == 1
    assert all(len(names) == 1 for names in chat.values()) and len(chat) == 60


def test_identities_of_any_type_give_the_same_partition() -> None:
    """vLLM's hashes (bytes) and the offline replay's keys (ints) for the same chains: the same groups."""
    paths = random_paths(7)
    by_bytes, by_ints = FamilyTree(), FamilyTree()
    ints: dict[tuple[int, ...], int] = {}
    a, b = [], []
    for path in paths:
        chain = chain_of(path)
        keys = [ints.setdefault(tuple(path[: j + 1]), len(ints)) for j in range(len(path))]
        a.append(chain[by_bytes.add(chain)])
        b.append(keys[by_ints.add(keys)])
    assert partition(a) == partition(b)


# ------------------------------------------------------------------------------------------------ the namer


def test_the_namer_applies_the_overrides_first() -> None:
    """A ``kvfabric_family`` hint wins, then an opted-in request-id family, then a fixed depth; only requests the
    default rule names enter the tree."""
    chain = chain_of((1, 2, 3))
    namer = FamilyNamer(from_request_id=True)
    assert namer(request("a/1", chain, kvfabric_family="tpl-1"), chain) == "tpl-1"
    assert namer(request("a/1", chain), chain) == "a"
    assert namer.tree.root.count == 0
    assert namer(request("x", chain), chain) == S.family_of_hash(S.hash64(chain[0]))
    assert namer(request("y", []), []) is None
    fixed = FamilyNamer(depth=1)
    assert fixed(request("x", chain), chain) == S.family_of_hash(S.hash64(chain[1]))
    assert fixed(request("z", chain[:1]), chain[:1]) == S.family_of_hash(S.hash64(chain[0]))  # min(F, len - 1)
    assert fixed.tree.root.count == 0
    # The stateless helper: a fixed depth, or the first block where none is set.
    assert request_family(request("x", chain), chain, None) == S.family_of_hash(S.hash64(chain[0]))
    assert request_family(request("x", chain), chain, 2) == S.family_of_hash(S.hash64(chain[2]))


def test_a_request_keeps_its_family() -> None:
    """Named once: asked again (a preempted request resumed, its chain longer by its output) it gets the same name
    and is not counted twice; a new request reusing the id is named afresh."""
    namer = FamilyNamer()
    trunk = (0, 0)
    first = namer(request("r1", chain_of((*trunk, 1, 1))), chain_of((*trunk, 1, 1)))
    second = namer(request("r2", chain_of((*trunk, 2, 2))), chain_of((*trunk, 2, 2)))
    assert first != second
    count = namer.tree.root.count
    assert namer(request("r1", chain_of((*trunk, 1, 1, 5, 5))), chain_of((*trunk, 1, 1, 5, 5))) == first
    assert namer.tree.root.count == count
    other = chain_of((9, 9))
    assert namer(request("r1", other), other) == S.family_of_hash(S.hash64(other[0]))
    assert namer.tree.root.count == count + 1


def test_a_fixed_depth_lumps_the_slice_the_default_rule_does_not() -> None:
    """The finding this rule answers: at depth 0 the slice is one family; by default one per conversation."""
    rows, chains = slice_chains()
    fixed, namer = FamilyNamer(depth=0), FamilyNamer()
    for i, chain in enumerate(chains):
        assert fixed(request(f"trace/{i}", chain), chain) == fixed(request("trace/0", chains[0]), chains[0])
    named = [namer(request(f"trace/{i}", c), c) for i, c in enumerate(chains)]
    assert partition(named) == partition([conversation(r) for r in rows])


# ------------------------------------------------------------------------------------------------ the slice


class NamingCache(OfflineCache):
    """The offline replay, keeping the family it gave each request."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.named: list[str | None] = []

    def family_of(self, keys: Sequence[int], info: RequestInfo | None) -> str | None:
        family = super().family_of(keys, info)
        self.named.append(family)
        return family


def offline_families(rows: Any, chains: list[list[int]]) -> list[str | None]:
    """The family the offline replay gives each row."""
    cache = NamingCache(200_000, LRUPolicy(), 16)
    for i, (row, keys) in enumerate(zip(rows, chains, strict=True)):
        slots, _ = cache.admit(f"r{i}", keys, row.input_length, 1, RequestInfo(f"r{i}", position=i))
        cache.finish(slots, RequestInfo(f"r{i}", position=i))
    return cache.named


def test_the_offline_replay_groups_the_slice_by_conversation() -> None:
    rows, chains = slice_chains()
    families = offline_families(rows, chains)
    assert None not in families
    assert partition(families) == partition([conversation(r) for r in rows])


def replay(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert main(["replay", *args, "--format", "json", "--no-progress"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.vllm
def test_the_slice_through_vllm_and_a_collector_has_one_family_per_conversation(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The user's experiment: the slice replayed through vLLM's real scheduler, the hook streaming to a real
    collector. The stored ``prefix_lookup`` rows name one family per conversation (279 for 300 requests, at most 3
    requests each) where a family by the first block made one of 300; and the hook's groups are the offline
    replay's."""
    with collector_files() as files:
        proc = files.process()
        proc.start()
        try:
            out = replay(capsys, "--trace", str(SLICE), "--policy", "lru", "--num-blocks", "300000",
                         "--collector", files.socket_path, "--run-id", "slice")

            def stored() -> Any:
                runs = {r["run_id"]: r for r in httpx.get(f"{files.http_url}/api/v1/runs").json()}
                run = runs.get("slice")
                return run if run and run["events"] >= out["events_emitted"] else None

            wait_until(stored, timeout=120, what="the replay's events stored")
        finally:
            proc.stop()
        con = duckdb.connect(files.db_path, read_only=True)
        lookups = con.execute("SELECT request_id, family FROM events WHERE run_id = 'slice' "
                              "AND event = 'prefix_lookup'").fetchall()
        con.close()
    assert out["events_dropped"] == 0
    rows, chains = slice_chains()
    family = {int(rid.rsplit("/", 1)[1]): fam for rid, fam in lookups}
    assert sorted(family) == list(range(len(rows)))
    by_row = [family[i] for i in range(len(rows))]
    sizes = Counter(by_row)
    assert len(sizes) == 279 and max(sizes.values()) == 3
    assert partition(by_row) == partition([conversation(r) for r in rows])
    assert partition(by_row) == partition(offline_families(rows, chains))
