"""Writing runs: a named benchmark or experiment, its sweep points, and its summary."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import update
from sqlalchemy.ext.asyncio import AsyncSession

from app.store.models import Run, RunPoint


async def create_run(
    session: AsyncSession, *, name: str, kind: str, target: str, parameters: dict[str, Any],
    engine: dict[str, Any] | None = None, run_id: str | None = None,
) -> Run:
    run = Run(
        id=run_id or uuid.uuid4().hex, name=name, kind=kind, target=target, status="running",
        parameters=parameters, engine=engine or {}, started_at=datetime.now(UTC),
        finished_at=None, summary=None,
    )
    session.add(run)
    await session.commit()
    return run


async def add_point(session: AsyncSession, run_id: str, **figures: Any) -> RunPoint:
    point = RunPoint(run_id=run_id, **figures)
    session.add(point)
    await session.commit()
    return point


async def finish_run(session: AsyncSession, run_id: str, *, status: str,
                     summary: dict[str, Any]) -> None:
    await session.execute(
        update(Run).where(Run.id == run_id).values(
            status=status, summary=summary, finished_at=datetime.now(UTC))
    )
    await session.commit()
