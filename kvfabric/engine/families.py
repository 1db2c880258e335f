"""Prefix families: the family of every request an engine sees (docs/design.md §5).

The family of a request is decided once, when the engine first sees the request: its ``kvfabric_family`` hint;
else, only when the operator opts in (``KVFABRIC_FAMILY_FROM_REQUEST_ID=1``), the part of the request id before the
first ``/``; else, when ``KVFABRIC_FAMILY_DEPTH`` = F is set, the digest of the block at depth ``min(F, len - 1)``
of its chain; else the digest of the block just below the widest branch point of its chain in the prefix tree of
the requests the engine named so far (:class:`FamilyTree`). Requests shorter than one block have no family (None).
The request-id rule is opt-in because ids are not ours: the trace replay names requests ``trace/N``, which would
put a whole trace in one family.

:class:`FamilyNamer` applies the rule for one engine (it holds that engine's tree; the engine's ``Recorder`` owns
the one instance, on vLLM's scheduler thread); the offline replay (:mod:`kvfabric.sim.offline`) applies the same
:class:`FamilyTree` to its block keys, so both replay modes group requests identically.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

from kvfabric.contract import schema as S
from kvfabric.engine.hints import named_family

#: Blocks a :class:`FamilyTree` holds before it prunes what no request passed lately. Each costs a pointer here
#: and keeps vLLM's hash (~65 bytes) alive after vLLM drops it: at most ~40 MB.
FAMILY_TREE_BLOCKS = 1 << 19
#: Requests a :class:`FamilyNamer` remembers the family of (a preempted request resumed keeps its family).
NAMED_REQUESTS = 1 << 16


def _block_family(block_hash: Any) -> str | None:
    h = S.hash64(block_hash)
    return S.family_of_hash(h) if h is not None else None


def request_family(
    request: Any, block_hashes: Sequence[Any], family_depth: int | None, from_request_id: bool = False
) -> str | None:
    """The family by the request's own name, else by the fixed depth ``family_depth`` (None: the first block).

    Stateless, so it cannot apply the default rule: :class:`FamilyNamer` does (it holds the tree)."""
    named = named_family(request, from_request_id)
    if named is not None or not block_hashes:
        return named
    return _block_family(block_hashes[min(family_depth or 0, len(block_hashes) - 1)])


class FamilyNamer:
    """The family of every request one engine sees (the rule of the module docstring), decided at the first call
    for a request and the same at every later one (a preempted request resumed keeps it; at least the last
    :data:`NAMED_REQUESTS` / 2 requests are remembered).

    ``depth``: ``KVFABRIC_FAMILY_DEPTH`` (None: the default rule). Only requests named by the default rule enter the
    tree: a hinted request costs nothing more than reading its hint."""

    __slots__ = ("depth", "from_request_id", "named", "named_old", "tree")

    def __init__(self, depth: int | None = None, from_request_id: bool = False,
                 capacity: int = FAMILY_TREE_BLOCKS) -> None:
        self.depth = depth
        self.from_request_id = from_request_id
        self.tree = FamilyTree(capacity)
        # request id -> (its first block's hash, its family), in two generations (the older is dropped when the
        # newer holds NAMED_REQUESTS / 2); the hash tells a reused id from a resumed request
        self.named: dict[str, tuple[Any, str | None]] = {}
        self.named_old: dict[str, tuple[Any, str | None]] = {}

    def __call__(self, request: Any, block_hashes: Sequence[Any]) -> str | None:
        named = named_family(request, self.from_request_id)
        if named is not None or not block_hashes:
            return named
        if self.depth is not None:
            return _block_family(block_hashes[min(self.depth, len(block_hashes) - 1)])
        rid = getattr(request, "request_id", None)
        first = block_hashes[0]
        done = self.named.get(rid) or self.named_old.get(rid)  # type: ignore[arg-type]
        if done is not None and done[0] == first:
            return done[1]
        family = _block_family(block_hashes[self.tree.add(block_hashes)])
        memo = self.named
        memo[rid] = (first, family)  # type: ignore[index]
        if len(memo) >= NAMED_REQUESTS >> 1:
            self.named_old, self.named = memo, {}
        return family


class _Node:
    """A node of :class:`FamilyTree`: the chain segment from its parent's depth (exclusive) to its own
    (inclusive), with the chains that passed it (all of its blocks: a chain ending inside a segment splits it)."""

    __slots__ = ("children", "count", "depth", "r", "seg", "stamp")

    def __init__(self, depth: int, seg: Sequence[Hashable], count: int, stamp: int) -> None:
        self.depth = depth
        self.seg = seg  # identities at depths depth - len(seg) + 1 .. depth
        self.count = count  # chains that passed it
        self.r = 0  # children passed by >= 2 chains
        self.children: dict[Hashable, _Node] | None = None  # by their first block
        self.stamp = stamp  # the tree's generation when a chain last passed it


class FamilyTree:
    """The prefix tree of the chains it has named, and the default family rule (docs/design.md §5).

    A chain is a request's full prompt blocks as prefix-chained identities (vLLM's block hashes, or the offline
    replay's keys): equal identities at a depth mean equal prefixes. For every block the tree knows its
    *continuations* (the distinct blocks seen right after it, ``k``) and how many of those were *reused* (passed
    by at least two chains, ``r``); the chain's start counts as a block whose continuations are first blocks.

    :meth:`add` adds a chain, then names it: the block of the chain (the start included, its last block excluded)
    of greatest rank ``(r if r >= 2 else 0, k if k >= 2 else 0)``, the shallowest among equals, is its widest
    branch point, and the family is the chain's block just below it. So a trunk that every chain shares (a chat
    template, a common system prompt) is not a family: below its end the traffic splits into many reused
    continuations (conversations, documents, templates), each of them a family; one-off tails hanging off a
    template (``r`` < 2 there) do not split it. Until some block of the chain has two reused continuations, the one
    with the most continuations stands in; a chain that met no branch at all is named by its first block.

    Invariants:
      * deterministic: the name depends only on the chains added before and this one, in order, and only on the
        equality of identities (vLLM's hashes and the offline replay's keys give the same partition);
      * stored as a radix tree (a node per branch point and chain end, holding its segment of identities), so a
        chain costs O(nodes on its path) dictionary probes plus O(log n) comparisons where it leaves a segment
        and one slice copy of its new blocks: nothing per block is hashed;
      * memory: when the segments hold ``capacity`` blocks, the nodes no chain passed since the previous pruning
        are dropped, and the next pruning waits until ``capacity / 2`` more blocks are held: at most
        ``max(capacity, W + capacity / 2)`` blocks, W being those the chains since the previous pruning passed.
        A dropped block counts as new if it comes back (its branch point's counts grow again); a shared trunk's
        end, which every chain passes, is never dropped, so it keeps naming the same families.
    """

    __slots__ = ("capacity", "held", "limit", "root", "stamp")

    def __init__(self, capacity: int = FAMILY_TREE_BLOCKS) -> None:
        self.capacity = max(2, capacity)
        self.root = _Node(-1, (), 0, 0)
        self.held = 0  # blocks held in segments
        self.limit = self.capacity  # pruning happens when held reaches it
        self.stamp = 0

    def __len__(self) -> int:
        """Blocks held."""
        return self.held

    def add(self, chain: Sequence[Hashable]) -> int:
        """Add ``chain`` (non-empty) and return the depth of the block that names its family."""
        last = len(chain) - 1
        stamp = self.stamp
        u = self.root
        u.count += 1
        u.stamp = stamp
        best = (-1, -1, 0)  # (r if >= 2, k if >= 2, -depth) of the widest branch point so far
        while u.depth < last:
            d = u.depth
            children = u.children
            v = None if children is None else children.get(chain[d + 1])
            if v is None:  # a new continuation of u: the rest of the chain, one leaf
                if children is None:
                    children = u.children = {}
                children[chain[d + 1]] = _Node(last, tuple(chain[d + 1:last + 1]), 1, stamp)
                self.held += last - d
            else:
                seg = v.seg
                base = d + 1  # depth of seg[0], which the chain shares (it is v's key)
                m = v.depth if v.depth < last else last
                if chain[m] != seg[m - base]:  # it leaves the segment: after its last shared depth
                    lo, hi = base, m - 1
                    while lo < hi:
                        mid = (lo + hi + 1) >> 1
                        if chain[mid] == seg[mid - base]:
                            lo = mid
                        else:
                            hi = mid - 1
                    m = lo
                if m < v.depth:  # a node where the chain leaves (or ends inside) v's segment
                    v = self._split(u, v, m - base + 1)
                v.count += 1
                if v.count == 2:
                    u.r += 1
                v.stamp = stamp
            # u continues on the chain: a candidate, ranked with this chain counted.
            r = u.r
            k = len(children)  # type: ignore[arg-type]
            rank = (r if r >= 2 else 0, k if k >= 2 else 0, -d)
            if rank > best:
                best = rank
            if v is None:
                break
            u = v
        if self.held >= self.limit:
            self._prune()
        return 1 - best[2]

    @staticmethod
    def _split(u: _Node, v: _Node, cut: int) -> _Node:
        """Split ``v`` (a child of ``u``) after the first ``cut`` blocks of its segment; returns the new upper node."""
        seg = v.seg
        w = _Node(v.depth - len(seg) + cut, seg[:cut], v.count, v.stamp)
        w.r = 1 if v.count >= 2 else 0
        v.seg = seg[cut:]
        w.children = {v.seg[0]: v}
        u.children[seg[0]] = w  # type: ignore[index]
        return w

    def _prune(self) -> None:
        """Drop every node no chain passed since the previous pruning (with the nodes below it)."""
        stamp = self.stamp
        stack = [self.root]
        while stack:
            node = stack.pop()
            children = node.children
            if not children:
                continue
            for key in [key for key, c in children.items() if c.stamp < stamp]:
                c = children.pop(key)
                if c.count >= 2:
                    node.r -= 1
                below = [c]
                while below:  # (the blocks its subtree held)
                    x = below.pop()
                    self.held -= len(x.seg)
                    if x.children:
                        below.extend(x.children.values())
            stack.extend(children.values())
        self.stamp = stamp + 1
        self.limit = max(self.capacity, self.held + self.capacity // 2)
