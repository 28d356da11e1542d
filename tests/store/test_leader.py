"""The leader lock and leadership: one holder per database on SQLite (flock) and Postgres
(advisory lock), duties only while leading, stepping down when the lock is lost, taking over
when the leader goes."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from pathlib import Path

import asyncpg  # type: ignore[import-untyped]
import pytest
from prometheus_client import CollectorRegistry

from phasewatch.store.leader import (
    LEADER_LOCK_KEY,
    AdvisoryLock,
    Duty,
    FileLock,
    Leadership,
    LeadershipMetrics,
    OwnLock,
    Role,
    leader_lock,
)
from tests.support.databases import postgres_database

CHECK_S = 0.05


async def until(condition: Callable[[], bool]) -> None:
    """Wait until `condition()` is true, 10 s at most: polled, since the states it reads
    (roles, running duties) have no event to wait on."""
    async with asyncio.timeout(10):
        while not condition():  # noqa: ASYNC110
            await asyncio.sleep(0.01)


def test_the_lock_follows_the_database(tmp_path: Path) -> None:
    assert isinstance(leader_lock(f"sqlite+aiosqlite:///{tmp_path}/pw.db"), FileLock)
    assert isinstance(leader_lock("sqlite+aiosqlite://"), OwnLock)
    assert isinstance(leader_lock("sqlite+aiosqlite:///:memory:"), OwnLock)
    assert isinstance(leader_lock("postgresql+asyncpg://u@h/db"), AdvisoryLock)


async def test_one_file_lock_holder_at_a_time(tmp_path: Path) -> None:
    path = tmp_path / "pw.db.leader"
    first, second = FileLock(path), FileLock(path)
    assert await first.try_acquire() and await first.held()
    assert not await second.try_acquire() and not await second.held()
    assert path.read_text().strip().isdigit()  # the leader's pid, for a person to read
    await first.release()
    assert await second.try_acquire()
    await second.release()


async def test_duties_run_in_the_leader_only_and_move_on_when_it_stops(tmp_path: Path) -> None:
    path = tmp_path / "pw.db.leader"
    running: dict[str, int] = {}
    registry = CollectorRegistry()

    def duty(name: str) -> Duty:
        async def run() -> None:
            running[name] = running.get(name, 0) + 1
            try:
                await asyncio.Event().wait()
            finally:
                running[name] -= 1
        return run

    a = Leadership(FileLock(path), {"work": duty("a")}, CHECK_S, LeadershipMetrics(registry))
    b = Leadership(FileLock(path), {"work": duty("b")}, CHECK_S)
    task_a = asyncio.create_task(a.run())
    await until(lambda: a.role is Role.LEADER and running.get("a") == 1)
    assert registry.get_sample_value("phasewatch_leader") == 1
    task_b = asyncio.create_task(b.run())
    await asyncio.sleep(5 * CHECK_S)
    assert b.role is Role.FOLLOWER and "b" not in running

    task_a.cancel()
    await asyncio.gather(task_a, return_exceptions=True)
    assert a.role is Role.STOPPED and running["a"] == 0
    assert registry.get_sample_value("phasewatch_leader") == 0
    await until(lambda: b.role is Role.LEADER and running.get("b") == 1)
    task_b.cancel()
    await asyncio.gather(task_b, return_exceptions=True)
    assert running["b"] == 0


async def test_a_stop_that_comes_as_the_lock_answers_is_not_lost(tmp_path: Path) -> None:
    # Shutting down cancels the leadership; the cancellation can come in the same turn of the
    # loop as the lock's answer (a worker whose sibling just exited and freed the lock). It
    # must stop the leadership, not be swallowed by the wait on the answer: a leadership that
    # carries on, and takes up the duties, holds the process's shutdown forever.
    async def duty() -> None:
        await asyncio.Event().wait()

    class StopAsItAnswers(FileLock):
        async def try_acquire(self) -> bool:
            asyncio.get_running_loop().call_soon(task.cancel)
            return await super().try_acquire()

    leadership = Leadership(StopAsItAnswers(tmp_path / "pw.db.leader"), {"work": duty}, CHECK_S)
    task = asyncio.create_task(leadership.run())
    done, _ = await asyncio.wait({task}, timeout=10)
    assert done == {task} and task.cancelled()
    assert leadership.role is Role.STOPPED
    assert await FileLock(tmp_path / "pw.db.leader").try_acquire()  # it let go of the lock


def test_a_role_moves_only_as_the_table_allows() -> None:
    leadership = Leadership(OwnLock(), {}, CHECK_S)
    leadership._move(Role.STOPPED)
    with pytest.raises(RuntimeError, match="cannot move from stopped to leader"):
        leadership._move(Role.LEADER)


def test_postgres_one_holder_and_stepping_down_when_the_session_is_gone() -> None:
    with postgres_database(f"pw_{uuid.uuid4().hex[:12]}") as url:
        asyncio.run(_one_holder(url))
        asyncio.run(_stepping_down(url))


async def _one_holder(url: str) -> None:
    first, second = AdvisoryLock(url), AdvisoryLock(url)
    try:
        assert await first.try_acquire() and await first.held()
        assert not await second.try_acquire()
        await first.release()
        assert await second.try_acquire()
    finally:
        await first.release()
        await second.release()


async def _stepping_down(url: str) -> None:
    """The leader's session is killed (a Postgres restart, a network cut): the leader notices
    at its next check, stops its duties, and takes the lock again once it can."""
    started = []

    async def work() -> None:
        started.append(1)
        await asyncio.Event().wait()

    leadership = Leadership(AdvisoryLock(url), {"work": work}, CHECK_S)
    task = asyncio.create_task(leadership.run())
    try:
        await until(lambda: leadership.role is Role.LEADER)
        admin = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://"))
        try:
            killed = await admin.fetchval(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_locks "
                "WHERE locktype = 'advisory' AND database = (SELECT oid FROM pg_database "
                "WHERE datname = current_database()) "
                "AND (classid::bigint << 32 | objid::bigint) = $1", LEADER_LOCK_KEY)
        finally:
            await admin.close()
        assert killed == 1
        await until(lambda: len(started) == 2)  # stepped down, then led again
        assert leadership.role is Role.LEADER
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
