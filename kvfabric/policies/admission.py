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
from collections.abc import Sequence
from typing import Any


class AnchorAdmissionGate:
    """Decides how many leading blocks of a request may be cached; plugs into the hook as ``tracker.admission_gate``."""

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

    # ---- the hook's seam ----------------------------------------------------------------------------------

    def mask(
        self,
        recorder: Any,
        request: Any,
        start: int,
        end: int,
        vllm_mask: Sequence[bool] | None,
    ) -> list[bool] | None:
        """``block_mask`` for ``cache_full_blocks(request, blocks, start, end, ...)``: vLLM's mask, narrowed.

        ``recorder`` gives the request's family (``family_of``) and records what the gate refused (``limited``).
        Returns ``vllm_mask`` unchanged (possibly None) when the request may cache everything in ``[start, end)``.
        Never raises (it runs on vLLM's path): on any internal error vLLM's mask stands.
        """
        try:
            return self._mask(recorder, request, start, end, vllm_mask)
        except Exception:
            return None if vllm_mask is None else list(vllm_mask)

    def _mask(
        self, recorder: Any, request: Any, start: int, end: int, vllm_mask: Sequence[bool] | None
    ) -> list[bool] | None:
        from kvfabric.hook.hints import hinted  # the one reader of request hints

        limit = self.decided.get(request.request_id, -1)
        if limit == -1:
            limit = self.decide(request.request_id, recorder.family_of(request), hinted(request))
        if limit is None or end <= limit:
            return None if vllm_mask is None else list(vllm_mask)
        n = end - start
        mask = [True] * n if vllm_mask is None else list(vllm_mask)
        masked = 0
        for i in range(max(0, limit - start), n):
            if mask[i]:
                mask[i] = False
                masked += 1
        if masked:
            self.limited_blocks += masked
            recorder.limited(request, masked)
        return mask
