"""/api/v1/runs, /api/v1/runs/{run_id}/summary, /api/v1/compare."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter

from kvfabric.api.dependencies import Runner
from kvfabric.api.models import Comparison, ErrorBody, RunInfo, RunSummary
from kvfabric.api.params import HostFilter, LoraFilter, NoNul, PathText, TenantFilter, text_query

router = APIRouter(tags=["runs"])


@router.get("/runs", response_model=list[RunInfo], summary="Every run seen by this collector")
def list_runs(runner: Runner) -> list[dict[str, object]]:
    return runner.runs()


@router.get(
    "/runs/{run_id}/summary",
    response_model=RunSummary,
    responses={404: {"model": ErrorBody}, 422: {"model": ErrorBody}},
    summary="Analytics summary of one run (docs/design.md §5), optionally of one host, tenant or LoRA adapter",
)
def run_summary(
    run_id: PathText,
    runner: Runner,
    host: HostFilter = None,
    tenant: TenantFilter = None,
    lora: LoraFilter = None,
) -> dict[str, object]:
    return runner.run_summary(run_id, host=host, tenant=tenant, lora=lora)


@router.get(
    "/compare",
    response_model=Comparison,
    responses={404: {"model": ErrorBody}, 422: {"model": ErrorBody}},
    summary="Two runs side by side, with b - a deltas",
)
def compare(
    runner: Runner,
    a: Annotated[str, text_query("baseline run id", required=True), NoNul],
    b: Annotated[str, text_query("run compared with a", required=True), NoNul],
) -> dict[str, object]:
    return runner.compare(a, b)
