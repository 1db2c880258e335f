"""Request hints and prefix families: the one place that reads what a client said about a request.

Hints travel in ``SamplingParams.extra_args`` (``vllm_xargs`` on the OpenAI server), docs/design.md §3:
``kvfabric_family`` names the request's family, ``kvfabric_session`` names its conversation (vLLM 0.33's own
``request.session_id`` stands in when absent), ``kvfabric_session_end`` says this is the conversation's last turn.

The family of a request (docs/design.md §5): its ``kvfabric_family`` hint; else, only when the operator opts in
(``KVFABRIC_FAMILY_FROM_REQUEST_ID=1``), the part of the request id before the first ``/``; else the digest of the
block at depth ``min(F, len - 1)`` of its chain. Requests shorter than one block have no family (None). The
request-id rule is opt-in because ids are not ours: the trace replay names requests ``trace/N``, which would put a
whole trace in one family.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvfabric import schema as S
from kvfabric.policies.base import RequestInfo


def _extra_args(request: Any) -> dict[str, Any]:
    params = getattr(request, "sampling_params", None)
    extra = getattr(params, "extra_args", None) if params is not None else None
    return extra if isinstance(extra, dict) else {}


def request_info(request: Any) -> RequestInfo:
    """Everything a client said about ``request`` (absent hints are None / False)."""
    extra = _extra_args(request)
    session = extra.get("kvfabric_session")
    if session is None:
        session = getattr(request, "session_id", None)
    family = extra.get("kvfabric_family")
    return RequestInfo(
        request_id=str(getattr(request, "request_id", "")),
        family=None if family is None or family == "" else str(family),
        session=None if session is None else str(session),
        session_end=bool(extra.get("kvfabric_session_end", False)),
    )


def hinted(request: Any) -> bool:
    """Whether the client named a family or a session (the admission gate trusts such requests)."""
    extra = _extra_args(request)
    return bool(extra.get("kvfabric_family") or extra.get("kvfabric_session"))


def request_family(
    request: Any, block_hashes: Sequence[Any], family_depth: int, from_request_id: bool = False
) -> str | None:
    """Family id of ``request`` (see the module docstring for the rule)."""
    hint = _extra_args(request).get("kvfabric_family")
    if hint:
        return str(hint)
    if from_request_id:
        rid = getattr(request, "request_id", "")
        if "/" in rid:
            return rid.split("/", 1)[0]
    if not block_hashes:
        return None
    h = S.hash64(block_hashes[min(family_depth, len(block_hashes) - 1)])
    return S.family_of_hash(h) if h is not None else None
