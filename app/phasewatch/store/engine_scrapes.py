"""The engine scrapes the leading process stores, read back by every process's diagnosis.

Only the leader (app/phasewatch/store/leader.py) scrapes the engine, so every worker and replica
reads the same rows and answers `/api/diagnosis` the same. A row is one scrape: when its response
arrived (wall clock), the URL, and what diagnosis reads of it as JSON
(app/phasewatch/engine/codec.py), or NULL when the scrape failed. Each insert deletes the rows older
than the scraper keeps (a window and its baseline), so the table holds a few hundred rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.ext.asyncio import AsyncSession

from phasewatch.store.models import EngineScrape


@dataclass(frozen=True, slots=True)
class ScrapeSpan:
    before: tuple[datetime, dict[str, Any]] | None  # the last good scrape before the span
    inside: list[tuple[datetime, dict[str, Any]]]  # the good scrapes in it, oldest first
    last_ok: bool | None  # whether the last scrape at or before its end worked (None: none)


async def add_scrape(session: AsyncSession, at: datetime, url: str,
                     snapshot: dict[str, Any] | None, keep_since: datetime) -> None:
    """Store one scrape (`snapshot` None: it failed) and drop this URL's before `keep_since`."""
    session.add(EngineScrape(at=at, url=url, snapshot=snapshot))
    await session.execute(
        delete(EngineScrape).where(EngineScrape.url == url, EngineScrape.at < keep_since))
    await session.commit()


async def read_scrapes(session: AsyncSession, url: str, since: datetime,
                       until: datetime) -> ScrapeSpan:
    """The scrapes of `url` in [since, until], and the last good one before `since` (counters
    and histograms are differenced from it)."""
    good = EngineScrape.snapshot.is_not(None)
    before = (await session.execute(
        select(EngineScrape.at, EngineScrape.snapshot)
        .where(EngineScrape.url == url, EngineScrape.at < since, good)
        .order_by(EngineScrape.at.desc(), EngineScrape.id.desc()).limit(1)
    )).first()
    inside = [(at, snapshot) for at, snapshot in await session.execute(
        select(EngineScrape.at, EngineScrape.snapshot)
        .where(EngineScrape.url == url, EngineScrape.at >= since, EngineScrape.at <= until, good)
        .order_by(EngineScrape.at, EngineScrape.id)
    )]
    last = (await session.execute(
        select(EngineScrape.snapshot.is_not(None))
        .where(EngineScrape.url == url, EngineScrape.at <= until)
        .order_by(EngineScrape.at.desc(), EngineScrape.id.desc()).limit(1)
    )).scalar()
    return ScrapeSpan(None if before is None else (before[0], before[1]), inside,
                      None if last is None else bool(last))
