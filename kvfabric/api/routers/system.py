"""/healthz (never behind the token: orchestrators probe it) and /metrics (Prometheus text).

/healthz tells anyone whether the collector is healthy, and only authenticated callers where its files are (paths
and DuckDB error texts, which name files): it must not map the host for whoever can reach the port.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, HTTPException, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvfabric.api.dependencies import Authenticated, require_token
from kvfabric.api.models import Health

router = APIRouter(tags=["system"])


@router.get("/healthz", response_model=Health, responses={503: {"model": Health}})
def healthz(request: Request, authenticated: Authenticated) -> JSONResponse:
    health = request.app.state.health
    body = health(authenticated) if health is not None else {"status": "ok"}
    code = 200 if body["status"] == "ok" else 503
    return JSONResponse(Health(**body).model_dump(exclude_none=True), status_code=code)


@router.get(
    "/metrics",
    dependencies=[Depends(require_token)],
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text format"}},
)
def metrics(request: Request) -> Response:
    registry = request.app.state.registry
    if registry is None:
        raise HTTPException(404, "this server exposes no metrics (it is not a collector)")
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
