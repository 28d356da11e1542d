"""Request-scoped dependencies, parameter parsing and parameter documentation shared by the API
routers."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

from fastapi import Query, Request, Security
from fastapi.params import Depends
from fastapi.security import APIKeyHeader, HTTPBearer
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.inspection import inspect

from phasewatch.core.settings import Settings

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(s|m|h|d)$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}

# How to send the admin token, for the OpenAPI document (its security schemes, so a generated client
# sends it). The check itself is made before FastAPI (app/phasewatch/core/admin.py): these read a
# header and never refuse (`auto_error=False`).
ADMIN_AUTH: list[Depends] = [
    Security(APIKeyHeader(name="x-phasewatch-admin-token", scheme_name="adminToken",
                          auto_error=False,
                          description="`PHASEWATCH_ADMIN_TOKEN` (README, \"The admin API is "
                          "closed by default\").")),
    Security(HTTPBearer(scheme_name="adminBearer", auto_error=False,
                        description="The same token as `Authorization: Bearer <token>`.")),
]
SINCE = Query(description="Only those that started at or after this moment (ISO 8601; no "
              "zone means UTC).")
UNTIL = Query(description="Only those that started before this moment (ISO 8601; no zone "
              "means UTC).")


async def db_session(request: Request) -> AsyncIterator[AsyncSession]:
    async with request.app.state.sessionmaker() as session:
        yield session


def settings(request: Request) -> Settings:
    """The app's settings (the API's bounds among them)."""
    config: Settings = request.app.state.settings
    return config


def parse_duration(text: str) -> timedelta:
    """`30s`, `5m`, `1.5h`, `7d` -> timedelta; ValueError with the accepted forms otherwise."""
    match = _DURATION.match(text.strip())
    if not match or float(match.group(1)) <= 0:
        raise ValueError("a positive duration like 30s, 5m, 1h or 7d")
    return timedelta(seconds=float(match.group(1)) * _UNIT_S[match.group(2)])


def utc(moment: datetime | None) -> datetime | None:
    """Query times without a zone are taken as UTC."""
    if moment is None:
        return None
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


def row_dict(row: Any) -> dict[str, Any]:
    """A mapped row's columns as a dict (relationships left out)."""
    return {attr.key: getattr(row, attr.key) for attr in inspect(row).mapper.column_attrs}
