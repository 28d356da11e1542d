"""`GET /api/stats`: windowed aggregates of the stored requests, per model or endpoint.

Windows wider than `PHASEWATCH_API_MAX_WINDOW_S` are refused (422); how a wide window stays
cheap for the relay that shares this loop: app/phasewatch/store/window_stats.py. The answer's shape:
app/phasewatch/api/stats_schema.py.
"""

from __future__ import annotations

from dataclasses import asdict
from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Query, Response
from sqlalchemy.ext.asyncio import AsyncSession

from phasewatch.api.budget import BudgetedRoute
from phasewatch.api.deps import ADMIN_AUTH, db_session, parse_duration, settings, utc
from phasewatch.api.encoding import json_response
from phasewatch.api.errors import ERROR_RESPONSES
from phasewatch.api.stats_schema import Stats
from phasewatch.core.settings import Settings
from phasewatch.store.window_stats import GroupBy, window_stats

router = APIRouter(route_class=BudgetedRoute, dependencies=ADMIN_AUTH,
                   responses=ERROR_RESPONSES)


@router.get("/api/stats", response_model=Stats, operation_id="getStats")
async def stats(
    session: Annotated[AsyncSession, Depends(db_session)],
    config: Annotated[Settings, Depends(settings)],
    window: Annotated[str, Query(description="The window's length: `30s`, `5m`, `1.5h`, `7d`; "
                                 "at most `PHASEWATCH_API_MAX_WINDOW_S`.")] = "5m",
    by: Annotated[GroupBy, Query(description="Group per `model`, per `endpoint`, or not "
                                 "(`none`).")] = "model",
    until: Annotated[datetime | None, Query(description="The window's end (ISO 8601; no zone "
                                            "means UTC); default now.")] = None,
    model: Annotated[str | None, Query(description="Only this model.")] = None,
    run_id: Annotated[str | None, Query(description="Only requests of this run.")] = None,
) -> Response:
    """Aggregates of the requests that arrived in [`until` - `window`, `until`), per group."""
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
    return json_response({
        "window_s": span.total_seconds(),
        "since": end - span,
        "until": end,
        "by": by,
        # Percentiles come from `rows` of the window's `of` requests: all of them, or a
        # uniform sample when there are more than PHASEWATCH_API_MAX_ROWS; totals are exact.
        "sample": {"rows": found.sampled, "of": found.requests},
        "groups_left_off": found.groups_left_off,
        "groups": [asdict(group) for group in found.groups],
    })
