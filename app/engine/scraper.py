"""The background task that scrapes the engine's /metrics and keeps recent snapshots.

One GET every `interval_s`, with its own small aiohttp session (never the relay's connection
pool) and a timeout. The text is parsed in a worker thread, so a large /metrics page does not
hold the event loop that relays streams. Snapshots are kept in memory, stamped with the wall
clock at which the response arrived (the clock of the stored requests' `started_at`), for
`keep_s` seconds: long enough for a window and its baseline. A failed scrape is counted and
logged once per outage; it never raises out of the task.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

import aiohttp

from app.engine.metrics import EngineScrapeMetrics
from app.engine.parser import EngineSnapshot, parse_engine_metrics
from app.engine.window import EngineWindow, summarize

log = logging.getLogger(__name__)


class EngineScraper:
    def __init__(
        self, url: str, interval_s: float, timeout_s: float, keep_s: float,
        metrics: EngineScrapeMetrics | None = None,
    ) -> None:
        self.url = url
        self.interval_s = interval_s
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.keep_s = keep_s
        self.metrics = metrics
        self.history: deque[tuple[float, EngineSnapshot]] = deque()
        self.up = False
        self._failing = False

    async def run(self) -> None:
        """Scrape until cancelled."""
        connector = aiohttp.TCPConnector(limit=1)
        async with aiohttp.ClientSession(connector=connector, timeout=self.timeout) as session:
            while True:
                try:
                    await self.scrape(session)
                except Exception as exc:  # a bug here must not end the task
                    log.exception("engine scrape failed unexpectedly")
                    self._failed(exc)
                await asyncio.sleep(self.interval_s)

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
            return None
        self.history.append((at, snapshot))
        while self.history and self.history[0][0] < at - self.keep_s:
            self.history.popleft()
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

    def window(self, since_s: float, until_s: float, model: str | None) -> EngineWindow | None:
        """The engine's figures over [since_s, until_s] (wall-clock seconds) for `model`."""
        return summarize(list(self.history), since_s, until_s, model)
