"""/api/v1/runs/{run_id}/lifetimes: how long blocks stayed cached before their eviction (sql/lifetimes.sql), from
either event source."""

from __future__ import annotations

from fastapi import APIRouter

from kvfabric.api.analysis_models import RunLifetimes
from kvfabric.api.dependencies import Runner
from kvfabric.api.models import ErrorBody
from kvfabric.api.params import PathText

router = APIRouter(tags=["lifetimes"])


@router.get(
    "/runs/{run_id}/lifetimes",
    response_model=RunLifetimes,
    responses={404: {"model": ErrorBody}, 422: {"model": ErrorBody}},
    summary="Block lifetimes: seconds from seal to eviction, for the run and per family",
)
def run_lifetimes(run_id: PathText, runner: Runner) -> dict[str, object]:
    return runner.lifetimes(run_id)
