"""Read queries behind the JSON API: requests, runs, and windowed aggregates.

Pages are keyset-paginated (newest first, `cursor` = the last id seen), so a page costs the
same at row 10 as at row 10 million. Aggregates read only the rows of their window, through the
`started_at` index, and compute percentiles in Python with the project's one definition.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal, TypeVar

from sqlalchemy import Select, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import selectinload

from app.core.quantiles import percentiles
from app.store.models import RequestRow, Run

SelectT = TypeVar("SelectT", bound=Select[*tuple[Any, ...]])
GroupBy = Literal["model", "endpoint", "none"]
QS = (0.50, 0.90, 0.95, 0.99)


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


async def list_requests(
    session: AsyncSession, f: RequestFilter, limit: int, cursor: int | None
) -> tuple[Sequence[RequestRow], int | None]:
    query = _filtered(select(RequestRow), f).order_by(RequestRow.id.desc()).limit(limit + 1)
    if cursor is not None:
        query = query.where(RequestRow.id < cursor)
    rows = (await session.scalars(query)).all()
    more = len(rows) > limit
    rows = rows[:limit]
    return rows, (rows[-1].id if more and rows else None)


async def list_runs(
    session: AsyncSession, since: datetime | None, until: datetime | None, kind: str | None,
    limit: int, cursor: datetime | None,
) -> tuple[Sequence[Run], datetime | None]:
    query = select(Run).order_by(Run.started_at.desc()).limit(limit + 1)
    if since is not None:
        query = query.where(Run.started_at >= since)
    if until is not None:
        query = query.where(Run.started_at < until)
    if kind is not None:
        query = query.where(Run.kind == kind)
    if cursor is not None:
        query = query.where(Run.started_at < cursor)
    runs = (await session.scalars(query)).all()
    more = len(runs) > limit
    runs = runs[:limit]
    return runs, (runs[-1].started_at if more and runs else None)


async def get_run(session: AsyncSession, run_id: str) -> Run | None:
    query = select(Run).where(Run.id == run_id).options(selectinload(Run.points))
    return (await session.scalars(query)).first()


@dataclass(frozen=True, slots=True)
class GroupStats:
    """Aggregates of one group's requests over a window. Definitions in the README."""

    group: str | None
    requests: int
    errors: int
    request_rate_rps: float
    ttft_s: dict[str, float | None]  # p50, p90, p95, p99 over requests with a first token
    itl_mean_s: float | None  # token-weighted: total gap time / token gaps
    itl_p50_s: dict[str, float | None]  # percentiles across requests of each request's ITL p50
    itl_p95_s: dict[str, float | None]  # ... and of each request's ITL p95
    tpot_p50_s: float | None
    e2e_p50_s: float | None
    prompt_tokens_p50: float | None
    output_throughput_tps: float  # output tokens of ok requests / window
    prompt_throughput_tps: float
    in_flight_mean: float | None  # requests in flight when each request arrived
    in_flight_max: int | None


_COLUMNS = (
    RequestRow.model, RequestRow.endpoint, RequestRow.outcome, RequestRow.ttft_s,
    RequestRow.itl_count, RequestRow.itl_mean_s, RequestRow.itl_p50_s, RequestRow.itl_p95_s,
    RequestRow.tpot_s, RequestRow.e2e_s, RequestRow.prompt_tokens, RequestRow.output_tokens,
    RequestRow.in_flight_at_arrival,
)


async def window_stats(
    session: AsyncSession, until: datetime, window: timedelta, by: GroupBy,
    model: str | None = None, run_id: str | None = None,
) -> list[GroupStats]:
    f = RequestFilter(since=until - window, until=until, model=model, run_id=run_id)
    result = await session.execute(_filtered(select(*_COLUMNS), f))
    groups: dict[str | None, list[Any]] = defaultdict(list)
    for row in result.all():
        key = None if by == "none" else (row.model if by == "model" else row.endpoint)
        groups[key].append(row)
    seconds = window.total_seconds()
    return [aggregate(key, rows, seconds) for key, rows in sorted(
        groups.items(), key=lambda item: item[0] or "")]


def aggregate(group: str | None, rows: Sequence[Any], seconds: float) -> GroupStats:
    """Pure arithmetic over one group's rows (objects with the `_COLUMNS` attributes)."""
    ok = [r for r in rows if r.outcome == "ok"]
    ttfts = [r.ttft_s for r in rows if r.ttft_s is not None]
    with_itl = [r for r in rows if r.itl_count and r.itl_mean_s is not None]
    gaps = sum(r.itl_count for r in with_itl)
    in_flight = [r.in_flight_at_arrival for r in rows]
    names = ("p50", "p90", "p95", "p99")

    def named(values: list[float]) -> dict[str, float | None]:
        return dict(zip(names, percentiles(values, QS), strict=True))

    def p50(values: list[float]) -> float | None:
        return percentiles(values, (0.5,))[0]

    return GroupStats(
        group=group,
        requests=len(rows),
        errors=len(rows) - len(ok),
        request_rate_rps=len(rows) / seconds,
        ttft_s=named(ttfts),
        itl_mean_s=(sum(r.itl_mean_s * r.itl_count for r in with_itl) / gaps) if gaps else None,
        itl_p50_s=named([r.itl_p50_s for r in with_itl if r.itl_p50_s is not None]),
        itl_p95_s=named([r.itl_p95_s for r in with_itl if r.itl_p95_s is not None]),
        tpot_p50_s=p50([r.tpot_s for r in ok if r.tpot_s is not None]),
        e2e_p50_s=p50([r.e2e_s for r in ok if r.e2e_s is not None]),
        prompt_tokens_p50=p50([r.prompt_tokens for r in rows if r.prompt_tokens is not None]),
        output_throughput_tps=sum(r.output_tokens or 0 for r in ok) / seconds,
        prompt_throughput_tps=sum(r.prompt_tokens or 0 for r in ok) / seconds,
        in_flight_mean=(sum(in_flight) / len(in_flight)) if in_flight else None,
        in_flight_max=max(in_flight) if in_flight else None,
    )
