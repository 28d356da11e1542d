"""Each process's latest snapshot of its requests in flight, stored so every process diagnoses from
the same live state (as the leader's engine scrapes are, app/phasewatch/store/engine_scrapes.py).

One row per process (`live_snapshots`), replaced at each publication; the write also deletes
every process's row older than `stale_before` (a process that died or stopped publishing), so
the table holds about one row per live process. Readers take the rows taken within a freshness
bound before the moment they judge; nothing here reads a clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, cast

from sqlalchemy import Table, delete, insert, select
from sqlalchemy.ext.asyncio import AsyncSession

from phasewatch.core.live import InFlight
from phasewatch.store.models import LiveSnapshot


@dataclass(frozen=True, slots=True)
class StoredSnapshot:
    process: str
    taken_at: datetime
    requests: list[InFlight]


async def put_snapshot(session: AsyncSession, process: str, taken_at: datetime,
                       requests: Sequence[InFlight], stale_before: datetime) -> None:
    """Replace `process`'s snapshot and delete every row taken before `stale_before`."""
    # Core statements, the requests as they are: the engine's JSON serializer (orjson,
    # app/phasewatch/core/db.py) writes each dataclass as the object `InFlight.as_dict` would give.
    table = cast(Table, LiveSnapshot.__table__)
    await session.execute(delete(table).where(
        (table.c.process == process) | (table.c.taken_at < stale_before)))
    await session.execute(insert(table).values(process=process, taken_at=taken_at,
                                               items=list(requests)))
    await session.commit()


async def drop_snapshot(session: AsyncSession, process: str) -> None:
    """Remove `process`'s snapshot (it stops serving: its requests are no longer in flight)."""
    await session.execute(delete(LiveSnapshot).where(LiveSnapshot.process == process))
    await session.commit()


def _requests(items: Any) -> list[InFlight]:
    """A stored list as InFlight values; an item that does not fit (a row written by another
    version) is skipped rather than failing the diagnosis."""
    out = []
    for item in items if isinstance(items, list) else []:
        try:
            out.append(InFlight.from_dict(item))
        except (KeyError, TypeError):
            continue
    return out


async def read_fresh(session: AsyncSession, since: datetime,
                     until: datetime) -> list[StoredSnapshot]:
    """Every process's snapshot taken in [since, until], oldest first."""
    rows = await session.execute(
        select(LiveSnapshot.process, LiveSnapshot.taken_at, LiveSnapshot.items)
        .where(LiveSnapshot.taken_at >= since, LiveSnapshot.taken_at <= until)
        .order_by(LiveSnapshot.taken_at, LiveSnapshot.process))
    return [StoredSnapshot(process, taken_at, _requests(items))
            for process, taken_at, items in rows]
