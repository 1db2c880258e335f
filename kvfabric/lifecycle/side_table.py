"""The side table: what KVFabric knows about every KV block, and the only code that changes it.

vLLM's ``KVCacheBlock`` has ``__slots__``, so per-block knowledge lives here, in parallel lists indexed by block id
(O(1), no per-block objects). Three owners keep one each, through the same operations, so the statistics a policy
reads mean the same thing everywhere:

* the lifecycle expander (:mod:`kvfabric.lifecycle.expander`), in the forwarder process (or in-process for replays
  and tests), turns vLLM's calls into events and fills every column of a block event from here;
* steering (:mod:`kvfabric.engine.steering`), inside vLLM's scheduler process, only when a policy needs statistics;
* the offline replay (:mod:`kvfabric.sim.offline`), which models the prefix cache without vLLM.

Invariants:
  * an entry describes the block's *current* cached life: :meth:`seal` starts it, :meth:`reset` (eviction) ends
    it, so ``hits`` / ``share`` / ``branch`` count uses of one cached content;
  * ``last_use`` is on the owner's clock: wall-clock ns in the expander (events' ``age_ns``), the victim index's
    logical clock (blocks handed out so far) where a policy reads it, so a policy compares it with the ``now`` it
    is given and never with wall time;
  * ``users`` remembers at most :data:`MAX_USERS` request ids per block; beyond that ``share`` counts changes of
    user (a bound on memory, not an approximation in practice: blocks shared by more than 8 live requests are
    already anchors);
  * the *lean* operations (:meth:`seal_run_lean`, :meth:`hit_all`, :meth:`forget_all`) keep only
    :data:`LEAN_COLUMNS`, for a policy inside vLLM that reads nothing else (``EvictionPolicy.reads``): for every
    block holding content (``hash`` set), those columns equal what the full operations would hold; a block without
    content keeps stale values in them, which nothing reads (a policy keys cached blocks only, and the victim index
    checks ``hash``).
"""

from __future__ import annotations

MAX_USERS = 8

INDEX_COLUMNS = frozenset({"hash", "parent", "parent_block"})
"""What the victim index reads itself (the parent link of its descendants-first rule): kept for every policy whose
keeper follows sealings (a keeper of :data:`CANDIDATE_COLUMNS` does not: the index's links then come from frees)."""
LEAN_COLUMNS = INDEX_COLUMNS | {"hits", "depth"}
"""What the lean operations keep (``protected`` and ``score`` are steering's own, written by it either way)."""
CANDIDATE_COLUMNS = frozenset({"hash", "hits"})
"""What a keeper keeps with no sealing at all, for a policy that reads nothing else: ``hits`` counted by touches and
restarted when vLLM hands the block out for new content (:meth:`SideTable.forget_all`), ``hash`` written when the
block becomes a candidate (steering's ``freed_candidates``, from vLLM's own block). The victim index then takes its
parent links from the free itself (a request's blocks, tail first), not from ``parent`` / ``parent_block``."""


class SideTable:
    """Per-block statistics, one list per field, indexed by block id (read by policies, written by the owners)."""

    __slots__ = (
        "branch",
        "children",
        "depth",
        "family",
        "hash",
        "hits",
        "last_use",
        "num_blocks",
        "parent",
        "parent_block",
        "protected",
        "score",
        "share",
        "users",
    )

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.hash: list[int | None] = [None] * num_blocks
        self.parent: list[int | None] = [None] * num_blocks
        self.depth: list[int | None] = [None] * num_blocks
        self.family: list[str | None] = [None] * num_blocks
        self.hits: list[int] = [0] * num_blocks
        self.share: list[int] = [0] * num_blocks
        self.users: list[tuple[str, ...]] = [()] * num_blocks
        self.branch: list[int] = [0] * num_blocks
        self.children: list[set[int] | None] = [None] * num_blocks
        self.last_use: list[int] = [0] * num_blocks
        # A policy's view, set when the block last became an eviction candidate (reported in events).
        self.protected: list[bool] = [False] * num_blocks
        self.score: list[float | None] = [None] * num_blocks
        # The id of the block that held this one's parent when it was sealed (-1: root or unknown), so the victim
        # index can keep descendants before ancestors without a hash lookup.
        self.parent_block: list[int] = [-1] * num_blocks

    # ---- the operations ----------------------------------------------------------------------------------------

    def seal(
        self,
        b: int,
        h: int,
        parent_hash: int | None,
        parent_block: int,
        depth: int,
        family: str | None,
        request_id: str,
        now: int,
    ) -> None:
        """Block ``b`` now caches content ``h`` (a new life), at ``depth``, sealed by ``request_id``.

        ``parent_block`` is the block holding the previous block of the chain (-1 if none); it gains a child.
        """
        self.hash[b] = h
        self.parent[b] = parent_hash
        self.depth[b] = depth
        self.family[b] = family
        self.hits[b] = 0
        self.share[b] = 1
        self.users[b] = (request_id,)
        self.last_use[b] = now
        self.parent_block[b] = parent_block
        if parent_block >= 0:
            kids = self.children[parent_block]
            if kids is None:
                self.children[parent_block] = {h}
                self.branch[parent_block] += 1
            elif h not in kids:
                kids.add(h)
                self.branch[parent_block] += 1

    def touch(self, b: int, request_id: str | None, now: int) -> None:
        """A prefix-cache hit on ``b`` by ``request_id`` (share degree counts distinct users)."""
        self.hits[b] += 1
        self.last_use[b] = now
        if request_id is None:
            return
        users = self.users[b]
        if request_id in users:
            return
        self.share[b] += 1
        self.users[b] = (*users, request_id) if len(users) < MAX_USERS else (*users[1:], request_id)

    def release(self, b: int, now: int) -> None:
        """A reference to ``b`` went (freed or ref count lowered): the block was last used now."""
        self.last_use[b] = now

    def reset(self, b: int) -> None:
        """``b`` lost its cached content (evicted, or about to be reused): its life ends."""
        self.hash[b] = None
        self.parent[b] = None
        self.depth[b] = None
        self.family[b] = None
        self.hits[b] = 0
        self.share[b] = 0
        self.users[b] = ()
        self.branch[b] = 0
        self.children[b] = None
        self.protected[b] = False
        self.score[b] = None
        self.parent_block[b] = -1

    # ---- the lean operations (LEAN_COLUMNS only; see the module docstring) ---------------------------------------

    def seal_run_lean(self, ids: list[int], digests: list[int | None], parent_hash: int | None, prev: int,
                      start: int, null_block: int) -> None:
        """:meth:`seal` of a sealing call's blocks, keeping the lean columns only: ``ids`` (digests ``digests``;
        ``None``: left uncached), the first at depth ``start`` under block ``prev`` (-1: none) holding
        ``parent_hash``, each next one under the one before it (the null block breaks the chain). One call per
        record: on vLLM's scheduler thread a Python call per block costs more than its writes."""
        hashes = self.hash
        parent = self.parent
        parent_block = self.parent_block
        depth = self.depth
        hits = self.hits
        for j, b in enumerate(ids):
            h = digests[j]
            if h is None or b == null_block:  # masked (left uncached) or a null block: no life starts here
                prev = -1 if b == null_block else b
                parent_hash = hashes[prev] if prev >= 0 else None
                continue
            hashes[b] = h
            parent[b] = parent_hash
            parent_block[b] = prev
            depth[b] = start + j
            hits[b] = 0
            prev = b
            parent_hash = h

    def hit_all(self, ids: list[int], null_block: int) -> None:
        """:meth:`touch` of each of ``ids`` (the null block aside), keeping the lean columns only."""
        hits = self.hits
        for b in ids:
            if b != null_block:
                hits[b] += 1

    def forget_all(self, ids: list[int]) -> None:
        """:meth:`reset` of each of ``ids`` (handed out by vLLM for new content), keeping the lean columns only: the
        content is gone and its hits with it; the other lean columns are rewritten by the block's next
        :meth:`seal_run_lean` before anything reads them."""
        hashes = self.hash
        hits = self.hits
        for b in ids:
            hashes[b] = None
            hits[b] = 0

    def score_all(self, ids: list[int], scores: list[float], flags: list[bool]) -> None:
        """The policy's retain scores and protection flags of blocks ``ids``, set when they became candidates (what
        eviction reports read)."""
        score = self.score
        protected = self.protected
        for b, sc, flag in zip(ids, scores, flags, strict=True):
            score[b] = sc
            protected[b] = flag

    def clear(self) -> None:
        """Every block lost its content (a prefix-cache reset)."""
        self.__init__(self.num_blocks)  # type: ignore[misc]

    def cached(self) -> list[int]:
        """Ids of the blocks with cached content (O(blocks): for resets and tests, never the hot path)."""
        return [b for b, h in enumerate(self.hash) if h is not None]


ALL_COLUMNS = frozenset(SideTable.__slots__) - {"num_blocks"}
"""Every column of the side table."""
