"""`GET /api/runs` and `GET /api/runs/{id}`: stored benchmark runs and their points."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Query
from sqlalchemy.ext.asyncio import AsyncSession

from phasewatch.api.budget import BudgetedRoute
from phasewatch.api.deps import db_session, row_dict, utc
from phasewatch.store.queries import get_run, list_runs

router = APIRouter(route_class=BudgetedRoute)


@router.get("/api/runs")
async def runs(
    session: Annotated[AsyncSession, Depends(db_session)],
    since: datetime | None = None,
    until: datetime | None = None,
    kind: str | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    cursor: datetime | None = None,
) -> dict[str, Any]:
    found, next_cursor = await list_runs(session, utc(since), utc(until), kind, limit,
                                         utc(cursor))
    return {"items": [row_dict(run) for run in found], "next_cursor": next_cursor}


@router.get("/api/runs/{run_id}")
async def run(run_id: str, session: Annotated[AsyncSession, Depends(db_session)]) -> dict[str, Any]:
    found = await get_run(session, run_id)
    if found is None:
        raise HTTPException(404, f"no run with id {run_id!r}")
    return {**row_dict(found), "points": [row_dict(point) for point in found.points]}
