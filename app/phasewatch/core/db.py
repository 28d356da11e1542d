"""Database engine and sessions: SQLite (embedded default, WAL mode) or Postgres, both async.

Built by the app's lifespan or the CLI, never at import time.
"""

from __future__ import annotations

import asyncio
import contextlib
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import orjson
from sqlalchemy import event
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)


def is_sqlite(url: str) -> bool:
    return make_url(url).get_backend_name() == "sqlite"


class MissingDriver(RuntimeError):
    """The database URL names a driver this installation lacks; the message says what to run."""


def require_driver(url: str) -> None:
    """Raise MissingDriver when `url` needs a driver this installation lacks."""
    if not is_sqlite(url) and find_spec("asyncpg") is None:
        raise MissingDriver("PHASEWATCH_DATABASE_URL is a PostgreSQL URL, whose driver "
                            "(asyncpg) is not installed: pip install 'phasewatch[postgres]'")


def _json_dumps(value: Any) -> str:
    """JSON columns are written with orjson: the live snapshot (a few hundred requests every
    couple of seconds) is encoded in C, straight from its dataclasses, instead of holding the
    event loop in the json module."""
    return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS).decode()


def create_engine(url: str) -> AsyncEngine:
    require_driver(url)
    json_codec = {"json_serializer": _json_dumps, "json_deserializer": orjson.loads}
    if not is_sqlite(url):
        return create_async_engine(url, pool_size=5, max_overflow=5, pool_pre_ping=True,
                                   **json_codec)
    database = make_url(url).database
    if database and database != ":memory:":
        Path(database).parent.mkdir(parents=True, exist_ok=True)
    engine = create_async_engine(url, connect_args={"timeout": 30}, **json_codec)
    event.listen(engine.sync_engine, "connect", _sqlite_pragmas)
    event.listen(engine.sync_engine, "invalidate", _interrupt_sqlite)
    return engine


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    # WAL lets the API read while the writer writes; NORMAL sync is durable across app crashes
    # (not power loss) at a fraction of FULL's fsyncs; the busy timeout rides out short locks.
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def _interrupt_sqlite(dbapi_connection: Any, _record: Any, _exception: Any) -> None:
    # A connection is invalidated when the task awaiting its query is cancelled (an API call
    # past its time budget). Its query would run on in aiosqlite's thread, and closing the
    # connection would wait for it: stop the query (sqlite3's interrupt() may be called from
    # any thread; aiosqlite's coroutine calls it at once, without going through that thread).
    # Postgres needs nothing: asyncpg cancels the server's query itself.
    driver = dbapi_connection.driver_connection
    if driver is not None:
        task = asyncio.get_running_loop().create_task(_interrupt(driver))
        _interrupting.add(task)  # a task the loop holds only weakly
        task.add_done_callback(_interrupting.discard)


async def _interrupt(driver: Any) -> None:
    with contextlib.suppress(ValueError):  # closed already: nothing left to stop
        await driver.interrupt()


_interrupting: set[asyncio.Task[None]] = set()


def create_sessionmaker(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    return async_sessionmaker(engine, expire_on_commit=False)
