"""`GET /api/runs` and `GET /api/runs/{id}`: stored benchmark runs and their points. The
answers' shapes: app/phasewatch/api/run_schema.py."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Path, Query, Response
from sqlalchemy.ext.asyncio import AsyncSession

from phasewatch.api.budget import BudgetedRoute
from phasewatch.api.deps import ADMIN_AUTH, SINCE, UNTIL, db_session, row_dict, utc
from phasewatch.api.encoding import json_response
from phasewatch.api.errors import ERROR_RESPONSES, NOT_FOUND
from phasewatch.api.run_schema import RunPage, RunWithPoints
from phasewatch.store.queries import get_run, list_runs

router = APIRouter(route_class=BudgetedRoute, dependencies=ADMIN_AUTH,
                   responses=ERROR_RESPONSES)


@router.get("/api/runs", response_model=RunPage, operation_id="listRuns")
async def runs(
    session: Annotated[AsyncSession, Depends(db_session)],
    since: Annotated[datetime | None, SINCE] = None,
    until: Annotated[datetime | None, UNTIL] = None,
    kind: Annotated[str | None, Query(description="Only runs of this kind (bench mode).")] = None,
    limit: Annotated[int, Query(ge=1, le=1000, description="Runs per page.")] = 100,
    cursor: Annotated[datetime | None, Query(
        description="The previous page's `next_cursor`.")] = None,
) -> Response:
    """Stored benchmark runs, newest first (without their points)."""
    found, next_cursor = await list_runs(session, utc(since), utc(until), kind, limit,
                                         utc(cursor))
    return json_response({"items": [row_dict(run) for run in found], "next_cursor": next_cursor})


@router.get("/api/runs/{run_id}", response_model=RunWithPoints, responses=NOT_FOUND,
            operation_id="getRun")
async def run(
    run_id: Annotated[str, Path(description="The run's id.")],
    session: Annotated[AsyncSession, Depends(db_session)],
) -> Response:
    """One stored run with every point of its sweep."""
    found = await get_run(session, run_id)
    if found is None:
        raise HTTPException(404, f"no run with id {run_id!r}")
    return json_response({**row_dict(found), "points": [row_dict(point) for point in found.points]})
