"""`GET /api/requests`: stored request records, newest first, filtered and paginated."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query
from sqlalchemy.ext.asyncio import AsyncSession

from app.api.deps import db_session, row_dict, utc
from app.core.records import Outcome
from app.store.queries import RequestFilter, list_requests

router = APIRouter()


@router.get("/api/requests")
async def requests(
    session: Annotated[AsyncSession, Depends(db_session)],
    since: datetime | None = None,
    until: datetime | None = None,
    model: str | None = None,
    endpoint: str | None = None,
    outcome: Outcome | None = None,
    run_id: str | None = None,
    request_id: str | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    cursor: Annotated[int | None, Query(ge=1)] = None,
) -> dict[str, Any]:
    f = RequestFilter(since=utc(since), until=utc(until), model=model, endpoint=endpoint,
                      outcome=outcome.value if outcome else None, run_id=run_id,
                      request_id=request_id)
    rows, next_cursor = await list_requests(session, f, limit, cursor)
    return {"items": [row_dict(row) for row in rows], "next_cursor": next_cursor}
