"""Request dependencies: the query runner and the optional bearer token."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, HTTPException, Request, status
from fastapi.dependencies.models import Dependant
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from kvfabric.queries import QueryRunner

_bearer = HTTPBearer(auto_error=False, description="set when the collector runs with a token")


def get_runner(request: Request) -> QueryRunner:
    return request.app.state.runner


Runner = Annotated[QueryRunner, Depends(get_runner)]
"""The query runner as a route parameter type (every router reads through it)."""


def _token_matches(expected: str, credentials: HTTPAuthorizationCredentials | None) -> bool:
    given = credentials.credentials if credentials is not None else ""
    # Constant-time comparison: the token must not leak through response timing.
    return hmac.compare_digest(given.encode(), expected.encode())


def is_authenticated(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> bool:
    """True only when the app has a token and the request carries it (never for an app without a token: then
    nobody is authenticated, and answers that may reveal local details, such as file paths, leave them out)."""
    expected: str | None = request.app.state.token
    return bool(expected) and _token_matches(expected, credentials)


Authenticated = Annotated[bool, Depends(is_authenticated)]


def require_token(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> None:
    """401 unless the app has no token or the request carries ``Authorization: Bearer <token>``."""
    expected: str | None = request.app.state.token
    if not expected:
        return
    if not _token_matches(expected, credentials):
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"}
        )


def _declared_query_names(dependant: Dependant) -> set[str]:
    names = {p.alias for p in dependant.query_params}
    for sub in dependant.dependencies:
        names |= _declared_query_names(sub)
    return names


def reject_unknown_query_params(request: Request) -> None:
    """422 for a query parameter the route does not declare (a misspelt filter such as ``?familly=x`` would
    otherwise be ignored and the answer look like a filtered one). Names the unknown parameters and the accepted
    ones. Installed app-wide, so every route, including ones added later, gets it."""
    route = request.scope.get("route")
    dependant = getattr(route, "dependant", None)
    if dependant is None:
        return
    accepted = _declared_query_names(dependant)
    unknown = sorted(set(request.query_params) - accepted)
    if unknown:
        listed = ", ".join(sorted(accepted)) if accepted else "none"
        raise HTTPException(
            422,
            f"unknown query parameter(s) {', '.join(unknown)}; {request.url.path} accepts: {listed}",
        )
