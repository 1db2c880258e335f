"""/api/v1/blocks/{block_hash}/history."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from kvfabric.api.dependencies import Runner
from kvfabric.api.models import BlockHistory, ErrorBody
from kvfabric.queries import MAX_LIMIT

router = APIRouter(tags=["blocks"])


@router.get(
    "/blocks/{block_hash}/history",
    response_model=BlockHistory,
    responses={404: {"model": ErrorBody}, 422: {"model": ErrorBody}},
    summary="Every event of one block hash (16 hex digits, 0x-hex, or signed decimal)",
)
def block_history(
    block_hash: str,
    runner: Runner,
    run: str | None = None,
    limit: Annotated[int, Query(ge=1, le=MAX_LIMIT)] = 1000,
) -> dict[str, object]:
    return runner.block_history(block_hash, run=run, limit=limit)
