"""The upstream idle timeout: one periodic check over every open exchange.

Rather than a timer re-armed on every read (aiohttp's `sock_read` cancels and creates one per
chunk, a measurable share of the per-chunk cost), each exchange keeps the time of its last
read and this watchdog looks at all of them every `min(1 s, idle / 4)`. A silent exchange is
ended between `idle` and `idle + period` after its last read.
"""

from __future__ import annotations

import asyncio
from time import perf_counter_ns
from typing import Protocol


class Watched(Protocol):
    last_read_ns: int  # perf_counter_ns() of the upstream's last read (or the request's arrival)

    def idle_timeout(self) -> None: ...


class IdleWatchdog:
    def __init__(self, idle_s: float) -> None:
        self.idle_ns = int(idle_s * 1e9)
        self.period_s = min(1.0, idle_s / 4)
        self._open: set[Watched] = set()

    def watch(self, exchange: Watched) -> None:
        self._open.add(exchange)

    def forget(self, exchange: Watched) -> None:
        self._open.discard(exchange)

    def check(self, now_ns: int) -> int:
        """End every exchange silent for longer than the idle timeout; return how many."""
        stalled = [e for e in self._open if now_ns - e.last_read_ns > self.idle_ns]
        for exchange in stalled:
            self._open.discard(exchange)
            exchange.idle_timeout()
        return len(stalled)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            self.check(perf_counter_ns())
