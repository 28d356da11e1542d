"""The headroom's rate, round by round, on a real database: arrivals still in flight count
(under overload the stored requests show the engine's throughput, not the load offered), and
each round reads the rate while the next calibration runs behind it. The calibration itself is
replaced here (it is tested in test_calibration.py and test_plan_command.py): what is under
test is the duty around it."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from phasewatch.core.db import create_engine, create_sessionmaker
from phasewatch.core.live import InFlight
from phasewatch.core.settings import load_settings
from phasewatch.plan import capacity
from phasewatch.plan.capacity import CapacityMetrics, CapacityService
from phasewatch.store.live_snapshots import put_snapshot
from phasewatch.store.migrate import upgrade
from tests.diagnosis.test_api import insert, rows


def _waiting(now: datetime, count: int) -> list[InFlight]:
    item = InFlight(model="m", started_s=now.timestamp() - 5, age_s=5.0, ttft_s=None,
                    silent_s=5.0, itl_count=0, itl_p50_s=None, itl_max_s=None,
                    prompt_tokens=None, in_flight=0)
    return [item] * count


async def test_the_rate_counts_requests_in_flight_and_follows_them_between_calibrations(
        sqlite_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    now = datetime.now(UTC)
    await asyncio.to_thread(upgrade, sqlite_url)
    # 30 stored requests that arrived in the last minute: 0.5/s ended.
    await asyncio.to_thread(insert, sqlite_url, rows("m", now - timedelta(seconds=50), 40, 30))
    answers = iter([2.0, 4.0, 4.0])
    release = threading.Event()
    calls: list[int] = []

    def compute(stored: Any, *args: Any) -> float:
        calls.append(len(stored))
        if len(calls) > 1:
            release.wait(30)  # the second calibration runs until the test lets it end
        return next(answers)

    monkeypatch.setattr(capacity, "compute", compute)
    settings = load_settings(database_url=sqlite_url, capacity_rate_window_s=60)
    engine = create_engine(sqlite_url)
    sessions = create_sessionmaker(engine)
    service = CapacityService(sessions, settings, CapacityMetrics(CollectorRegistry()))
    pool: Any = ThreadPoolExecutor(1)
    try:
        async with sessions() as session:  # 90 more arrived and wait: 2/s offered in all
            await put_snapshot(session, "p1", datetime.now(UTC), _waiting(now, 90),
                               stale_before=now - timedelta(seconds=60))
        # The first round waits for the model's first calibration: 2.0/s over 2.0/s.
        assert await service.evaluate_all(pool) == {"m": pytest.approx(1.0)}
        # The next starts a calibration and does not wait for it; the rate is read anew:
        # 150 more in flight, 4.5/s offered, over the same highest rate.
        async with sessions() as session:
            await put_snapshot(session, "p1", datetime.now(UTC), _waiting(now, 240),
                               stale_before=now - timedelta(seconds=60))
        assert await service.evaluate_all(pool) == {"m": pytest.approx(2.0 / 4.5)}
        assert len(calls) == 2
        # Once it ends, the first round after takes its answer (and starts the next).
        release.set()
        seen = [await service.evaluate_all(pool)]
        while seen[-1]["m"] == pytest.approx(2.0 / 4.5) and len(seen) < 100:
            await asyncio.sleep(0.05)
            seen.append(await service.evaluate_all(pool))
        assert seen[-1] == {"m": pytest.approx(4.0 / 4.5)}
        assert calls == [30, 30, 30]
    finally:
        release.set()
        pool.shutdown(wait=True)
        await engine.dispose()
