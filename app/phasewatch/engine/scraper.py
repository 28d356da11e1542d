"""The background task that scrapes the engine's /metrics and stores what diagnosis reads of it.

One GET every `interval_s`, and one more whenever the diagnosis schedule asks (`fresh`: each round
judges the engine as it is at the round, not as it was up to `interval_s` before), with its own
small aiohttp session (never the relay's connection pool) and a timeout. The text is parsed in a
worker thread, so a large /metrics page does not hold the event loop that relays streams. Each
scrape is stored (app/phasewatch/store/engine_scrapes.py), stamped with the wall clock at which the
response arrived (the clock of the stored requests' `started_at`), and kept `keep_s` seconds: long
enough for a window and its baseline. A failed scrape is stored as such, counted, and logged once
per outage; nothing raises out of the task.

It runs in the leading process only (app/phasewatch/store/leader.py), beside the schedule that asks
it: one scraper for the whole deployment, and every worker and replica reads the same stored
scrapes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from datetime import UTC, datetime, timedelta

import aiohttp
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from phasewatch.engine.codec import snapshot_to_json
from phasewatch.engine.metrics import EngineScrapeMetrics
from phasewatch.engine.parser import EngineSnapshot, parse_engine_metrics
from phasewatch.store.engine_scrapes import add_scrape

log = logging.getLogger(__name__)


class EngineScraper:
    def __init__(
        self, url: str, interval_s: float, timeout_s: float, keep_s: float,
        sessionmaker: async_sessionmaker[AsyncSession],
        metrics: EngineScrapeMetrics | None = None,
    ) -> None:
        self.url = url
        self.interval_s = interval_s
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.keep_s = keep_s
        self.sessionmaker = sessionmaker
        self.metrics = metrics
        self.up = False
        self._failing = False
        # `fresh` sets _wake; the loop sets and replaces _stored after each scrape it stores.
        # Both exist only while `run` does (None: nobody scrapes, `fresh` returns at once).
        self._wake: asyncio.Event | None = None
        self._stored: asyncio.Event | None = None

    async def run(self) -> None:
        """Scrape until cancelled; `up` goes back to 0 when this process stops scraping."""
        connector = aiohttp.TCPConnector(limit=1)
        self._wake, self._stored = asyncio.Event(), asyncio.Event()
        try:
            async with aiohttp.ClientSession(connector=connector,
                                             timeout=self.timeout) as session:
                while True:
                    try:
                        await self.scrape(session)
                    except Exception as exc:  # a bug here must not end the task
                        log.exception("engine scrape failed unexpectedly")
                        self._failed(exc)
                    # A request for a scrape made while this one ran is answered by it.
                    self._wake.clear()
                    self._stored.set()
                    self._stored = asyncio.Event()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), self.interval_s)
        finally:
            self._wake = self._stored = None
            self.up = False
            if self.metrics is not None:
                self.metrics.up.set(0)

    async def fresh(self) -> None:
        """Return once a scrape that ended after this call began is stored (failed or not), or
        after the scrape timeout; at once when no scrape loop runs in this process."""
        if self._wake is None or self._stored is None:
            return
        stored = self._stored
        self._wake.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stored.wait(), (self.timeout.total or 5.0) + 1.0)

    async def scrape(self, session: aiohttp.ClientSession) -> EngineSnapshot | None:
        try:
            async with session.get(self.url) as response:
                if response.status != 200:
                    raise ValueError(f"status {response.status}")
                text = await response.text(errors="replace")
            at = time.time()  # wall clock, as the requests' started_at
            snapshot = await asyncio.to_thread(parse_engine_metrics, text)
        except (aiohttp.ClientError, TimeoutError, ValueError, UnicodeError) as exc:
            self._failed(exc)
            await self._store(time.time(), None)
            return None
        await self._store(at, snapshot)
        if self._failing:
            log.info("engine metrics at %s answer again", self.url)
        self._failing = False
        self.up = True
        if self.metrics is not None:
            self.metrics.up.set(1)
        return snapshot

    def _failed(self, exc: Exception) -> None:
        self.up = False
        if self.metrics is not None:
            self.metrics.up.set(0)
            self.metrics.failures.inc()
        if not self._failing:
            log.warning("cannot scrape engine metrics at %s (%s: %s); diagnosis goes on from "
                        "the proxy's records", self.url, type(exc).__name__, str(exc)[:200])
        self._failing = True

    async def _store(self, at_s: float, snapshot: EngineSnapshot | None) -> None:
        """Store one scrape; a database fault is logged and the scrape is lost (the next one
        is stored when the database answers again)."""
        at = datetime.fromtimestamp(at_s, UTC)
        data = None if snapshot is None else snapshot_to_json(snapshot)
        try:
            async with self.sessionmaker() as session:
                await add_scrape(session, at, self.url, data,
                                 keep_since=at - timedelta(seconds=self.keep_s))
        except Exception as exc:
            log.warning("storing an engine scrape failed (%s: %s)", type(exc).__name__,
                        str(exc)[:200])
