"""/api/v1/fleet: per host and engine, the fleet's hit rate, evictions, rebuilt, wasted prefill, ingest lag and loss."""

from __future__ import annotations

from fastapi import APIRouter

from kvfabric.api.dependencies import Runner
from kvfabric.api.models import ErrorBody, FleetOverview
from kvfabric.api.params import RunFilter, SinceNs, UntilNs

router = APIRouter(tags=["fleet"])


@router.get(
    "/fleet",
    response_model=FleetOverview,
    responses={404: {"model": ErrorBody}, 422: {"model": ErrorBody}},
    summary="Fleet overview: one row per (host, engine) and their totals, over a time window",
)
def fleet_overview(
    runner: Runner, since_ns: SinceNs = None, until_ns: UntilNs = None, run: RunFilter = None
) -> dict[str, object]:
    return runner.fleet(since_ns=since_ns, until_ns=until_ns, run=run)
