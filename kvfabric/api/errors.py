"""Exception -> HTTP answer, in one place: every error body is :class:`~kvfabric.api.models.ErrorBody`."""

from __future__ import annotations

import duckdb
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvfabric.queries import BadParameter, DatabaseUnavailable, NotFound, QueryTimeout, UnknownRun


def _body(status: int, detail: str, errors: list[dict[str, object]] | None = None) -> JSONResponse:
    content: dict[str, object] = {"detail": detail}
    if errors is not None:
        content["errors"] = errors
    return JSONResponse(status_code=status, content=content)


def _validation(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = []
    parts = []
    for e in exc.errors():
        loc = [str(p) for p in e.get("loc", ())]
        where = f"{loc[0]} parameter {'.'.join(loc[1:])!r}" if len(loc) > 1 else ".".join(loc)
        parts.append(f"{where}: {e.get('msg')}")
        errors.append({"loc": loc, "msg": e.get("msg"), "type": e.get("type")})
    return _body(422, "; ".join(parts) or "invalid request", errors)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _validation)
    app.add_exception_handler(UnknownRun, lambda _r, e: _body(404, str(e)))
    app.add_exception_handler(NotFound, lambda _r, e: _body(404, str(e)))
    app.add_exception_handler(BadParameter, lambda _r, e: _body(422, str(e)))
    app.add_exception_handler(QueryTimeout, lambda _r, e: _body(503, str(e)))
    app.add_exception_handler(DatabaseUnavailable, lambda _r, e: _body(503, str(e)))
    # A storage fault (disk full, invalidated database, a reopen in progress) is the server's state, not the
    # request's: 503, and the text without DuckDB's details (they name files; the collector's log has them).
    app.add_exception_handler(
        duckdb.Error,
        lambda _r, e: _body(503, f"the database cannot answer now ({type(e).__name__}); see /healthz and the "
                                 "collector's log"),
    )

    def _http(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        resp = _body(exc.status_code, str(exc.detail))
        for k, v in (exc.headers or {}).items():
            resp.headers[k] = v
        return resp

    app.add_exception_handler(StarletteHTTPException, _http)
