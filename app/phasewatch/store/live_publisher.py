"""The background task every process runs to publish its requests in flight to the database.

Every `interval_s` it calls `source()` (the relay's live registry: `LiveStreams.snapshot`), keeps at
most `max_requests` of them (the oldest first: they carry the evidence of a queue or a stall), and
stores them as this process's snapshot (app/phasewatch/store/live_snapshots.py), deleting any
process's snapshot older than `keep_s`. It never touches the relay beyond that one call, never
raises out of its loop (a failing source or database is logged once per outage and counted in
`failures`), and removes its own row when it stops, since its requests are then no longer in flight
anywhere.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from phasewatch.core.live import InFlight
from phasewatch.store.live_snapshots import drop_snapshot, put_snapshot

log = logging.getLogger(__name__)

# The relay's live registry's `LiveStreams.snapshot` (app/phasewatch/proxy/live.py), or any
# coroutine function giving the requests in flight now (tests pass their own).
LiveSource = Callable[[], Awaitable[list[InFlight]]]


def process_id() -> str:
    """This process, unique across hosts and restarts: host, pid and start time."""
    return f"{socket.gethostname()[:60]}:{os.getpid()}:{int(time.time())}"


class LivePublisher:
    def __init__(
        self, source: LiveSource, sessionmaker: async_sessionmaker[AsyncSession],
        interval_s: float, keep_s: float, max_requests: int, process: str | None = None,
    ) -> None:
        self.source = source
        self.sessionmaker = sessionmaker
        self.interval_s = interval_s
        self.keep_s = keep_s  # snapshots older than this are stale (their process stopped)
        self.max_requests = max_requests
        self.process = process or process_id()
        self.published = 0
        self.failures = 0
        self._failing = False

    async def take(self) -> list[InFlight]:
        """The source's snapshot, bounded: the `max_requests` oldest requests."""
        requests = await self.source()
        if len(requests) > self.max_requests:
            requests = sorted(requests, key=lambda r: r.age_s, reverse=True)[
                : self.max_requests]
        return requests

    async def publish(self) -> bool:
        """One publication; False (logged, counted) when the source or database failed."""
        try:
            requests = await self.take()
            at = datetime.now(UTC)  # wall clock, as the requests' started_at
            async with self.sessionmaker() as session:
                await put_snapshot(session, self.process, at, requests,
                                   stale_before=at - timedelta(seconds=self.keep_s))
        except Exception as exc:
            self.failures += 1
            if not self._failing:
                log.warning("publishing the live snapshot failed (%s: %s); diagnosis goes on "
                            "from finished requests", type(exc).__name__, str(exc)[:200])
            self._failing = True
            return False
        if self._failing:
            log.info("publishing the live snapshot works again")
        self._failing = False
        self.published += 1
        return True

    async def run(self) -> None:
        """Publish every `interval_s` until cancelled; then withdraw this process's row."""
        try:
            while True:
                await self.publish()
                await asyncio.sleep(self.interval_s)
        finally:
            try:
                async with self.sessionmaker() as session:
                    await asyncio.wait_for(drop_snapshot(session, self.process), timeout=5)
            except Exception as exc:  # shutting down: the row goes stale and is swept
                log.debug("withdrawing the live snapshot failed (%s)", exc)
