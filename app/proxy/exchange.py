"""Per-request state shared by a relay and the tasks that may cut it short, and the idle watchdog.

The upstream's idle timeout is enforced by one periodic check over all open exchanges rather
than a timer re-armed on every read (aiohttp's `sock_read` cancels and creates a timer per
chunk, a measurable share of the per-chunk cost). A stalled exchange is cancelled between
`idle` and `idle + period` after its last read.
"""

from __future__ import annotations

import asyncio
from time import perf_counter_ns


class Exchange:
    __slots__ = ("answered", "client_gone", "last_read_ns", "responded", "task", "timed_out")

    def __init__(self, task: asyncio.Task[object], now_ns: int) -> None:
        self.task = task
        self.last_read_ns = now_ns  # the last time the upstream sent anything (or the start)
        self.client_gone = False  # the client disconnected: cancelled by the disconnect watcher
        self.timed_out = False  # the upstream went silent: cancelled by the watchdog
        self.responded = False  # the response to the client is complete (or being completed)
        self.answered = False  # [DONE] was forwarded: a client leaving now cancels nothing


class IdleWatchdog:
    def __init__(self, idle_s: float) -> None:
        self.idle_ns = int(idle_s * 1e9)
        self.period_s = min(1.0, idle_s / 4)
        self._open: set[Exchange] = set()

    def watch(self, exchange: Exchange) -> None:
        self._open.add(exchange)

    def forget(self, exchange: Exchange) -> None:
        self._open.discard(exchange)

    def check(self, now_ns: int) -> int:
        """Cancel every exchange silent for longer than the idle timeout; return how many."""
        stalled = [e for e in self._open
                   if not e.responded and now_ns - e.last_read_ns > self.idle_ns]
        for exchange in stalled:
            exchange.timed_out = True
            self._open.discard(exchange)
            exchange.task.cancel()
        return len(stalled)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            self.check(perf_counter_ns())
