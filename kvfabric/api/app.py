"""The FastAPI application: read-only REST under /api/v1, /healthz, /metrics, OpenAPI at /docs.

It owns no database: it is given a :class:`~kvfabric.queries.QueryRunner` (the collector passes one whose
connections share its own database instance) and, optionally, the metrics registry and a health callable.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from fastapi import APIRouter, Depends, FastAPI
from prometheus_client import CollectorRegistry

import kvfabric
from kvfabric.api.dependencies import reject_unknown_query_params, require_token
from kvfabric.api.errors import install_error_handlers
from kvfabric.api.routers import blocks, evictions, families, runs, system
from kvfabric.api.routers import misses as misses_router
from kvfabric.api.routers import whatif as whatif_router
from kvfabric.queries import QueryRunner

API_PREFIX = "/api/v1"
TOKEN_ENV = "KVFABRIC_API_TOKEN"

HealthFn = Callable[[bool], dict[str, object]]
"""Called with whether the caller is authenticated; returns the /healthz body (``status`` "ok" means 200)."""


def create_app(
    runner: QueryRunner,
    *,
    registry: CollectorRegistry | None = None,
    health: HealthFn | None = None,
    token: str | None = None,
) -> FastAPI:
    """Build the app. ``token`` (else ``$KVFABRIC_API_TOKEN``) protects /api/v1 and /metrics when set."""
    app = FastAPI(
        dependencies=[Depends(reject_unknown_query_params)],  # a misspelt filter is a 422, not ignored
        title="KVFabric collector",
        version=kvfabric.__version__,
        description="Read-only analytics over vLLM KV-cache block lifecycle events (docs/design.md §5, §7).",
    )
    app.state.runner = runner
    app.state.registry = registry
    app.state.health = health
    app.state.token = token if token is not None else (os.environ.get(TOKEN_ENV) or None)
    install_error_handlers(app)
    api = APIRouter(prefix=API_PREFIX, dependencies=[Depends(require_token)])
    for module in (runs, families, evictions, blocks, misses_router, whatif_router):
        api.include_router(module.router)
    app.include_router(api)
    app.include_router(system.router)
    return app
