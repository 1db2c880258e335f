"""The LRU guard: a policy's own mistakes measured against what vLLM's LRU order would have done, online.

LRU evicts candidates in the order they became candidates (their last reference went). A policy that reorders
makes two kinds of difference, and only those two, one block at a time:

* it evicts a block LRU would still be holding (*ahead* of LRU's order): if a request asks for that block while
  LRU would still hold it *and the prefix before it*, that is a **mistake** (LRU would have hit, the policy
  misses). The policy judges the prefix: the blocks right after its own hit count while LRU would hold each of
  them, and only if LRU would also have hit the last block of the policy's hit (LRU's cached set is
  prefix-closed, so that block tells whether LRU's hit reaches that far);
* in exchange it keeps a block LRU would already have evicted (LRU's order has *passed* it): if a request hits
  that block, that is a **win** (the policy hits, LRU would have missed).

The guard replays LRU's order beside the policy with a FIFO of candidate entries and a cursor that advances one
live entry per block LRU would have had to allocate: one per eviction the policy makes, plus one per win (LRU
would have missed that block), minus one per mistake (LRU would have hit it). Without that correction the
counterfactual LRU would fall behind by every block the policy gains, and judge against a larger cache. Each
entry is a small list ``[block, state, digest]``, ``state`` one of :data:`WAITING` (a candidate both orders still
hold), :data:`AHEAD` (evicted by the policy, LRU still holds it), :data:`PASSED` (LRU's order has evicted it) or
:data:`GONE` (evicted by the policy and asked for again: no longer anywhere in LRU's order). The policy keeps an
evicted block's entry in its ghost memory, so a later request for the digest can be judged.

Trust: ``trust`` (in [0, 1], starting at 1) moves by every win and mistake as they happen: up by one block's
worth per win, down per mistake, where :attr:`LRUGuard.STEP_POOLS` pools of net mistakes take it from 1 to 0 (so
it follows the *net* count, ARC-style, and a model that keeps losing to LRU ends at 0). The policy departs from
LRU order by ``trust`` times its credit (:meth:`LRUGuard.departure`), never less than a small probe (at most
:attr:`LRUGuard.PROBE_POOLS` of a pool) that keeps the guard measuring, so trust can come back when the traffic
does. (The policy also slews its departure down gradually, so falling back never inverts recency.)

Checked against an exact LRU cache run in lockstep on the traces (fast mode, 512-token blocks), the counts
match to within a few percent. What it does not model: the blocks LRU would cache *differently* after a
difference (LRU's own duplicate of a rebuilt block), and a free that never lets the last block of a request's hit
become a candidate (still shared) leaves that request's pending mistakes uncounted.

Cost: O(1) amortised per candidate and per eviction (one list, one deque append, one pop); memory O(pool): the
FIFO is compacted when stale entries (blocks used again since) outnumber live ones.
"""

from __future__ import annotations

from collections import deque
from typing import ClassVar

WAITING = 0
AHEAD = 1
PASSED = 2
GONE = 3  # an evicted block asked for again: its old place in LRU's order no longer exists


class LRUGuard:
    """See the module docstring. ``held`` is the victim index's membership list (block id -> is a candidate)."""

    #: The probe: when trust is low the policy still departs from LRU by up to this many pools of allocations,
    #: so the guard keeps measuring and trust can come back when the traffic changes.
    PROBE_POOLS: ClassVar[float] = 1.0 / 64.0
    #: Net mistakes (in pools of blocks) that take trust from 1 to 0.
    STEP_POOLS: ClassVar[float] = 1.0

    __slots__ = ("_debt", "_step", "entry_of", "fifo", "held", "mistakes", "num_blocks", "trust", "wins")

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = max(1, num_blocks)
        self.fifo: deque[list] = deque()
        self.entry_of: list[list | None] = [None] * num_blocks
        self.held: list[bool] = [False] * num_blocks
        self.wins = 0  # blocks
        self.mistakes = 0
        self.trust = 1.0
        self._step = 1.0 / (self.STEP_POOLS * self.num_blocks)
        self._debt = 0  # evictions LRU's order still owes (LRU evicts once per block it would have to allocate)

    # ---- the policy's events -------------------------------------------------------------------------------

    def candidate(self, b: int, h: int | None, hit_by_freeing_request: bool) -> bool:
        """Block ``b`` (content ``h``) became a candidate; ``hit_by_freeing_request``: the request freeing it had
        hit it in the cache. Returns whether that hit was a win (LRU's order had passed the block before it)."""
        prev = self.entry_of[b]
        won = hit_by_freeing_request and prev is not None and prev[1] == PASSED and prev[2] == h
        if won:
            self.wins += 1
            if self.trust < 1.0:
                self.trust = min(1.0, self.trust + self._step)
            self._debt += 1  # LRU would have had to allocate this block: one more eviction in its order
        e = [b, WAITING, h]
        self.fifo.append(e)
        self.entry_of[b] = e
        if len(self.fifo) > 2 * self.num_blocks + 1024:
            self._compact()
        if won:
            self._pay()
        return won

    def evicted(self, b: int) -> list | None:
        """The policy evicted ``b``. Returns its entry when LRU would still hold it (to keep with the ghost)."""
        e = self.entry_of[b]
        self.entry_of[b] = None
        out = None
        if e is not None and e[1] == WAITING:
            e[1] = AHEAD
            out = e
        self._debt += 1
        self._pay()
        return out

    @staticmethod
    def asked_again(entry: list | None) -> bool:
        """A request asks again for a block the policy evicted (``entry``: what :meth:`evicted` returned).
        Returns whether LRU would still hold it. Either way the block is about to be used again, so its old place
        in LRU's order is gone (LRU would move it to the recent end; the policy's new candidate entry is that)."""
        if entry is None or entry[1] != AHEAD:
            return False
        entry[1] = GONE
        return True

    def mistake(self, blocks: int) -> None:
        """``blocks`` blocks a request asked for were evicted by the policy while LRU would have hit them."""
        self.mistakes += blocks
        self.trust = max(0.0, self.trust - blocks * self._step)
        self._debt -= blocks  # LRU would have hit them: that many fewer allocations, so fewer evictions

    def departure(self, credit: float) -> float:
        """How far (allocations) the policy may depart from LRU order given its own ``credit``: ``trust *
        credit``, but never less than a probe of ``min(credit, PROBE_POOLS pools)``."""
        return max(self.trust * credit, min(credit, self.PROBE_POOLS * self.num_blocks))

    # ---- LRU's order ---------------------------------------------------------------------------------------

    def _pay(self) -> None:
        n = self.num_blocks
        if self._debt < -n:
            self._debt = -n
        while self._debt > 0:
            if not self._advance():
                self._debt = min(self._debt, n)
                return
            self._debt -= 1

    def _advance(self) -> bool:
        """LRU evicts one block: the oldest entry it still holds (skipping blocks used again since). False when
        LRU's order holds nothing."""
        fifo = self.fifo
        held = self.held
        entry_of = self.entry_of
        while fifo:
            e = fifo.popleft()
            state = e[1]
            if state == AHEAD:
                e[1] = PASSED  # LRU now evicts what the policy evicted earlier
                return True
            if state == WAITING and held[e[0]] and entry_of[e[0]] is e:
                e[1] = PASSED  # LRU evicts a block the policy keeps
                return True
            # Otherwise the block was used again (it left both orders) or its entry is stale: not LRU's victim.
        return False

    def _compact(self) -> None:
        held = self.held
        entry_of = self.entry_of
        self.fifo = deque(e for e in self.fifo
                          if e[1] == AHEAD or (e[1] == WAITING and held[e[0]] and entry_of[e[0]] is e))

    def describe(self) -> dict[str, float]:
        return {"trust": self.trust, "wins": self.wins, "mistakes": self.mistakes}
