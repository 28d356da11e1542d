"""The record writer keeps one connection between batches, and replaces one that breaks.

Against the real databases: every batch after the first goes through the connection the first
opened (the pool hands out one connection, once), and on Postgres a connection the server
terminates is dropped at the batch that finds it broken, whose records then go out on a new
one: nothing is lost. A connection left idle is given back before the next batch, which takes
a pinged one from the pool: a session the server closed while idle fails no batch."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any

import asyncpg
from prometheus_client import CollectorRegistry
from sqlalchemy import event, func, select
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine

from phasewatch.core.db import create_engine
from phasewatch.core.metrics import ProxyMetrics
from phasewatch.core.records import Outcome, RecordQueue, RequestRecord
from phasewatch.store import writer as writer_module
from phasewatch.store.migrate import upgrade
from phasewatch.store.models import RequestRow
from phasewatch.store.writer import RecordWriter


def record(n: int) -> RequestRecord:
    return RequestRecord(request_id=f"req-{n}", started_at=datetime.now(UTC),
                         endpoint="completions", model="m", upstream="http://u", stream=True,
                         outcome=Outcome.OK, http_status=200, in_flight_at_arrival=0)


class Stored:
    """A record queue whose depth is watched: `offer` one record and wait until it is stored."""

    def __init__(self, metrics: ProxyMetrics) -> None:
        self.empty = asyncio.Event()
        self.queue = RecordQueue(100, metrics.records_dropped.inc, self._depth)

    def _depth(self, depth: int) -> None:
        if depth:
            self.empty.clear()
        else:
            self.empty.set()

    async def offer(self, n: int) -> None:
        self.queue.offer(record(n))
        await asyncio.wait_for(self.empty.wait(), 10)


async def terminate_other_sessions(url: str) -> int:
    """End every other session on this Postgres database, as a server restart would."""
    u = make_url(url)
    connection = await asyncpg.connect(host=u.host, port=u.port, user=u.username,
                                       database=u.database)
    try:
        return len(await connection.fetch(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"))
    finally:
        await connection.close()


class Running:
    """A record writer running on `engine`, with the pool's checkouts counted."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.checkouts: list[Any] = []
        event.listen(engine.sync_engine.pool, "checkout",
                     lambda *args: self.checkouts.append(args))
        self.metrics = ProxyMetrics(CollectorRegistry(), 0.5, 0.04)
        self.stored = Stored(self.metrics)
        self.writer = RecordWriter(self.stored.queue, engine, self.metrics, batch_size=10,
                                   flush_interval_s=0.01)

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        task = asyncio.create_task(self.writer.run())
        try:
            yield
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await self.writer.close()

    def count(self, metric: Any) -> float:
        return float(metric._value.get())


def test_batches_share_one_connection_and_a_broken_one_is_replaced(database_url: str) -> None:
    upgrade(database_url)

    async def scenario() -> None:
        engine = create_engine(database_url)
        w = Running(engine)
        async with w.running():
            for n in range(1, 4):  # three batches, one after another
                await w.stored.offer(n)
            assert w.count(w.metrics.records_written) == 3
            assert len(w.checkouts) == 1
            if engine.dialect.name == "postgresql":
                assert await terminate_other_sessions(database_url) >= 1
                await w.stored.offer(4)
                assert w.count(w.metrics.records_written) == 4
                assert w.count(w.metrics.record_write_failures) == 1
                assert len(w.checkouts) == 2  # the broken one dropped, a new one opened
        async with engine.connect() as connection:
            rows = await connection.scalar(select(func.count()).select_from(RequestRow))
        await engine.dispose()
        assert rows == (4 if engine.dialect.name == "postgresql" else 3)

    asyncio.run(scenario())


def test_close_gives_the_connection_back_and_a_later_batch_opens_another(
        sqlite_url: str) -> None:
    upgrade(sqlite_url)

    async def scenario() -> None:
        engine = create_engine(sqlite_url)
        metrics = ProxyMetrics(CollectorRegistry(), 0.5, 0.04)
        queue = RecordQueue(100, metrics.records_dropped.inc)
        writer = RecordWriter(queue, engine, metrics, batch_size=10, flush_interval_s=0.01)
        for n in range(2):
            queue.offer(record(n))
            assert await writer.flush(timeout_s=5) == 0
            assert engine.sync_engine.pool.checkedout() == 1  # kept between batches
            await writer.close()
            assert engine.sync_engine.pool.checkedout() == 0
        await engine.dispose()
        assert metrics.records_written._value.get() == 2

    asyncio.run(scenario())


def test_a_connection_left_idle_is_given_back_so_a_closed_one_fails_no_batch(
        database_url: str, monkeypatch: Any) -> None:
    upgrade(database_url)
    monkeypatch.setattr(writer_module, "KEEP_IDLE_S", 0.0)  # any gap between batches is idle

    async def scenario() -> None:
        engine = create_engine(database_url)
        w = Running(engine)
        try:
            async with w.running():
                await w.stored.offer(1)
                if engine.dialect.name == "postgresql":  # the server closes the idle session
                    assert await terminate_other_sessions(database_url) >= 1
                await w.stored.offer(2)
                await w.stored.offer(3)
        finally:
            await engine.dispose()
        assert len(w.checkouts) == 3  # one per batch: each found the last one idle
        assert w.count(w.metrics.records_written) == 3
        assert w.count(w.metrics.record_write_failures) == 0

    asyncio.run(scenario())
