"""Validated request parameters, shared by every router: a value the API cannot use is a 422 with a message naming
the parameter, never a 500 from deep inside a query.

Use them as parameter types (FastAPI reads the constraints from the ``Annotated`` metadata)::

    def route(since_ns: SinceNs = None, run: RunFilter = None, limit: Limit = 1000, cursor: CursorParam = None): ...

Rules: integers that reach SQL fit in a signed 64-bit integer (DuckDB's BIGINT, the type of every ``*_ns``
column); text filters are at most :data:`MAX_TEXT` characters and hold no NUL character; page sizes are 1 to
:data:`~kvfabric.queries.MAX_LIMIT`; cursors are decoded (and their numbers range-checked) before the query runs.
New routers should take their parameters from here (or build them with :func:`text_query` / :func:`int64_query`).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Path, Query
from pydantic import AfterValidator

from kvfabric.contract import protocol as P
from kvfabric.queries import MAX_LIMIT, BadParameter, Cursor

INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1
MAX_TEXT = P.MAX_LABEL_CHARS
"""Longest run id, family, engine or other text filter accepted (the hook accepts no longer run id or engine label;
stream metadata values are capped at :data:`kvfabric.contract.protocol.MAX_META_VALUE_CHARS`)."""


def _no_nul(value: str | None) -> str | None:
    if value is not None and "\x00" in value:
        raise ValueError("must not contain a NUL character")
    return value


def text_query(description: str, *, required: bool = False) -> object:
    """``Query`` metadata for a text filter (length cap + no NUL); pair with ``Annotated[str | None, ...]``."""
    return Query(description=description, min_length=1 if required else 0, max_length=MAX_TEXT)


def int64_query(description: str) -> object:
    """``Query`` metadata for an integer that must fit DuckDB's BIGINT."""
    return Query(description=description, ge=INT64_MIN, le=INT64_MAX)


NoNul = AfterValidator(_no_nul)

RunFilter = Annotated[str | None, text_query("run id"), NoNul]
"""Optional ``run`` filter."""
RequiredRun = Annotated[str, text_query("run id", required=True), NoNul]
"""Mandatory ``run`` parameter."""
FamilyFilter = Annotated[str | None, text_query("family id"), NoNul]
EngineFilter = Annotated[str | None, text_query("engine label"), NoNul]
HostFilter = Annotated[str | None, text_query("host name (the events' host column: KVFABRIC_HOST of the engine, "
                                             "else its machine's name)"), NoNul]
TenantFilter = Annotated[str | None, text_query("tenant: the requests' vLLM cache_salt"), NoNul]
LoraFilter = Annotated[str | None, text_query("LoRA adapter name of the requests"), NoNul]
SinceNs = Annotated[int | None, int64_query("inclusive lower bound on ts_ns (ns since the epoch, int64)")]
UntilNs = Annotated[int | None, int64_query("exclusive upper bound on ts_ns (ns since the epoch, int64)")]
PathText = Annotated[str, Path(min_length=1, max_length=MAX_TEXT), NoNul]
"""A text path segment (run id, family)."""


def limit_query(default: int) -> object:
    """``Query`` metadata for a page size (pair with ``Annotated[int, ...]`` and a default)."""
    return Query(ge=1, le=MAX_LIMIT, description=f"page size, 1..{MAX_LIMIT} (default {default})")


Limit = Annotated[int, Query(ge=1, le=MAX_LIMIT, description=f"row limit, 1..{MAX_LIMIT}")]


def _cursor(
    cursor: Annotated[str | None, Query(max_length=256, description="next_cursor of the previous page")] = None,
) -> str | None:
    """Decode now so a bad cursor is a 422 naming the parameter (the runner decodes it again: it is cheap)."""
    if cursor:
        try:
            Cursor.decode(cursor)
        except BadParameter as e:
            raise BadParameter(f"query parameter 'cursor': {e}") from e
    return cursor


CursorParam = Annotated[str | None, Depends(_cursor)]
"""``?cursor=`` of keyset pagination, validated."""
