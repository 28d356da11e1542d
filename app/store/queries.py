"""Read queries behind the JSON API: requests, runs, and windowed aggregates.

Pages are keyset-paginated (newest first, `cursor` = the last id seen), so a page costs the
same at row 10 as at row 10 million. Aggregates read only the rows of their window, through the
`started_at` index, and compute percentiles in Python with the project's one definition.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal, TypeVar

from sqlalchemy import Select, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import selectinload

from app.core.quantiles import percentiles
from app.store.models import RequestRow, Run

SelectT = TypeVar("SelectT", bound=Select[*tuple[Any, ...]])
RowT = TypeVar("RowT")
KeyT = TypeVar("KeyT")
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
) -> tuple[Sequence[RequestRow], int | None]:
    query = _filtered(select(RequestRow), f).order_by(RequestRow.id.desc())
    if cursor is not None:
        query = query.where(RequestRow.id < cursor)
    return await page(session, query, limit, lambda row: row.id)


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
    key = {"model": 0, "endpoint": 1}.get(by)
    groups: dict[str | None, list[tuple[Any, ...]]] = defaultdict(list)
    for row in result:
        values = tuple(row)  # a plain tuple: index access is far cheaper than a Row's
        name = values[key] if key is not None else None
        groups[name if isinstance(name, str) else None].append(values)
    seconds = window.total_seconds()
    return [aggregate(name, rows, seconds)
            for name, rows in sorted(groups.items(), key=lambda item: item[0] or "")]


def aggregate(group: str | None, rows: Sequence[tuple[Any, ...]], seconds: float) -> GroupStats:
    """Pure arithmetic over one group's rows: tuples of the `_COLUMNS` values, in that order."""
    ttfts: list[float] = []
    itl_p50s: list[float] = []
    itl_p95s: list[float] = []
    tpots: list[float] = []
    e2es: list[float] = []
    prompts: list[float] = []
    in_flight: list[int] = []
    ok = gaps = output_ok = prompt_ok = 0
    gap_time = 0.0
    for (_model, _endpoint, outcome, ttft, itl_count, itl_mean, itl_p50, itl_p95, tpot, e2e,
         prompt_tokens, output_tokens, flight) in rows:
        in_flight.append(flight)
        if ttft is not None:
            ttfts.append(ttft)
        if prompt_tokens is not None:
            prompts.append(prompt_tokens)
        if itl_count and itl_mean is not None:
            gaps += itl_count
            gap_time += itl_mean * itl_count
            if itl_p50 is not None:
                itl_p50s.append(itl_p50)
            if itl_p95 is not None:
                itl_p95s.append(itl_p95)
        if outcome == "ok":
            ok += 1
            output_ok += output_tokens or 0
            prompt_ok += prompt_tokens or 0
            if tpot is not None:
                tpots.append(tpot)
            if e2e is not None:
                e2es.append(e2e)
    names = ("p50", "p90", "p95", "p99")

    def named(values: list[float]) -> dict[str, float | None]:
        return dict(zip(names, percentiles(values, QS), strict=True))

    def p50(values: list[float]) -> float | None:
        return percentiles(values, (0.5,))[0]

    return GroupStats(
        group=group,
        requests=len(rows),
        errors=len(rows) - ok,
        request_rate_rps=len(rows) / seconds,
        ttft_s=named(ttfts),
        itl_mean_s=gap_time / gaps if gaps else None,
        itl_p50_s=named(itl_p50s),
        itl_p95_s=named(itl_p95s),
        tpot_p50_s=p50(tpots),
        e2e_p50_s=p50(e2es),
        prompt_tokens_p50=p50(prompts),
        output_throughput_tps=output_ok / seconds,
        prompt_throughput_tps=prompt_ok / seconds,
        in_flight_mean=(sum(in_flight) / len(in_flight)) if in_flight else None,
        in_flight_max=max(in_flight) if in_flight else None,
    )
