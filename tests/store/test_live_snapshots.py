"""Live snapshots in the store: one row per process, replaced at each publication, stale rows
swept; the publisher bounded, fault-tolerant and withdrawing its row when it stops; and
`/api/diagnosis` reading the snapshots of every process (so any process answers the same)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import httpx
from sqlalchemy import func, select

from phasewatch.core.db import create_engine, create_sessionmaker
from phasewatch.core.live import InFlight
from phasewatch.core.settings import load_settings
from phasewatch.diagnosis.service import DiagnosisService, PreviousSpan
from phasewatch.store.live_publisher import LivePublisher
from phasewatch.store.live_snapshots import put_snapshot, read_fresh
from phasewatch.store.migrate import upgrade
from phasewatch.store.models import LiveSnapshot
from tests.conftest import Proxy
from tests.diagnosis.test_api import insert, rows, z

NOW = datetime(2026, 12, 1, 12, 0, 0, tzinfo=UTC)


def waiting(age_s: float, started_s: float = 1.0e9, model: str = "m") -> InFlight:
    return InFlight(model=model, started_s=started_s, age_s=age_s, ttft_s=None,
                    silent_s=age_s, itl_count=0, itl_p50_s=None, itl_max_s=None,
                    prompt_tokens=None, in_flight=3)


async def test_one_row_per_process_replaced_and_stale_rows_swept(database_url: str) -> None:
    await asyncio.to_thread(upgrade, database_url)
    engine = create_engine(database_url)
    try:
        async with create_sessionmaker(engine)() as session:
            old = NOW - timedelta(minutes=5)
            await put_snapshot(session, "a", old, [waiting(1.0)], stale_before=old)
            await put_snapshot(session, "b", NOW - timedelta(seconds=3), [waiting(2.0)],
                               stale_before=NOW - timedelta(minutes=1))  # sweeps "a"
            await put_snapshot(session, "b", NOW, [waiting(3.0), waiting(0.5)],
                               stale_before=NOW - timedelta(minutes=1))  # replaces "b"
            await put_snapshot(session, "c", NOW - timedelta(seconds=20), [],
                               stale_before=NOW - timedelta(minutes=1))
            assert await session.scalar(select(func.count()).select_from(LiveSnapshot)) == 2
            fresh = await read_fresh(session, NOW - timedelta(seconds=10), NOW)
            assert [(s.process, [r.age_s for r in s.requests]) for s in fresh] == [
                ("b", [3.0, 0.5])]
            assert fresh[0].requests[0] == waiting(3.0)  # round trip through JSON
    finally:
        await engine.dispose()


async def test_the_publisher_is_bounded_survives_faults_and_withdraws(sqlite_url: str) -> None:
    await asyncio.to_thread(upgrade, sqlite_url)
    engine = create_engine(sqlite_url)
    sessionmaker = create_sessionmaker(engine)
    calls: list[int] = []
    published = asyncio.Event()

    async def source() -> list[InFlight]:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("registry broke")
        if len(calls) >= 3:
            published.set()
        return [waiting(float(age)) for age in range(10)]

    publisher = LivePublisher(source, sessionmaker, interval_s=0.01, keep_s=60,
                              max_requests=4, process="p1")
    try:
        assert await publisher.publish() is True
        async with sessionmaker() as session:
            (snapshot,) = await read_fresh(session, NOW - timedelta(days=3650),
                                           datetime.now(UTC))
        assert [r.age_s for r in snapshot.requests] == [9.0, 8.0, 7.0, 6.0]  # the oldest
        assert await publisher.publish() is False and publisher.failures == 1
        task = asyncio.create_task(publisher.run())
        await asyncio.wait_for(published.wait(), timeout=10)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert task.cancelled()
        async with sessionmaker() as session:
            assert await session.scalar(select(func.count()).select_from(LiveSnapshot)) == 0
    finally:
        await engine.dispose()


def test_every_process_serves_the_published_live_state(
        make_proxy: Callable[..., Proxy], scripted_url: str, sqlite_url: str) -> None:
    """Finished records say nothing yet (the baseline's TTFT); another process's snapshot holds
    eight requests waiting 3 s for a first token: this process names the queue from it."""
    proxy = make_proxy(scripted_url, diagnosis_interval_s=0, engine_metrics_enabled=False,
                       live_snapshot_interval_s=0)
    now = datetime.now(UTC).replace(microsecond=0)
    insert(sqlite_url, [*rows("m", now - timedelta(minutes=20), 600, 80, seed=1),
                        *rows("m", now - timedelta(seconds=60), 55, 40, seed=2)])

    async def publish() -> None:
        engine = create_engine(sqlite_url)
        try:
            async with create_sessionmaker(engine)() as session:
                await put_snapshot(
                    session, "other-worker", now - timedelta(seconds=1),
                    [waiting(3.0 - 0.1 * i, now.timestamp() - 3.0 + 0.1 * i + 0.0137)
                     for i in range(8)], stale_before=now - timedelta(minutes=1))
                # Past the freshness bound (10 s): not read.
                await put_snapshot(
                    session, "quiet-worker", now - timedelta(seconds=30),
                    [waiting(5.0, now.timestamp() - 35.0)], stale_before=now - timedelta(minutes=1))
        finally:
            await engine.dispose()

    def ask() -> dict[str, object]:  # about the present: no `until`
        response = httpx.get(proxy.url + "/api/diagnosis", timeout=30, params={
            "model": "m", "window": "1m", "baseline": "20m"})
        assert response.status_code == 200, response.text
        return dict(response.json())

    assert ask()["verdict"] == "healthy"
    asyncio.run(publish())
    body = ask()
    assert body["verdict"] == "queueing", body["summary"]
    assert body["live"]["snapshots"] == 1 and body["live"]["requests"] == 8  # type: ignore[index]
    # A moment already past is answered from finished records alone, alike in every process.
    past = httpx.get(proxy.url + "/api/diagnosis", timeout=30, params={
        "model": "m", "until": z(now), "window": "1m", "baseline": "20m"}).json()
    assert past["live"]["requests"] == 0 and past["verdict"] == "healthy"


async def test_a_snapshot_published_while_the_present_is_diagnosed_counts(
        sqlite_url: str) -> None:
    """A diagnosis of the present fixes its `until` first; a process that republishes while
    the diagnosis reads (its new row replacing the old) is still in flight evidence."""
    await asyncio.to_thread(upgrade, sqlite_url)
    engine = create_engine(sqlite_url)
    service = DiagnosisService(create_sessionmaker(engine), load_settings(
        database_url=sqlite_url, engine_metrics_enabled=False))
    until = datetime.now(UTC) - timedelta(seconds=1)  # a diagnosis that took a second so far
    try:
        async with service.sessionmaker() as session:
            await put_snapshot(session, "p1", until + timedelta(milliseconds=500),
                               [waiting(3.0)], stale_before=until - timedelta(minutes=1))
        window = timedelta(seconds=60)
        present = await service.diagnose("m", until, window, PreviousSpan(300))
        assert present["live"]["snapshots"] == 1 and present["live"]["requests"] == 1
        past = await service.diagnose("m", until, window, PreviousSpan(300), live=False)
        assert past["live"]["snapshots"] == 0
    finally:
        await engine.dispose()
