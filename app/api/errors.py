"""Errors of the `/api` routes in the OpenAI error format, like the relayed ones."""

from __future__ import annotations

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException


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
