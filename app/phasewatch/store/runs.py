"""Writing runs: a named benchmark or experiment, its sweep points, and its summary.

The bench (`phasewatch.bench.storage`) writes whole rows with `begin_run` and `complete_run`; the
smaller `create_run`, `add_point` and `finish_run` build a run piece by piece.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import delete, update
from sqlalchemy.ext.asyncio import AsyncSession

from phasewatch.store.models import Run, RunPoint


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


async def begin_run(session: AsyncSession, run: dict[str, Any]) -> None:
    """Store a run row as given (the bench's rows carry every column, `id` included)."""
    session.add(Run(**run))
    await session.commit()


async def complete_run(
    session: AsyncSession, run: dict[str, Any], points: list[dict[str, Any]]
) -> None:
    """Write a run's final columns and all its points in one transaction (points it already
    had are replaced, so a run stored twice holds its last points only)."""
    values = {key: value for key, value in run.items() if key != "id"}
    found = await session.get(Run, run["id"])
    if found is None:
        session.add(Run(**run))
    else:
        await session.execute(update(Run).where(Run.id == run["id"]).values(**values))
        await session.execute(delete(RunPoint).where(RunPoint.run_id == run["id"]))
    session.add_all(RunPoint(run_id=run["id"], **point) for point in points)
    await session.commit()
