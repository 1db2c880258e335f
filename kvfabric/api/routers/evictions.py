"""/api/v1/evictions: block_evicted events with filters and keyset pagination."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from kvfabric.api.dependencies import Runner
from kvfabric.api.models import ErrorBody, EvictionPage
from kvfabric.queries import MAX_LIMIT

router = APIRouter(tags=["evictions"])


@router.get(
    "/evictions",
    response_model=EvictionPage,
    responses={404: {"model": ErrorBody}, 422: {"model": ErrorBody}},
    summary="Evicted blocks, oldest first; follow next_cursor for the next page",
)
def list_evictions(
    runner: Runner,
    run: str | None = None,
    family: str | None = None,
    engine: str | None = None,
    since_ns: Annotated[int | None, Query(description="inclusive lower bound on ts_ns")] = None,
    until_ns: Annotated[int | None, Query(description="exclusive upper bound on ts_ns")] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_LIMIT)] = 1000,
    cursor: Annotated[str | None, Query(description="next_cursor of the previous page")] = None,
) -> dict[str, object]:
    return runner.evictions(
        run=run, family=family, engine=engine, since_ns=since_ns, until_ns=until_ns, limit=limit, cursor=cursor
    )
