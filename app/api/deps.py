"""Request-scoped dependencies and parameter parsing shared by the API routers."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

from fastapi import Request
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.inspection import inspect

from phasewatch.core.settings import Settings

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(s|m|h|d)$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


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
