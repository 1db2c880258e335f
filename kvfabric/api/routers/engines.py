"""/api/v1/engines: the engines whose hook streams to this collector, listed before their first request."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Request

from kvfabric.api.models import EngineInfo, ErrorBody

router = APIRouter(tags=["engines"])


@router.get(
    "/engines",
    response_model=list[EngineInfo],
    responses={404: {"model": ErrorBody}},
    summary="Engines with KVFabric on that this collector hears from (connected first), idle or not",
)
def list_engines(request: Request) -> list[dict[str, object]]:
    """From memory, not the database: answers while storage fails, and lists an engine that sent no event yet."""
    engines = getattr(request.app.state, "engines", None)
    if engines is None:
        raise HTTPException(404, "this server has no ingest socket, so no engines (it is not a collector)")
    return engines.snapshot()
