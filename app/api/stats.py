"""`GET /api/stats`: windowed aggregates of the stored requests, per model or endpoint.

Windows wider than `PHASEWATCH_API_MAX_WINDOW_S` are refused (422); how a wide window stays
cheap for the relay that shares this loop: app/store/window_stats.py.
"""

from __future__ import annotations

from dataclasses import asdict
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException
from sqlalchemy.ext.asyncio import AsyncSession

from phasewatch.api.budget import BudgetedRoute
from phasewatch.api.deps import db_session, parse_duration, settings, utc
from phasewatch.core.settings import Settings
from phasewatch.store.window_stats import GroupBy, window_stats

router = APIRouter(route_class=BudgetedRoute)


@router.get("/api/stats")
async def stats(
    session: Annotated[AsyncSession, Depends(db_session)],
    config: Annotated[Settings, Depends(settings)],
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
    widest = config.api_max_window_s
    if span.total_seconds() > widest:
        raise HTTPException(422, f"invalid parameters: window: at most {widest:g} s "
                            f"(PHASEWATCH_API_MAX_WINDOW_S) (got {window!r})")
    end = utc(until) or datetime.now(UTC)
    found = await window_stats(session, end, span, by, config.api_max_rows, model=model,
                               run_id=run_id)
    return {
        "window_s": span.total_seconds(),
        "since": end - span,
        "until": end,
        "by": by,
        # Percentiles come from `rows` of the window's `of` requests: all of them, or a
        # uniform sample when there are more than PHASEWATCH_API_MAX_ROWS; totals are exact.
        "sample": {"rows": found.sampled, "of": found.requests},
        "groups_left_off": found.groups_left_off,
        "groups": [asdict(group) for group in found.groups],
    }
