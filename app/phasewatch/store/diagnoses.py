"""Reads for the diagnosis (requests of a span, runs, active models), its verdict history and
the schedule's latest round per model.

A span may hold far more requests than a diagnosis needs (an hour at 50 requests/s is 180,000
rows), so `read_observations` counts the span first and, past `limit`, reads an even thinning
of it (every k-th id), which keeps the distributions and the evaluation cheap; rates are taken
from the count, not from the rows read.

The rows are read as plain tuples on the connection (not through the ORM's result machinery),
with each arrival as POSIX seconds computed by the database (`EpochSeconds`) rather than a
datetime parsed from SQLite's text in Python: a round reads up to two spans of `limit` rows,
and per row those two cost more than everything else the read does (a read of 2,400 rows in
the served process: the event loop's share 20-31 ms before, 10-13 ms after; CHANGELOG).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, Float, delete, func, insert, literal, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.functions import FunctionElement

from phasewatch.store.models import Diagnosis, DiagnosisLatest, RequestRow
from phasewatch.store.queries import PARTITION_ROWS, page


class EpochSeconds(FunctionElement[float]):
    """A stored UTC datetime as POSIX seconds: the float `datetime.timestamp()` gives for it,
    to the bit (whole microseconds over 10^6, one rounding), on both backends."""

    type = Float()
    inherit_cache = True


@compiles(EpochSeconds, "postgresql")
def _epoch_postgresql(element: EpochSeconds, compiler: SQLCompiler, **kw: Any) -> str:
    # EXTRACT gives an exact numeric (PostgreSQL 14+), rounded once to a double.
    return f"CAST(EXTRACT(EPOCH FROM {compiler.process(element.clauses, **kw)}) AS FLOAT8)"


@compiles(EpochSeconds, "sqlite")
def _epoch_sqlite(element: EpochSeconds, compiler: SQLCompiler, **kw: Any) -> str:
    # The text SQLAlchemy and the writer store: 'YYYY-MM-DD HH:MM:SS.ffffff' (UTC). The whole
    # seconds and the microseconds apart: strftime would round the fraction to milliseconds.
    column = compiler.process(element.clauses, **kw)
    return (f"((CAST(strftime('%s', substr({column}, 1, 19)) AS INTEGER) * 1000000 "
            f"+ CAST(substr({column}, 21) AS INTEGER)) / 1000000.0)")


# What one observation needs, in this order (see app/phasewatch/diagnosis/observations.py).
OBSERVATION_COLUMNS = (
    EpochSeconds(RequestRow.started_at), RequestRow.outcome, RequestRow.ttft_s, RequestRow.e2e_s,
    RequestRow.itl_count, RequestRow.itl_p50_s, RequestRow.itl_max_s, RequestRow.prompt_tokens,
    RequestRow.in_flight_at_arrival,
)


@dataclass(frozen=True, slots=True)
class RequestSpan:
    rows: list[tuple[Any, ...]]  # OBSERVATION_COLUMNS values (arrival: POSIX s), oldest first
    total: int  # requests in the span (rows may be a thinning of them)
    first: datetime | None  # earliest and latest arrival among all of them
    last: datetime | None


def _where(model: str, since: datetime | None, until: datetime | None,
           run_id: str | None) -> list[ColumnElement[bool]]:
    where: list[ColumnElement[bool]] = [RequestRow.model == model]
    if since is not None:
        where.append(RequestRow.started_at >= since)
    if until is not None:
        where.append(RequestRow.started_at < until)
    if run_id is not None:
        where.append(RequestRow.run_id == run_id)
    return where


async def read_observations(
    session: AsyncSession, *, model: str, since: datetime | None = None,
    until: datetime | None = None, run_id: str | None = None, limit: int = 3000,
) -> RequestSpan:
    """A model's requests that arrived in [since, until) (and carry `run_id`, if given)."""
    where = _where(model, since, until, run_id)
    # Three subqueries, not one aggregate: a lone min or max is one step down the
    # (model, started_at) index in SQLite and Postgres alike, so only the count walks the span
    # (at 195,000 rows on SQLite: 10 ms, against 34 ms for the three in one pass).
    total, first, last = (await session.execute(select(
        select(func.count()).select_from(RequestRow).where(*where).scalar_subquery(),
        select(func.min(RequestRow.started_at)).where(*where).scalar_subquery(),
        select(func.max(RequestRow.started_at)).where(*where).scalar_subquery(),
    ))).one()
    query = select(*OBSERVATION_COLUMNS).where(*where).order_by(RequestRow.started_at)
    if total > limit:
        query = query.where(RequestRow.id % math.ceil(total / limit) == 0)
    # In partitions: the loop relays between two of them (3,000 rows at once held it ~20 ms).
    rows: list[tuple[Any, ...]] = []
    connection = await session.connection()
    result = await connection.stream(query.execution_options(yield_per=PARTITION_ROWS))
    async for part in result.partitions():
        rows.extend(tuple(row) for row in part)
    return RequestSpan(rows, int(total), first, last)


async def run_request_count(session: AsyncSession, run_id: str) -> int:
    """Requests stored with this run id, for any model."""
    count = await session.scalar(
        select(func.count()).select_from(RequestRow).where(RequestRow.run_id == run_id))
    return int(count or 0)


async def active_models(
    session: AsyncSession, since: datetime, until: datetime, limit: int,
) -> list[str]:
    """Models the upstream served in [since, until), busiest first: each has at least one
    request it answered with a 2xx, so a name it rejected (404 for an unknown model) is never
    one."""
    count = func.count().label("n")
    where = [RequestRow.started_at >= since, RequestRow.started_at < until,
             RequestRow.model.is_not(None),
             RequestRow.http_status >= 200, RequestRow.http_status < 300]
    result = await session.execute(
        select(RequestRow.model, count).where(*where)
        .group_by(RequestRow.model).order_by(count.desc(), RequestRow.model).limit(limit)
    )
    return [model for model, _ in result if model]


async def still_served(
    session: AsyncSession, models: Sequence[str], since: datetime, until: datetime,
) -> list[str]:
    """Those of `models` the upstream served in [since, until) (a 2xx, as `active_models`
    counts), in their order: one look each down the model's index to its first such request,
    not a scan of the span."""
    served = []
    for model in models:
        found = await session.scalar(
            select(literal(1)).where(
                RequestRow.model == model, RequestRow.started_at >= since,
                RequestRow.started_at < until,
                RequestRow.http_status >= 200, RequestRow.http_status < 300).limit(1))
        if found is not None:
            served.append(model)
    return served


async def add_diagnosis(
    session: AsyncSession, *, at: datetime, model: str, window_s: float, baseline: str,
    verdict: str, confidence: float, evidence: dict[str, Any],
) -> int:
    row = Diagnosis(at=at, model=model[:255], window_s=window_s, baseline=baseline[:200],
                    verdict=verdict, confidence=confidence, evidence=evidence)
    session.add(row)
    await session.commit()
    return row.id


async def latest_verdicts(session: AsyncSession) -> dict[str, str]:
    """The last stored verdict of every model."""
    newest = select(func.max(Diagnosis.id)).group_by(Diagnosis.model).scalar_subquery()
    result = await session.execute(
        select(Diagnosis.model, Diagnosis.verdict).where(Diagnosis.id.in_(newest)))
    return {model: verdict for model, verdict in result}


async def list_diagnoses(
    session: AsyncSession, model: str | None, limit: int, cursor: int | None
) -> tuple[Sequence[Diagnosis], int | None]:
    """Stored verdict changes, newest first; keyset-paginated by id."""
    query = select(Diagnosis).order_by(Diagnosis.id.desc())
    if model is not None:
        query = query.where(Diagnosis.model == model)
    if cursor is not None:
        query = query.where(Diagnosis.id < cursor)
    return await page(session, query, limit, lambda row: row.id)


@dataclass(frozen=True, slots=True)
class LatestRound:
    """The schedule's latest round for one model (`DiagnosisLatest`)."""

    model: str
    at: datetime
    report: dict[str, Any]
    held: dict[str, Any]


async def put_latest(session: AsyncSession, *, model: str, at: datetime, verdict: str,
                     confidence: float, report: dict[str, Any], held: dict[str, Any]) -> None:
    """Replace `model`'s latest round."""
    await session.execute(delete(DiagnosisLatest).where(DiagnosisLatest.model == model[:255]))
    await session.execute(insert(DiagnosisLatest).values(
        model=model[:255], at=at, verdict=verdict, confidence=confidence, report=report,
        held=held))
    await session.commit()


async def drop_latest(session: AsyncSession, models: Sequence[str]) -> None:
    """Forget the latest rounds of models the schedule no longer judges."""
    if models:
        await session.execute(delete(DiagnosisLatest).where(DiagnosisLatest.model.in_(models)))
        await session.commit()


async def read_latest(session: AsyncSession,
                      models: Sequence[str] | None = None) -> dict[str, LatestRound]:
    """The latest round of each of `models` that has one (of every model: None)."""
    query = select(DiagnosisLatest.model, DiagnosisLatest.at, DiagnosisLatest.report,
                   DiagnosisLatest.held)
    if models is not None:
        query = query.where(DiagnosisLatest.model.in_(list(models)))
    result = await session.execute(query)
    return {model: LatestRound(model, at, report, held)
            for model, at, report, held in result}
