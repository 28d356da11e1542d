"""Read queries behind the JSON API: requests and runs (windowed aggregates: window_stats.py).

Pages are keyset-paginated (newest first, `cursor` = the last id seen), so a page costs the
same at row 10 as at row 10 million.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

from sqlalchemy import Select, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import selectinload

from phasewatch.store.models import RequestRow, Run

SelectT = TypeVar("SelectT", bound=Select[*tuple[Any, ...]])
RowT = TypeVar("RowT")
KeyT = TypeVar("KeyT")
# Rows per round trip where a read streams: the event loop relays between two partitions.
PARTITION_ROWS = 100


@dataclass(frozen=True, slots=True)
class RequestFilter:
    since: datetime | None = None
    until: datetime | None = None
    model: str | None = None
    endpoint: str | None = None
    outcome: str | None = None
    run_id: str | None = None
    request_id: str | None = None


def _filtered(query: SelectT, f: RequestFilter) -> SelectT:
    if f.since is not None:
        query = query.where(RequestRow.started_at >= f.since)
    if f.until is not None:
        query = query.where(RequestRow.started_at < f.until)
    if f.model is not None:
        query = query.where(RequestRow.model == f.model)
    if f.endpoint is not None:
        query = query.where(RequestRow.endpoint == f.endpoint)
    if f.outcome is not None:
        query = query.where(RequestRow.outcome == f.outcome)
    if f.run_id is not None:
        query = query.where(RequestRow.run_id == f.run_id)
    if f.request_id is not None:
        query = query.where(RequestRow.request_id == f.request_id)
    return query


async def page(
    session: AsyncSession, query: Select[RowT], limit: int, key: Callable[[RowT], KeyT]
) -> tuple[Sequence[RowT], KeyT | None]:
    """One keyset page of an ordered query: up to `limit` rows, and the cursor of the next page
    (the last row's key) when there are more."""
    rows = (await session.scalars(query.limit(limit + 1))).all()
    more = len(rows) > limit
    rows = rows[:limit]
    return rows, (key(rows[-1]) if more and rows else None)


async def list_requests(
    session: AsyncSession, f: RequestFilter, limit: int, cursor: int | None
) -> tuple[list[dict[str, Any]], int | None]:
    """A page of stored requests, newest first, each a dict of its columns. Read as plain
    columns (an ORM object per row costs the loop several times more), `PARTITION_ROWS` at a
    time, so a page of 1,000 never holds the relay's loop for long."""
    query = _filtered(select(RequestRow.__table__), f).order_by(RequestRow.id.desc())
    if cursor is not None:
        query = query.where(RequestRow.id < cursor)
    result = await session.stream(
        query.limit(limit + 1).execution_options(yield_per=PARTITION_ROWS))
    rows: list[dict[str, Any]] = []
    async for part in result.mappings().partitions():
        rows.extend(dict(row) for row in part)
    more = len(rows) > limit
    del rows[limit:]
    return rows, (rows[-1]["id"] if more and rows else None)


async def list_runs(
    session: AsyncSession, since: datetime | None, until: datetime | None, kind: str | None,
    limit: int, cursor: datetime | None,
) -> tuple[Sequence[Run], datetime | None]:
    query = select(Run).order_by(Run.started_at.desc())
    if since is not None:
        query = query.where(Run.started_at >= since)
    if until is not None:
        query = query.where(Run.started_at < until)
    if kind is not None:
        query = query.where(Run.kind == kind)
    if cursor is not None:
        query = query.where(Run.started_at < cursor)
    return await page(session, query, limit, lambda run: run.started_at)


async def get_run(session: AsyncSession, run_id: str) -> Run | None:
    query = select(Run).where(Run.id == run_id).options(selectinload(Run.points))
    return (await session.scalars(query)).first()


async def run_ids_starting_with(session: AsyncSession, prefix: str, limit: int = 2) -> list[str]:
    """Ids of runs that start with `prefix` (so a run can be named by a unique prefix)."""
    escaped = prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    query = (select(Run.id).where(Run.id.like(escaped + "%", escape="\\"))
             .order_by(Run.started_at.desc()).limit(limit))
    return list((await session.scalars(query)).all())
