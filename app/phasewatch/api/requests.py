"""`GET /api/requests`: stored request records, newest first, filtered and paginated. The
answer's shape: app/phasewatch/api/record_schema.py."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Response
from sqlalchemy.ext.asyncio import AsyncSession

from phasewatch.api.budget import BudgetedRoute
from phasewatch.api.deps import ADMIN_AUTH, SINCE, UNTIL, db_session, utc
from phasewatch.api.encoding import json_response
from phasewatch.api.errors import ERROR_RESPONSES
from phasewatch.api.record_schema import RequestPage
from phasewatch.core.records import Outcome
from phasewatch.store.queries import RequestFilter, list_requests

router = APIRouter(route_class=BudgetedRoute, dependencies=ADMIN_AUTH,
                   responses=ERROR_RESPONSES)


@router.get("/api/requests", response_model=RequestPage, operation_id="listRequests")
async def requests(
    session: Annotated[AsyncSession, Depends(db_session)],
    since: Annotated[datetime | None, SINCE] = None,
    until: Annotated[datetime | None, UNTIL] = None,
    model: Annotated[str | None, Query(description="Only this model.")] = None,
    endpoint: Annotated[str | None, Query(
        description="Only this endpoint: `completions` or `chat.completions`.")] = None,
    outcome: Annotated[Outcome | None, Query(description="Only this outcome.")] = None,
    run_id: Annotated[str | None, Query(description="Only requests of this run.")] = None,
    request_id: Annotated[str | None, Query(description="Only this request id.")] = None,
    limit: Annotated[int, Query(ge=1, le=1000, description="Records per page.")] = 100,
    cursor: Annotated[int | None, Query(
        ge=1, description="The previous page's `next_cursor`.")] = None,
) -> Response:
    """Stored request records, newest first, with every figure the proxy measured."""
    f = RequestFilter(since=utc(since), until=utc(until), model=model, endpoint=endpoint,
                      outcome=outcome.value if outcome else None, run_id=run_id,
                      request_id=request_id)
    rows, next_cursor = await list_requests(session, f, limit, cursor)
    # Encoded in one C call: FastAPI's validation and encoding of a page of 1,000 records holds
    # the relay's loop about 10 ms (app/phasewatch/api/encoding.py).
    return json_response({"items": rows, "next_cursor": next_cursor})
