"""/api/v1/evictions: block_evicted events with filters and keyset pagination."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter

from kvfabric.api.dependencies import Runner
from kvfabric.api.models import ErrorBody, EvictionPage
from kvfabric.api.params import (
    CursorParam,
    EngineFilter,
    FamilyFilter,
    HostFilter,
    LoraFilter,
    RunFilter,
    SinceNs,
    TenantFilter,
    UntilNs,
    limit_query,
)

router = APIRouter(tags=["evictions"])


@router.get(
    "/evictions",
    response_model=EvictionPage,
    responses={404: {"model": ErrorBody}, 422: {"model": ErrorBody}},
    summary="Evicted blocks, oldest first; follow next_cursor for the next page",
)
def list_evictions(
    runner: Runner,
    cursor: CursorParam,
    run: RunFilter = None,
    family: FamilyFilter = None,
    engine: EngineFilter = None,
    host: HostFilter = None,
    tenant: TenantFilter = None,
    lora: LoraFilter = None,
    since_ns: SinceNs = None,
    until_ns: UntilNs = None,
    limit: Annotated[int, limit_query(1000)] = 1000,
) -> dict[str, object]:
    return runner.evictions(
        run=run, family=family, engine=engine, since_ns=since_ns, until_ns=until_ns, limit=limit, cursor=cursor,
        host=host, tenant=tenant, lora=lora,
    )
