"""The FastAPI application: read-only REST under /api/v1, /healthz, /metrics, OpenAPI at /docs.

It owns no database: it is given a :class:`~kvfabric.queries.QueryRunner` (the collector passes one whose
connections share its own database instance) and, optionally, the metrics registry and a health callable.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from fastapi import APIRouter, Depends, FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import CollectorRegistry

import kvfabric
from kvfabric import settings as settings_table
from kvfabric.api.dependencies import reject_unknown_query_params, require_token
from kvfabric.api.errors import install_error_handlers
from kvfabric.api.routers import blocks, evictions, families, fleet, runs, system
from kvfabric.api.routers import engines as engines_router
from kvfabric.api.routers import lifetimes as lifetimes_router
from kvfabric.api.routers import misses as misses_router
from kvfabric.api.routers import whatif as whatif_router
from kvfabric.queries import QueryRunner

API_PREFIX = "/api/v1"
TOKEN_ENV = "KVFABRIC_API_TOKEN"

HealthFn = Callable[[bool], dict[str, object]]
"""Called with whether the caller is authenticated; returns the /healthz body (``status`` "ok" means 200)."""


#: Swagger UI's files, vendored (kvfabric/api/static/swagger-ui/README.md: origin, version, license).
DOCS_ASSETS_URL = "/static/swagger-ui"


def _install_docs(app: FastAPI) -> None:
    """``/docs``: Swagger UI loaded from the package, so it works offline (FastAPI's default loads it from a CDN)."""

    assets = Path(__file__).with_name("static") / "swagger-ui"
    app.mount(DOCS_ASSETS_URL, StaticFiles(directory=assets), name="swagger-ui")

    @app.get("/docs", include_in_schema=False)
    def docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=app.openapi_url or "/openapi.json", title=f"{app.title} - API",
            swagger_js_url=f"{DOCS_ASSETS_URL}/swagger-ui-bundle.js",
            swagger_css_url=f"{DOCS_ASSETS_URL}/swagger-ui.css",
            swagger_favicon_url=f"{DOCS_ASSETS_URL}/favicon-32x32.png",
            swagger_ui_parameters={"validatorUrl": None},  # no badge fetched from validator.swagger.io
        )


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
        docs_url=None,  # served by _install_docs from the package's own Swagger UI files (no CDN)
        redoc_url=None,
    )
    _install_docs(app)
    app.state.runner = runner
    app.state.registry = registry
    app.state.health = health
    app.state.token = token if token is not None else (str(settings_table.read(TOKEN_ENV)) or None)
    install_error_handlers(app)
    api = APIRouter(prefix=API_PREFIX, dependencies=[Depends(require_token)])
    for module in (runs, families, evictions, blocks, misses_router, lifetimes_router, whatif_router, engines_router,
                   fleet):
        api.include_router(module.router)
    app.include_router(api)
    app.include_router(system.router)
    return app
