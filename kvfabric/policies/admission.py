"""The admission gate (``KVFABRIC_ADMISSION_ANCHOR_BLOCKS``): cache only the anchor of requests nobody shares yet.

A request outside a known family caches at most its first ``anchor_blocks`` full blocks. The anchor is enough for
a later request of the same family to find it (and make the family known); the long private remainder, which a
one-off request never reuses, stays out of the prefix cache, so it cannot push shared prefixes out. vLLM keeps
such blocks uncached, so they return to the head of the free queue and are reused first (docs/design.md §3).

Known family: one seen before in this engine (a previous request had the same family id), or one the client
named (a ``kvfabric_family`` or ``kvfabric_session`` hint: the client says more is coming). The decision is taken
once per request, at its first caching call, so a request never becomes "known" to itself halfway through.

Invariants:
  * the gate only ever *narrows* vLLM's own mask (a block vLLM would not cache stays uncached);
  * memory is bounded: at most ``max_families`` family ids and ``max_requests`` per-request decisions are kept,
    oldest forgotten first (forgetting a family costs one more gated request, never correctness).
"""

from __future__ import annotations

from collections import OrderedDict


class AnchorAdmissionGate:
    """Decides how many leading blocks of a request may be cached. Inside vLLM its seam is
    :class:`kvfabric.engine.steering.admission.AdmissionSeam`; the offline replay calls :meth:`decide` itself."""

    def __init__(self, anchor_blocks: int, max_families: int = 1 << 18, max_requests: int = 1 << 16) -> None:
        if anchor_blocks < 1:
            raise ValueError("anchor_blocks must be >= 1 (0 means: no gate at all)")
        self.anchor_blocks = anchor_blocks
        self.max_families = max_families
        self.max_requests = max_requests
        self.known: OrderedDict[str, None] = OrderedDict()
        self.decided: OrderedDict[str, int | None] = OrderedDict()
        self.limited_requests = 0
        self.limited_blocks = 0

    # ---- the pure decision (shared with the offline replay) -------------------------------------------------

    def decide(self, request_id: str, family: str | None, hinted: bool) -> int | None:
        """How many leading blocks ``request_id`` may cache (None: no limit). Sticky per request."""
        if request_id in self.decided:
            return self.decided[request_id]
        known = hinted or (family is not None and family in self.known)
        limit = None if known else self.anchor_blocks
        self.decided[request_id] = limit
        if len(self.decided) > self.max_requests:
            self.decided.popitem(last=False)
        if family is not None:
            self.known[family] = None
            self.known.move_to_end(family)
            if len(self.known) > self.max_families:
                self.known.popitem(last=False)
        if limit is not None:
            self.limited_requests += 1
        return limit

    def forget_request(self, request_id: str) -> None:
        self.decided.pop(request_id, None)

    def limit(self, known: bool, start: int, end: int) -> int:
        """Offline helper: the number of leading blocks cached for a request whose blocks ``[start, end)`` are new."""
        return end if known else max(start, min(end, self.anchor_blocks))
