"""/api/v1/blocks/{block_hash}/history."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path

from kvfabric.api.dependencies import Runner
from kvfabric.api.models import BlockHistory, ErrorBody
from kvfabric.api.params import RunFilter, limit_query

router = APIRouter(tags=["blocks"])


@router.get(
    "/blocks/{block_hash}/history",
    response_model=BlockHistory,
    responses={404: {"model": ErrorBody}, 422: {"model": ErrorBody}},
    summary="Every event of one block hash (16 hex digits, 0x-hex, or signed decimal)",
)
def block_history(
    block_hash: Annotated[str, Path(max_length=64, description="16 hex digits, 0x-hex, or signed decimal")],
    runner: Runner,
    run: RunFilter = None,
    limit: Annotated[int, limit_query(1000)] = 1000,
) -> dict[str, object]:
    return runner.block_history(block_hash, run=run, limit=limit)
