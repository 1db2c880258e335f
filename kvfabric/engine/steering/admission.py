"""The admission gate's vLLM seam: vLLM's ``block_mask`` for ``cache_full_blocks``, narrowed by the gate.

The decision is the policy side's (:class:`~kvfabric.policies.admission.AnchorAdmissionGate`, shared with the
offline replay, no vLLM object); this seam reads vLLM's request (its family through the recorder, its hints) and
vLLM's mask, and records what the gate kept out (``LIMITED``). Runs on vLLM's scheduler thread, called by the pool
hook of ``cache_full_blocks`` (:mod:`kvfabric.engine.pool`) through ``recorder.gate``.

Invariants: the seam only ever *narrows* vLLM's own mask, and never raises (on any internal error vLLM's mask
stands).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvfabric.engine.hints import hinted
from kvfabric.policies.admission import AnchorAdmissionGate


class AdmissionSeam:
    """``gate``'s decisions applied to vLLM's calls (the gate keeps its own counters: ``limited_blocks`` ...)."""

    __slots__ = ("gate",)

    def __init__(self, gate: AnchorAdmissionGate) -> None:
        self.gate = gate

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
        """
        try:
            return self._mask(recorder, request, start, end, vllm_mask)
        except Exception:
            return None if vllm_mask is None else list(vllm_mask)

    def _mask(
        self, recorder: Any, request: Any, start: int, end: int, vllm_mask: Sequence[bool] | None
    ) -> list[bool] | None:
        gate = self.gate
        limit = gate.decided.get(request.request_id, -1)
        if limit == -1:
            limit = gate.decide(request.request_id, recorder.family_of(request), hinted(request))
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
            gate.limited_blocks += masked
            recorder.limited(request, masked)
        return mask
