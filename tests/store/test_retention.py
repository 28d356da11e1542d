"""Retention: old raw rows become per-minute rollups, then are deleted in small batches."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import func, insert, select

from phasewatch.core.db import create_engine
from phasewatch.core.metrics import TTFT_BUCKETS
from phasewatch.store import retention
from phasewatch.store.migrate import upgrade
from phasewatch.store.models import RequestRollup, RequestRow
from phasewatch.store.retention import retention_pass, rollup_rows

NOW = datetime(2026, 11, 30, 12, 0, 30, tzinfo=UTC)


def row(at: datetime, **figures: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "request_id": "r", "started_at": at, "endpoint": "completions", "model": "m",
        "upstream": "u", "stream": True, "outcome": "ok", "http_status": 200,
        "in_flight_at_arrival": 0, "ttft_s": 0.1, "e2e_s": 1.0, "tpot_s": 0.01, "itl_count": 9,
        "itl_mean_s": 0.01, "itl_p50_s": 0.01, "itl_p95_s": 0.02, "itl_max_s": 0.03,
        "prompt_tokens": 100, "output_tokens": 10, "tokens_exact": True, "run_id": None,
        "error": None,
    }
    return {**base, **figures}


def test_rollup_arithmetic_is_pure_and_exact() -> None:
    minute = datetime(2026, 1, 1, 0, 0, tzinfo=UTC)
    seconds_ttft = ((1, 0.1), (2, 0.3), (59, None))
    raw = [row(minute + timedelta(seconds=s), ttft_s=t) for s, t in seconds_ttft]
    raw.append(row(minute + timedelta(seconds=61)))
    rows = [tuple(r[c.key] for c in retention.ROLLUP_COLUMNS) for r in raw]
    out = {r["minute"]: r for r in rollup_rows(rows)}
    first = out[minute]
    assert first["requests"] == 3 and first["ttft_count"] == 2
    assert first["ttft_sum_s"] == pytest.approx(0.4)
    assert first["itl_count"] == 27 and first["itl_sum_s"] == pytest.approx(0.27)
    assert sum(first["ttft_buckets"]) == 2
    assert first["ttft_buckets"][TTFT_BUCKETS.index(0.1)] == 1  # le="0.1" holds 0.1 itself
    assert out[minute + timedelta(minutes=1)]["requests"] == 1


async def test_retention_rolls_up_then_deletes_in_batches(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import asyncio
    await asyncio.to_thread(upgrade, database_url)
    monkeypatch.setattr(retention, "DELETE_BATCH", 7)  # several batches for 25 old rows
    engine = create_engine(database_url)
    old = [row(NOW - timedelta(days=20, minutes=m % 5, seconds=m)) for m in range(25)]
    recent = [row(NOW - timedelta(minutes=30, seconds=s)) for s in range(6)]
    fresh = [row(NOW - timedelta(minutes=1))]  # too new to roll up yet
    try:
        async with engine.begin() as connection:
            await connection.execute(insert(RequestRow), old + recent + fresh)
        rolled, deleted = await retention_pass(engine, timedelta(days=14), now=NOW)
        assert deleted == 25
        # One rollup row per minute with traffic (one model, endpoint and outcome here).
        assert rolled == len({retention.floor_minute(r["started_at"]) for r in old + recent})
        async with engine.connect() as connection:
            left = await connection.scalar(select(func.count()).select_from(RequestRow))
            total = await connection.scalar(select(func.sum(RequestRollup.requests)))
            latest = await connection.scalar(select(func.max(RequestRollup.minute)))
        assert left == 7  # recent and fresh rows stay
        assert total == 31  # every row old enough to roll up is counted once...
        assert latest < NOW - retention.ROLLUP_DELAY
        assert await retention_pass(engine, timedelta(days=14), now=NOW) == (0, 0)  # ...once
    finally:
        await engine.dispose()
