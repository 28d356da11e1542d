"""Errors of the `/api` routes in the OpenAI error format, like the relayed ones, and their
declared shape for the OpenAPI document (`ERROR_RESPONSES`).

A database that is down or failing answers 503 (`database_unavailable`) with one log line and
no traceback; a text parameter the database could not take (a NUL character) is refused as
422 before any query runs.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from sqlalchemy.exc import DBAPIError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException


class ErrorDetail(BaseModel):
    message: str = Field(description="What went wrong, in a sentence a person can act on.")
    type: str = Field(description="The kind of error: `invalid_request_error`, "
                      "`not_found_error`, `permission_denied`, `database_unavailable`, "
                      "`query_timeout`.")
    param: str | None = Field(description="The parameter at fault (several: comma-separated); "
                              "null when no one parameter is.")
    code: int = Field(description="The HTTP status, repeated.")


class ErrorResponse(BaseModel):
    """An error in the OpenAI format, as the relayed ones."""

    error: ErrorDetail = Field(description="What went wrong.")


def _error(description: str) -> dict[str, Any]:
    return {"model": ErrorResponse, "description": description}


# The answers an `/api` route can give besides its 200, for the OpenAPI document (a router's
# `responses=`). 401 and 403 come from the admin gate in front of FastAPI
# (app/phasewatch/core/admin.py).
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: _error("The admin token is missing or wrong (`x-phasewatch-admin-token`, or "
                "`Authorization: Bearer`)."),
    403: _error("The admin API is closed: no `PHASEWATCH_ADMIN_TOKEN` is set and "
                "`PHASEWATCH_ADMIN_OPEN` is off."),
    422: _error("A parameter is invalid; `param` names it."),
    503: _error("The database is unavailable (`database_unavailable`), or the call took "
                "longer than `PHASEWATCH_API_TIMEOUT_S` (`query_timeout`)."),
}
NOT_FOUND: dict[int | str, dict[str, Any]] = {404: _error("No such item.")}


def error_response(status: int, message: str, error_type: str,
                   param: str | None = None) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": error_type, "param": param, "code": status}},
        status_code=status,
    )


async def validation_error(_request: Request, exc: Exception) -> JSONResponse:
    """422 naming each bad parameter and why, in one sentence a person can act on."""
    assert isinstance(exc, RequestValidationError)
    problems, params = [], []
    for error in exc.errors():
        location = [str(part) for part in error.get("loc", ()) if part not in ("query", "path")]
        name = ".".join(location) or "request"
        params.append(name)
        problems.append(f"{name}: {error.get('msg', 'invalid')} (got {error.get('input')!r})")
    return error_response(422, "invalid parameters: " + "; ".join(problems),
                          "invalid_request_error", ",".join(params) or None)


async def http_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    error_type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return error_response(exc.status_code, str(exc.detail), error_type)


log = logging.getLogger(__name__)

# What a failing database raises through SQLAlchemy (DBAPIError, its pool's TimeoutError) or
# before it (a refused connection).
DATABASE_ERRORS: tuple[type[Exception], ...] = (DBAPIError, PoolTimeout, OSError)


async def database_error(request: Request, exc: Exception) -> JSONResponse:
    first_line = (str(exc).splitlines() or [""])[0][:200]
    log.warning("%s %s: database unavailable (%s: %s)", request.method, request.url.path,
                type(exc).__name__, first_line)
    return error_response(503, "the database is unavailable; retry shortly",
                          "database_unavailable")


def reject_nul(request: Request) -> None:
    """A router dependency: no query parameter may hold a NUL character (PostgreSQL cannot
    store or compare one)."""
    for name, value in request.query_params.multi_items():
        if "\x00" in value or "\x00" in name:
            raise HTTPException(422, f"parameter {name!r} holds a NUL character")
