"""The write-behind record writer: one background task storing records in batches.

The relay only ever `offer`s records to the bounded queue. This task takes them off in batches
(up to `batch_size`, or whatever arrived within `flush_interval`), and inserts each batch in one
statement. The writer shares the relay's event loop, so the insert takes the driver's cheapest
path: Postgres's binary COPY, SQLite's executemany, both fed plain tuples (measured in
benchmarks/store_scale.py: about a fifth of the CPU per record of an ORM-level insert). It keeps
one connection between batches instead of taking one from the pool for each: a checkout, its
reset on return and (Postgres) its ping cost more than a small batch's insert. A connection
that fails is dropped, and the next try opens a new one; one left idle for `KEEP_IDLE_S` is
given back before the next batch, which takes a pinged one from the pool, so a server or a
pooler that closes idle sessions costs no failed batch.

If the database is slow or down, the batch is retried with backoff while the queue
fills up to its bound, beyond which the queue drops and counts records; writing resumes by itself
when the database answers again. On shutdown the queue is flushed, within a time limit.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from dataclasses import fields
from datetime import UTC
from operator import attrgetter
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from phasewatch.core.log_throttle import LogThrottle
from phasewatch.core.metrics import ProxyMetrics
from phasewatch.core.records import RecordQueue, RequestRecord
from phasewatch.store.models import RequestRow

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 5.0
KEEP_IDLE_S = 30.0  # the kept connection is given back after this long without a batch


COLUMNS = tuple(field.name for field in fields(RequestRecord))
_VALUES = attrgetter(*COLUMNS)  # a record's values in COLUMNS order, read in one call
_STARTED, _OUTCOME = COLUMNS.index("started_at"), COLUMNS.index("outcome")
# Text that comes from clients (headers, the request's model) is cut to its column's length:
# Postgres would refuse the whole batch for one over-long value, and retry it forever.
_LIMITS = [
    (COLUMNS.index(column.name), length)
    for column in RequestRow.__table__.columns
    if column.name in COLUMNS and (length := getattr(column.type, "length", None))
]
# How SQLAlchemy's SQLite dialect stores a DATETIME (UTC, no zone): rows written here must read
# back through the ORM exactly like rows it wrote.
_SQLITE_DATETIME = "%Y-%m-%d %H:%M:%S.%f"
_SQLITE_INSERT = (f"INSERT INTO {RequestRow.__tablename__} ({', '.join(COLUMNS)}) "
                  f"VALUES ({', '.join('?' * len(COLUMNS))})")


def record_row(record: RequestRecord) -> list[Any]:
    """The record's values in COLUMNS order, as the table stores them."""
    row = list(_VALUES(record))
    row[_OUTCOME] = record.outcome.value
    for index, length in _LIMITS:
        value = row[index]
        if value is not None and len(value) > length:
            row[index] = value[:length]
    return row


def is_data_error(exc: BaseException) -> bool:
    """The database refused the values themselves (SQLSTATE class 22 data exception or 23
    integrity violation, or SQLite's equivalents): retrying the same rows can never succeed."""
    sqlstate = getattr(exc, "sqlstate", None) or getattr(getattr(exc, "orig", None), "sqlstate",
                                                          None)
    if isinstance(sqlstate, str) and sqlstate[:2] in ("22", "23"):
        return True
    return isinstance(exc, sqlite3.DataError | sqlite3.IntegrityError)


async def insert_rows(connection: AsyncConnection, rows: list[list[Any]]) -> None:
    """Insert rows (COLUMNS order) with the driver's bulk path, inside the caller's transaction."""
    raw = (await connection.get_raw_connection()).driver_connection
    assert raw is not None
    if connection.dialect.name == "postgresql":
        await raw.copy_records_to_table(RequestRow.__tablename__, records=rows,
                                        columns=list(COLUMNS))
        return
    for row in rows:
        row[_STARTED] = row[_STARTED].astimezone(UTC).strftime(_SQLITE_DATETIME)
    await raw.executemany(_SQLITE_INSERT, rows)


class RecordWriter:
    def __init__(
        self,
        queue: RecordQueue,
        engine: AsyncEngine,
        metrics: ProxyMetrics,
        batch_size: int,
        flush_interval_s: float,
    ) -> None:
        self._queue = queue
        self._engine = engine
        self._metrics = metrics
        self._batch_size = batch_size
        self._flush_interval_s = flush_interval_s
        self._batch: list[RequestRecord] = []  # taken off the queue, not yet stored
        self._failing_since: float | None = None
        self._connection: AsyncConnection | None = None  # kept between batches
        self._used_at = 0.0  # time.monotonic() of the kept connection's last batch
        # A client can send a refused value on every request: logged once a minute.
        self._refusals = LogThrottle()

    def failing_for_s(self) -> float:
        """How long storing has been failing (0 while it works)."""
        since = self._failing_since
        return 0.0 if since is None else time.monotonic() - since

    async def run(self) -> None:
        """Store records until cancelled. Never raises for a database fault."""
        backoff = 0.1
        while True:
            if not self._batch:
                await self._collect()
            if await self._write():
                backoff = 0.1
            else:
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_S)

    async def _collect(self) -> None:
        """Wait for one record, then take whatever else arrives within the flush interval (or
        until the batch is full)."""
        batch, queue = self._batch, self._queue
        batch.append(await queue.get())
        await queue.fill(self._batch_size - len(batch), self._flush_interval_s)
        while len(batch) < self._batch_size:
            try:
                batch.append(queue.get_nowait())
            except asyncio.QueueEmpty:
                break

    async def _insert(self, rows: list[list[Any]]) -> None:
        """Insert rows in one transaction on the kept connection (opened if there is none);
        any fault drops that connection."""
        now = time.monotonic()
        if self._connection is not None and now - self._used_at > KEEP_IDLE_S:
            await self.close()
        connection = self._connection
        try:
            if connection is None:
                connection = self._connection = await self._engine.connect()
            async with connection.begin():
                await insert_rows(connection, rows)
        except Exception:
            await self.close()
            raise
        self._used_at = now

    async def close(self) -> None:
        """Give back the kept connection (the writer opens another if it writes again)."""
        connection, self._connection = self._connection, None
        if connection is not None:
            try:
                await connection.close()
            except Exception:  # a broken connection: the pool discards it
                log.debug("closing the writer's connection failed", exc_info=True)

    async def _write(self) -> bool:
        rows = [record_row(record) for record in self._batch]
        try:
            await self._insert(rows)
        except Exception as exc:  # any database fault: keep the batch, retry later...
            self._metrics.record_write_failures.inc()
            if is_data_error(exc):  # ...unless the database refused the data itself
                await self._write_one_by_one(rows)
                return True
            if self._failing_since is None:
                self._failing_since = time.monotonic()
                log.warning("cannot store records (%s: %s); retrying, %d queued",
                            type(exc).__name__, str(exc)[:200], self._queue.qsize())
            return False
        if self._failing_since is not None:
            log.warning("storing records again after %.1f s; %d dropped meanwhile in total",
                        time.monotonic() - self._failing_since, self._queue.dropped)
            self._failing_since = None
        self._metrics.records_written.inc(len(rows))
        self._batch = []
        self._queue.release(len(rows))
        return True

    async def _write_one_by_one(self, rows: list[list[Any]]) -> None:
        """Store what the database accepts; reject (count, log) the rows it refuses."""
        written = 0
        for row in rows:
            try:
                await self._insert([row])
                written += 1
            except Exception as exc:
                if not is_data_error(exc):
                    raise
                self._metrics.records_rejected.inc()
                unlogged = self._refusals.occurred()
                if unlogged is not None:
                    log.warning("record refused by the database (%s: %s; %d more since the "
                                "last logged)", type(exc).__name__, str(exc)[:200], unlogged)
        self._metrics.records_written.inc(written)
        self._batch = []
        self._queue.release(len(rows))

    async def flush(self, timeout_s: float) -> int:
        """Store everything queued, giving up after `timeout_s`. Returns records left unstored."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            while len(self._batch) < self._batch_size:
                try:
                    self._batch.append(self._queue.get_nowait())
                except asyncio.QueueEmpty:
                    break
            if not self._batch:
                return 0
            if not await self._write():
                await asyncio.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
        left = len(self._batch) + self._queue.qsize()
        if left:
            log.warning("shutting down with %d records not stored", left)
        return left
