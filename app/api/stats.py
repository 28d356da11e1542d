"""`GET /api/stats`: windowed aggregates of the stored requests, per model or endpoint."""

from __future__ import annotations

from dataclasses import asdict
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException
from sqlalchemy.ext.asyncio import AsyncSession

from app.api.deps import db_session, parse_duration, utc
from app.store.queries import GroupBy, window_stats

router = APIRouter()


@router.get("/api/stats")
async def stats(
    session: Annotated[AsyncSession, Depends(db_session)],
    window: str = "5m",
    by: GroupBy = "model",
    until: datetime | None = None,
    model: str | None = None,
    run_id: str | None = None,
) -> dict[str, Any]:
    try:
        span = parse_duration(window)
    except ValueError as exc:
        raise HTTPException(422, f"invalid parameters: window: {exc} (got {window!r})") from None
    end = utc(until) or datetime.now(UTC)
    groups = await window_stats(session, end, span, by, model=model, run_id=run_id)
    return {
        "window_s": span.total_seconds(),
        "since": end - span,
        "until": end,
        "by": by,
        "groups": [asdict(group) for group in groups],
    }
