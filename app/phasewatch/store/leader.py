"""Leadership: the one process, of every worker and replica on a database, that runs the duties.

Retention, the diagnosis schedule and the engine scrape must run once per database, however
many processes serve it (`--workers`, replicas): run N times, retention would race itself, the
schedule would store each change of verdict N times and export N sets of gauges, and the engine
would be scraped N times. So every process competes for one lock; the holder leads and runs the
duties, the others follow and try again every `check_s`; a leader that finds its lock gone
stops its duties and follows again. Every process keeps relaying, storing its own records and
answering the API whatever its role.

- Postgres: a session-level advisory lock (`pg_try_advisory_lock`) on a connection of its own,
  held for as long as the process leads. A process that dies drops its connection and the
  server frees the lock; the leader checks its connection every `check_s` and steps down when
  it fails (the server has freed the lock then, or will when it notices the connection gone).
- SQLite: `flock` on a file beside the database (`phasewatch.db.leader`, holding the leader's
  pid); the kernel frees it when the holder exits, however it ends. Only processes on one
  host share an SQLite file, and flock is per host.
- An in-memory SQLite database belongs to its process, which always leads.

The role is one value (`Role`), moved in one place (`Leadership._move`). Duties start only once
the lock is held and are cancelled before the role leaves LEADER. Between a lock lost on the
server and the leader's next check, up to `check_s`, two processes may both run the duties;
each duty is safe under that (retention's rollups have a primary key, so a second insert of the
same minute fails and is retried; a verdict change may be stored twice).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
from collections.abc import Callable, Coroutine, Mapping
from enum import Enum
from pathlib import Path
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Gauge
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncConnection, create_async_engine
from sqlalchemy.pool import NullPool

log = logging.getLogger(__name__)

# Any fixed 64-bit key, phasewatch's own for "the leader"; advisory locks are per database.
LEADER_LOCK_KEY = 0x7077_6C65_6164_6572  # "pwleader"
# The longest a lock statement (connect, take, check) may take before it counts as failed.
STATEMENT_TIMEOUT_S = 10.0

Duty = Callable[[], Coroutine[Any, Any, None]]


class Role(Enum):
    FOLLOWER = "follower"  # another process leads, or none could take the lock yet
    LEADER = "leader"  # this process holds the lock and runs the duties
    STOPPED = "stopped"  # shut down: duties ended, lock released


MOVES = {
    Role.FOLLOWER: {Role.LEADER, Role.STOPPED},
    Role.LEADER: {Role.FOLLOWER, Role.STOPPED},
    Role.STOPPED: set(),
}


class LeaderLock(Protocol):
    """One database's leader lock, as seen by one process."""

    async def try_acquire(self) -> bool:
        """Take the lock if it is free; never waits for it."""

    async def held(self) -> bool:
        """Whether this process still holds the lock it took."""

    async def release(self) -> None:
        """Let go (if held) and free what the lock uses."""


class AdvisoryLock:
    """Postgres: a session advisory lock on a connection of its own (no pool, autocommit, so
    it holds no transaction open while it leads)."""

    def __init__(self, url: str, key: int = LEADER_LOCK_KEY) -> None:
        self.key = key
        self._engine = create_async_engine(
            url, poolclass=NullPool, isolation_level="AUTOCOMMIT",
            connect_args={"timeout": STATEMENT_TIMEOUT_S, "command_timeout": STATEMENT_TIMEOUT_S},
        )
        self._connection: AsyncConnection | None = None

    async def try_acquire(self) -> bool:
        connection = await self._engine.connect()
        try:
            taken = await connection.scalar(text("SELECT pg_try_advisory_lock(:key)"),
                                            {"key": self.key})
        except BaseException:
            await connection.close()
            raise
        if not taken:
            await connection.close()
            return False
        self._connection = connection
        return True

    async def held(self) -> bool:
        if self._connection is None:
            return False
        try:
            await self._connection.exec_driver_sql("SELECT 1")
        except Exception:
            await self._drop()
            return False
        return True

    async def _drop(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            with contextlib.suppress(Exception):
                await connection.invalidate()
            with contextlib.suppress(Exception):
                await connection.close()

    async def release(self) -> None:
        if self._connection is not None:
            with contextlib.suppress(Exception):  # closing the session frees it anyway
                await self._connection.scalar(text("SELECT pg_advisory_unlock(:key)"),
                                              {"key": self.key})
            await self._drop()
        await self._engine.dispose()


class FileLock:
    """SQLite: an exclusive `flock` on `path`, held through one open file descriptor."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    async def try_acquire(self) -> bool:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())  # which process leads, for a person to read
        self._fd = fd
        return True

    async def held(self) -> bool:
        return self._fd is not None

    async def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the descriptor releases the lock


class OwnLock:
    """A database no other process can open (in-memory SQLite): always this process's."""

    def __init__(self) -> None:
        self._held = False

    async def try_acquire(self) -> bool:
        self._held = True
        return True

    async def held(self) -> bool:
        return self._held

    async def release(self) -> None:
        self._held = False


def leader_lock(database_url: str) -> LeaderLock:
    """The leader lock for the database at `database_url`."""
    url = make_url(database_url)
    if url.get_backend_name() != "sqlite":
        return AdvisoryLock(database_url)
    database = url.database
    if not database or database == ":memory:" or url.query.get("mode") == "memory":
        return OwnLock()
    return FileLock(Path(database + ".leader"))


class LeadershipMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.leader = Gauge(
            "phasewatch_leader",
            "1 where the process that runs retention, the diagnosis schedule and the engine "
            "scrape for this database is (summed over this instance's workers), else 0.",
            registry=registry, multiprocess_mode="livesum",
        )


def _report_failure(task: asyncio.Task[None]) -> None:
    """A duty handles its own faults and loops until cancelled; one that ends is a bug."""
    if not task.cancelled() and task.exception() is not None:
        log.error("leader duty %s stopped: %r", task.get_name(), task.exception())


class Leadership:
    """Competes for `lock` every `check_s` and runs `duties` (name -> a coroutine function that
    loops until cancelled) while it holds it. `run` until cancelled."""

    def __init__(self, lock: LeaderLock, duties: Mapping[str, Duty], check_s: float,
                 metrics: LeadershipMetrics | None = None) -> None:
        self.lock = lock
        self.duties = dict(duties)
        self.check_s = check_s
        self.metrics = metrics
        self.role = Role.FOLLOWER
        self._tasks: list[asyncio.Task[None]] = []
        self._problem: str | None = None  # the last lock error logged, to log each one once

    def _move(self, role: Role) -> None:
        if role not in MOVES[self.role]:
            raise RuntimeError(f"leadership cannot move from {self.role.value} to {role.value}")
        self.role = role
        if self.metrics is not None:
            self.metrics.leader.set(1 if role is Role.LEADER else 0)
        if role is Role.LEADER:
            self._tasks = [asyncio.create_task(duty(), name=name)
                           for name, duty in self.duties.items()]
            for task in self._tasks:
                task.add_done_callback(_report_failure)

    async def _end_duties(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _ask(self, question: Callable[[], Coroutine[Any, Any, bool]]) -> bool:
        """The lock's answer; False (logged once per distinct problem) when it cannot say."""
        try:
            # Not `asyncio.wait_for`: on Python 3.11 it swallows a cancellation that comes as
            # the answer does, and the leadership would carry on through its shutdown.
            async with asyncio.timeout(STATEMENT_TIMEOUT_S):
                answer = await question()
        except Exception as exc:
            problem = f"{type(exc).__name__}: {str(exc)[:200]}"
            if problem != self._problem:
                log.warning("leader lock unavailable (%s); retrying every %g s", problem,
                            self.check_s)
            self._problem = problem
            return False
        self._problem = None
        return answer

    async def run(self) -> None:
        try:
            while True:
                if self.role is Role.FOLLOWER:
                    if await self._ask(self.lock.try_acquire):
                        log.info("leading: this process runs retention, the diagnosis schedule "
                                 "and the engine scrape")
                        self._move(Role.LEADER)
                elif not await self._ask(self.lock.held):
                    log.warning("lost the leader lock: stopping retention, the diagnosis "
                                "schedule and the engine scrape until it is taken again")
                    await self._end_duties()
                    self._move(Role.FOLLOWER)
                await asyncio.sleep(self.check_s)
        finally:
            await self._end_duties()
            await self.lock.release()
            self._move(Role.STOPPED)
