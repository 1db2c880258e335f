"""Wrappers with the exact signature of the vLLM method they wrap, for calls made once per running request per step.

Why: ``KVCacheManager.allocate_slots`` is called for every running request in every scheduler step (hundreds of
times per step on a busy GPU), and a ``def w(*args, **kwargs): return f(*args, **kwargs)`` wrapper repacks its
arguments into a tuple and a dict on every call: several times the cost of forwarding named parameters on CPython
3.11 (``benchmarks/bench_hook_layout.py``). So the wrapper is generated, as ``dataclasses`` generates ``__init__``:
its parameters, defaults and kinds are the original's, and it forwards each parameter by position or keyword exactly
as it received it.

Invariants:
  * the generated function calls ``original`` with the same values for every parameter (defaults are the
    original's own default objects), so vLLM sees the same call;
  * when the signature cannot be read or reproduced, a generic ``*args, **kwargs`` wrapper with the same behaviour
    is returned instead (slower, never wrong).
"""

from __future__ import annotations

import inspect
import keyword
from collections.abc import Callable
from typing import Any

_FAST_PATH = """
def {name}({params}):
    if {first}.num_computed_tokens == 0:
        return _kvf_slow({call})
    _kvf_ctx.rid = {first}.request_id
    try:
        return _kvf_original({call})
    finally:
        _kvf_ctx.rid = None
"""


def _parameters_and_call(fn: Callable[..., Any]) -> tuple[str, str, str, dict[str, Any]] | None:
    """(first parameter's name, parameter list source, call argument source, defaults) for ``fn``'s signature,
    or None when it cannot be reproduced (no readable signature, no first positional parameter)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    params: list[str] = []
    call: list[str] = []
    defaults: dict[str, Any] = {}
    star_done = False
    slash_pending = False
    for i, p in enumerate(sig.parameters.values()):
        name = p.name
        if not name.isidentifier() or keyword.iskeyword(name) or name.startswith("_kvf_"):
            return None
        if slash_pending and p.kind is not p.POSITIONAL_ONLY:
            params.append("/")
            slash_pending = False
        text = name
        if p.default is not p.empty:
            defaults[f"_kvf_d{i}"] = p.default
            text = f"{name}=_kvf_d{i}"
        if p.kind is p.POSITIONAL_ONLY:
            params.append(text)
            call.append(name)
            slash_pending = True
        elif p.kind is p.POSITIONAL_OR_KEYWORD:
            params.append(text)
            call.append(name)
        elif p.kind is p.VAR_POSITIONAL:
            params.append(f"*{name}")
            call.append(f"*{name}")
            star_done = True
        elif p.kind is p.KEYWORD_ONLY:
            if not star_done:
                params.append("*")
                star_done = True
            params.append(text)
            call.append(f"{name}={name}")
        else:  # VAR_KEYWORD
            params.append(f"**{name}")
            call.append(f"**{name}")
    if slash_pending:
        params.append("/")
    first = next(iter(sig.parameters.values()), None)
    if first is None or first.kind not in (first.POSITIONAL_ONLY, first.POSITIONAL_OR_KEYWORD):
        return None
    return first.name, ", ".join(params), ", ".join(call), defaults


def request_context_wrapper(
    original: Callable[..., Any], context: Any, slow: Callable[..., Any], name: str
) -> Callable[..., Any]:
    """A wrapper of ``original`` (a bound method whose first parameter is a vLLM ``Request``) with its signature.

    When the request has computed nothing yet (an admission attempt), the call goes to ``slow`` with the same
    arguments (``slow`` calls ``original`` itself). Otherwise ``context.rid`` is the request's id for the length
    of the call (so the pool calls it makes know their request) and ``original`` runs.
    """
    parts = _parameters_and_call(original)
    if parts is None:
        return generic_wrapper(original, context, slow)
    first, params, call, defaults = parts
    namespace: dict[str, Any] = {"_kvf_original": original, "_kvf_ctx": context, "_kvf_slow": slow, **defaults}
    exec(_FAST_PATH.format(name=name, params=params, first=first, call=call), namespace)
    fn = namespace[name]
    fn.__doc__ = getattr(original, "__doc__", None)
    fn.__wrapped__ = original
    fn.__qualname__ = name
    return fn


def generic_wrapper(original: Callable[..., Any], context: Any, slow: Callable[..., Any]) -> Callable[..., Any]:
    """:func:`request_context_wrapper`'s behaviour with a ``*args, **kwargs`` signature (its fallback)."""
    def wrapper(request: Any, *args: Any, **kwargs: Any) -> Any:
        if request.num_computed_tokens == 0:
            return slow(request, *args, **kwargs)
        context.rid = request.request_id
        try:
            return original(request, *args, **kwargs)
        finally:
            context.rid = None

    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    return wrapper


def argument_reader(original: Callable[..., Any], parameter: str, default: Any = 0) -> Callable[..., Any]:
    """A function ``(request, *args, **kwargs) -> value of parameter`` for calls made with ``original``'s
    signature (the signature's default when the call does not pass it; ``default`` when it has none)."""
    try:
        params = list(inspect.signature(original).parameters.values())
    except (TypeError, ValueError):
        params = []
    names = [p.name for p in params]
    at = names.index(parameter) - 1 if parameter in names[1:] else None
    if at is not None and params[at + 1].default is not inspect.Parameter.empty:
        default = params[at + 1].default

    def read(request: Any, *args: Any, **kwargs: Any) -> Any:
        if parameter in kwargs:
            return kwargs[parameter]
        if at is not None and at < len(args):
            return args[at]
        return default

    return read
