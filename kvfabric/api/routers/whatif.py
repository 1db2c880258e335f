"""/api/v1/runs/{run_id}/whatif: the run's recorded traffic replayed under another policy or capacity, and under
the optimum (docs/design.md §5, what-if; the same answer as ``kvfabric whatif --format json``)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from kvfabric.analysis.whatif import MAX_REST_ADMISSIONS, whatif
from kvfabric.api.analysis_models import WhatIf
from kvfabric.api.dependencies import Runner
from kvfabric.api.models import ErrorBody

router = APIRouter(tags=["whatif"])


@router.get(
    "/runs/{run_id}/whatif",
    response_model=WhatIf,
    responses={404: {"model": ErrorBody}, 422: {"model": ErrorBody}},
    summary="Replay the run's traffic under policy P at N blocks and under the optimum, next to what it had",
)
def run_whatif(
    run_id: str,
    runner: Runner,
    policy: Annotated[str | None, Query(description="lru, family_protect, shared_aware, adaptive_aging or "
                                                    "optimal (default: the run's own)")] = None,
    num_blocks: Annotated[int | None, Query(ge=2, description="KV capacity in blocks per engine (default: the "
                                                              "run's own)")] = None,
    concurrency: Annotated[int | None, Query(ge=1, description="requests in flight in the replay (default: the "
                                                               "run's mean)")] = None,
) -> dict[str, object]:
    return whatif(runner, run_id, policy, num_blocks, concurrency, max_admissions=MAX_REST_ADMISSIONS)
