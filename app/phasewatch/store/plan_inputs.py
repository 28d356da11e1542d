"""What `phasewatch plan` calibrates on: a model's finished, streamed requests of a span or a
run, with the figures the calibration reads (arrival as POSIX seconds, oldest first)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from phasewatch.store.diagnoses import EpochSeconds
from phasewatch.store.models import RequestRow

PLAN_COLUMNS = (EpochSeconds(RequestRow.started_at), RequestRow.ttft_s, RequestRow.e2e_s,
                RequestRow.prompt_tokens, RequestRow.output_tokens, RequestRow.itl_p50_s)


async def timed_requests(
    session: AsyncSession, *, model: str | None, since: datetime | None = None,
    until: datetime | None = None, run_id: str | None = None, limit: int = 20_000,
) -> list[tuple[Any, ...]]:
    """The latest `limit` rows (PLAN_COLUMNS) of ok, streamed requests with a first token,
    two or more output tokens and a prompt count, oldest first."""
    query = select(*PLAN_COLUMNS).where(
        RequestRow.outcome == "ok", RequestRow.stream.is_(True), RequestRow.ttft_s.is_not(None),
        RequestRow.e2e_s.is_not(None), RequestRow.itl_p50_s.is_not(None),
        RequestRow.prompt_tokens.is_not(None), RequestRow.output_tokens >= 2)
    if model is not None:
        query = query.where(RequestRow.model == model)
    if since is not None:
        query = query.where(RequestRow.started_at >= since)
    if until is not None:
        query = query.where(RequestRow.started_at < until)
    if run_id is not None:
        query = query.where(RequestRow.run_id == run_id)
    rows = (await session.execute(query.order_by(RequestRow.started_at.desc()).limit(limit))).all()
    return [tuple(row) for row in reversed(rows)]


async def request_count(session: AsyncSession, *, model: str, since: datetime,
                        until: datetime) -> int:
    """Requests of `model` that arrived in [since, until), whatever their outcome: the load
    offered."""
    from sqlalchemy import func

    count = await session.scalar(select(func.count()).select_from(RequestRow).where(
        RequestRow.model == model, RequestRow.started_at >= since, RequestRow.started_at < until))
    return int(count or 0)
