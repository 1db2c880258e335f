"""/api/v1/families, /api/v1/families/{family}."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from kvfabric.api.dependencies import Runner
from kvfabric.api.models import ErrorBody, FamilyDetail, FamilyStats
from kvfabric.api.params import (
    MAX_TEXT,
    HostFilter,
    LoraFilter,
    NoNul,
    PathText,
    RequiredRun,
    TenantFilter,
    limit_query,
)

router = APIRouter(tags=["families"])


@router.get(
    "/families",
    response_model=list[FamilyStats],
    responses={404: {"model": ErrorBody}, 422: {"model": ErrorBody}},
    summary="Prefix families by wasted prefill (most first)",
)
def list_families(
    runner: Runner,
    run: Annotated[str | None, Query(max_length=MAX_TEXT, description="run id; every run when omitted (slower)"),
                   NoNul] = None,
    limit: Annotated[int, limit_query(100)] = 100,
    host: HostFilter = None,
    tenant: TenantFilter = None,
    lora: LoraFilter = None,
) -> list[dict[str, object]]:
    return runner.families(run=run, limit=limit, host=host, tenant=tenant, lora=lora)


@router.get(
    "/families/{family}",
    response_model=FamilyDetail,
    responses={404: {"model": ErrorBody}, 422: {"model": ErrorBody}},
    summary="One family of one run, with evictions and rebuilds by depth",
)
def family_detail(family: PathText, runner: Runner, run: RequiredRun) -> dict[str, object]:
    return runner.family_detail(run=run, family=family)
