"""The collector's HTTP side: FastAPI routers over :mod:`kvfabric.queries`, plus /healthz and /metrics."""

from kvfabric.api.app import API_PREFIX, TOKEN_ENV, create_app

__all__ = ["API_PREFIX", "TOKEN_ENV", "create_app"]
