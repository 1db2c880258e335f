"""/api/v1/runs/{run_id}/misses and /api/v1/requests/{request_id}: why prompt tokens were recomputed
(docs/design.md §5, miss attribution)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from kvfabric.api.analysis_models import RequestStory, RunMisses
from kvfabric.api.dependencies import Runner
from kvfabric.api.models import ErrorBody
from kvfabric.queries.misses import DEFAULT_BUCKET_S, MIN_BUCKET_S

router = APIRouter(tags=["misses"])


@router.get(
    "/runs/{run_id}/misses",
    response_model=RunMisses,
    responses={404: {"model": ErrorBody}, 422: {"model": ErrorBody}},
    summary="Prompt tokens split into hit / evicted / novel / uncacheable, by family and time window",
)
def run_misses(
    run_id: str,
    runner: Runner,
    bucket_s: Annotated[float, Query(ge=MIN_BUCKET_S, le=1e9, description="time-window length in seconds")] = (
        DEFAULT_BUCKET_S
    ),
) -> dict[str, object]:
    return runner.misses(run_id, bucket_s=bucket_s)


@router.get(
    "/requests/{request_id:path}",
    response_model=RequestStory,
    responses={404: {"model": ErrorBody}, 422: {"model": ErrorBody}},
    summary="One request's story: its lookup, which blocks hit, which were recomputed and why",
)
def request_story(
    request_id: str,
    runner: Runner,
    run: Annotated[str | None, Query(description="run id; every run that saw this request id when omitted")] = None,
) -> dict[str, object]:
    return runner.request(request_id, run=run)
