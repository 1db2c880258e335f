"""Request hints: the one place that reads what a client said about a request.

Hints travel in ``SamplingParams.extra_args`` (``vllm_xargs`` on the OpenAI server), docs/design.md §3:
``kvfabric_family`` names the request's family, ``kvfabric_session`` names its conversation (vLLM 0.33's own
``request.session_id`` stands in when absent), ``kvfabric_session_end`` says this is the conversation's last turn.
Read on vLLM's scheduler thread from vLLM's ``Request`` objects (duck-typed: any object with those attributes);
what a policy sees of them is a :class:`~kvfabric.policies.base.RequestInfo`.

Whose a request is (:func:`owner`): vLLM's own ``cache_salt`` (the tenant: vLLM salts the request's first block hash
with it) and its LoRA adapter's name (``lora_request.lora_name``, also part of vLLM's block hashes), read once per
admission attempt for its ``LOOKUP`` record.
"""

from __future__ import annotations

from typing import Any

from kvfabric.contract.protocol import MAX_LABEL_CHARS
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


def named_family(request: Any, from_request_id: bool = False) -> str | None:
    """The family the request itself names: its ``kvfabric_family`` hint, else (opted in) its request id's part
    before the first ``/``; None when it names none."""
    hint = _extra_args(request).get("kvfabric_family")
    if hint:
        return str(hint)
    if from_request_id:
        rid = getattr(request, "request_id", "")
        if "/" in rid:
            return rid.split("/", 1)[0]
    return None


def owner(request: Any) -> tuple[str | None, str | None]:
    """``(tenant, lora)`` of ``request``: its ``cache_salt`` (None when it has none, or an empty one, which vLLM does
    not hash either) and its LoRA adapter's name (None without an adapter). Each is cut to
    :data:`~kvfabric.contract.protocol.MAX_LABEL_CHARS` characters: the collector refuses a whole batch over a
    string longer than its cap, and a client chooses its salt."""
    salt = getattr(request, "cache_salt", None)
    tenant = None if not salt else str(salt)[:MAX_LABEL_CHARS]
    lora_request = getattr(request, "lora_request", None)
    name = None if lora_request is None else getattr(lora_request, "lora_name", None)
    return tenant, None if name is None else str(name)[:MAX_LABEL_CHARS]
