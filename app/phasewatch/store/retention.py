"""Retention: roll raw request rows up per minute, then delete the expired ones in small batches.

A minute is rolled up once it is `ROLLUP_DELAY` old, so records still in the write-behind queue
land first; rows written later than that for an already rolled-up minute are not counted in its
rollup. Only rows of rolled-up minutes are ever deleted, `DELETE_BATCH` rows per transaction so
no lock is held for long.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
from collections import defaultdict
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import delete, func, insert, select
from sqlalchemy.ext.asyncio import AsyncEngine

from phasewatch.core.metrics import TTFT_BUCKETS
from phasewatch.store.models import RequestRollup, RequestRow

log = logging.getLogger(__name__)

ROLLUP_DELAY = timedelta(minutes=5)
ROLLUP_SPAN = timedelta(hours=1)  # minutes rolled up per transaction
DELETE_BATCH = 5000


def floor_minute(moment: datetime) -> datetime:
    return moment.replace(second=0, microsecond=0)


ROLLUP_COLUMNS = (
    RequestRow.started_at, RequestRow.model, RequestRow.endpoint, RequestRow.outcome,
    RequestRow.ttft_s, RequestRow.e2e_s, RequestRow.itl_count, RequestRow.itl_mean_s,
    RequestRow.prompt_tokens, RequestRow.output_tokens,
)


def rollup_rows(rows: Iterable[Sequence[Any]]) -> list[dict[str, Any]]:
    """Pure: sum raw rows (ROLLUP_COLUMNS values, in order) per minute/model/endpoint/outcome."""
    sums: dict[tuple[datetime, str, str, str], dict[str, Any]] = {}
    buckets: dict[tuple[datetime, str, str, str], list[int]] = defaultdict(
        lambda: [0] * (len(TTFT_BUCKETS) + 1)
    )
    for (started_at, model, endpoint, outcome, ttft_s, e2e_s, itl_count, itl_mean_s,
         prompt_tokens, output_tokens) in rows:
        key = (floor_minute(started_at), model or "", endpoint, outcome)
        s = sums.get(key)
        if s is None:
            s = sums[key] = {
                "minute": key[0], "model": key[1], "endpoint": key[2], "outcome": key[3],
                "requests": 0, "ttft_count": 0, "ttft_sum_s": 0.0, "e2e_sum_s": 0.0,
                "itl_count": 0, "itl_sum_s": 0.0, "prompt_tokens": 0, "output_tokens": 0,
            }
        s["requests"] += 1
        if ttft_s is not None:
            s["ttft_count"] += 1
            s["ttft_sum_s"] += ttft_s
            buckets[key][bisect.bisect_left(TTFT_BUCKETS, ttft_s)] += 1
        s["e2e_sum_s"] += e2e_s or 0.0
        if itl_count and itl_mean_s is not None:
            s["itl_count"] += itl_count
            s["itl_sum_s"] += itl_mean_s * itl_count
        s["prompt_tokens"] += prompt_tokens or 0
        s["output_tokens"] += output_tokens or 0
    for key, s in sums.items():
        s["ttft_buckets"] = buckets[key]
    return list(sums.values())


async def roll_up(engine: AsyncEngine, now: datetime) -> int:
    """Roll up every complete minute older than ROLLUP_DELAY not rolled up yet; rows written."""
    end = floor_minute(now - ROLLUP_DELAY)
    written = 0
    async with engine.connect() as connection:
        last = await connection.scalar(select(func.max(RequestRollup.minute)))
        start = (last + timedelta(minutes=1)) if last is not None else await connection.scalar(
            select(func.min(RequestRow.started_at)))
    if start is None:
        return 0
    start = floor_minute(start)
    while start < end:
        async with engine.connect() as connection:  # skip hours without traffic in one step
            next_row = await connection.scalar(
                select(func.min(RequestRow.started_at)).where(RequestRow.started_at >= start))
        if next_row is None or next_row >= end:
            break
        start = max(start, floor_minute(next_row))
        stop = min(end, start + ROLLUP_SPAN)
        async with engine.begin() as connection:
            result = await connection.execute(
                select(*ROLLUP_COLUMNS)
                .where(RequestRow.started_at >= start, RequestRow.started_at < stop)
            )
            rollups = rollup_rows(tuple(row) for row in result)  # tuples: cheap to unpack
            if rollups:
                await connection.execute(insert(RequestRollup), rollups)
            written += len(rollups)
        start = stop
    return written


async def delete_expired(engine: AsyncEngine, cutoff: datetime) -> int:
    """Delete raw rows older than `cutoff` that are rolled up, a batch per transaction."""
    async with engine.connect() as connection:
        rolled = await connection.scalar(select(func.max(RequestRollup.minute)))
    if rolled is None:
        return 0
    cutoff = min(cutoff, rolled + timedelta(minutes=1))
    deleted = 0
    while True:
        async with engine.begin() as connection:
            ids = select(RequestRow.id).where(RequestRow.started_at < cutoff).order_by(
                RequestRow.id).limit(DELETE_BATCH).scalar_subquery()
            result = await connection.execute(delete(RequestRow).where(RequestRow.id.in_(ids)))
        count = result.rowcount or 0
        deleted += count
        if count < DELETE_BATCH:
            return deleted
        await asyncio.sleep(0)  # let the writer and the API in between batches


async def retention_pass(engine: AsyncEngine, retention: timedelta | None,
                         now: datetime | None = None) -> tuple[int, int]:
    now = now or datetime.now(UTC)
    rolled = await roll_up(engine, now)
    deleted = await delete_expired(engine, now - retention) if retention else 0
    return rolled, deleted


async def run_retention(engine: AsyncEngine, retention: timedelta | None,
                        interval_s: float) -> None:
    """Background task: a retention pass every `interval_s`; a database fault waits a turn."""
    while True:
        try:
            rolled, deleted = await retention_pass(engine, retention)
            if rolled or deleted:
                log.info("retention: %d rollup rows written, %d request rows deleted",
                         rolled, deleted)
        except Exception as exc:
            log.warning("retention pass failed (%s: %s)", type(exc).__name__, str(exc)[:200])
        await asyncio.sleep(interval_s)
