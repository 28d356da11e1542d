"""The record of one proxied request, and the bounded queue that carries it off the hot path.

Shared by the relay (which fills records) and the store (which writes them), so it lives in core.

The relay finishes a record in its `finally` and hands it over with `put_nowait`: it never
waits. When the queue is full the record is dropped and counted; whoever stores records
(a background writer) drains the queue at its own pace.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum

log = logging.getLogger(__name__)


class Outcome(StrEnum):
    OK = "ok"
    HTTP_ERROR = "http_error"  # the upstream answered with a non-2xx status
    STREAM_ERROR = "stream_error"  # an error inside a 200 stream, or the stream broke off
    UNREACHABLE = "unreachable"  # no connection to the upstream (502 to the client)
    TIMEOUT = "timeout"  # the upstream went silent past the idle timeout (504 / broken stream)
    CANCELLED = "cancelled"  # the client went away first; the upstream request was closed
    REJECTED = "rejected"  # phasewatch refused it (body over the limit); never sent upstream
    SHUTDOWN = "shutdown"  # phasewatch shut down before it ended (its grace ran out)
    INTERNAL_ERROR = "internal_error"  # phasewatch's own relay failed mid-stream (native.py)


@dataclass(slots=True)
class RequestRecord:
    request_id: str
    started_at: datetime  # wall clock (UTC) at arrival, for storage; intervals use perf_counter
    endpoint: str  # "completions" or "chat.completions"
    model: str | None
    upstream: str
    stream: bool
    outcome: Outcome
    http_status: int | None
    in_flight_at_arrival: int  # other requests in flight when this one arrived
    ttft_s: float | None = None
    e2e_s: float | None = None
    tpot_s: float | None = None
    itl_count: int = 0
    itl_mean_s: float | None = None
    itl_p50_s: float | None = None
    itl_p95_s: float | None = None
    itl_max_s: float | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    tokens_exact: bool = True
    run_id: str | None = None
    error: str | None = None  # a short reason; never prompt or completion text


class RecordQueue:
    """A bounded FIFO of finished records. `offer` never blocks; overflow is dropped and counted.

    Its depth is every record not yet stored: those queued and those the writer has taken and
    not yet stored (it calls `release` once a batch is stored or refused). `on_depth` hears
    each change, so the gauge is live even while the writer waits on a database that hangs.
    """

    def __init__(self, maxsize: int, on_drop: Callable[[], None],
                 on_depth: Callable[[int], None] | None = None) -> None:
        self._queue: asyncio.Queue[RequestRecord] = asyncio.Queue(maxsize)
        self._on_drop = on_drop
        self._on_depth = on_depth
        self._held = 0  # taken by the writer, not yet stored
        self.dropped = 0
        # `fill`'s waiter: resolved by `offer` once that many records are queued.
        self._filling: tuple[int, asyncio.Future[None]] | None = None

    @property
    def depth(self) -> int:
        return self._queue.qsize() + self._held

    def offer(self, record: RequestRecord) -> bool:
        try:
            self._queue.put_nowait(record)
        except asyncio.QueueFull:
            self.dropped += 1
            self._on_drop()
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.warning("record queue full: %d records dropped so far", self.dropped)
            return False
        if self._on_depth is not None:
            self._on_depth(self.depth)
        filling = self._filling
        if filling is not None and self._queue.qsize() >= filling[0] \
                and not filling[1].done():
            filling[1].set_result(None)
        return True

    async def fill(self, size: int, timeout_s: float) -> None:
        """Wait until `size` records are queued or `timeout_s` has passed, whichever is first:
        one wake-up per batch, not one per record."""
        if self._queue.qsize() >= size or timeout_s <= 0:
            return
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        timer = loop.call_later(timeout_s, _resolve, waiter)
        self._filling = (size, waiter)
        try:
            await waiter
        finally:
            self._filling = None
            timer.cancel()

    def release(self, stored: int) -> None:
        """The writer is done with `stored` records it took (stored, or refused for good)."""
        self._held = max(0, self._held - stored)
        if self._on_depth is not None:
            self._on_depth(self.depth)

    async def get(self) -> RequestRecord:
        record = await self._queue.get()
        self._held += 1
        return record

    def get_nowait(self) -> RequestRecord:
        record = self._queue.get_nowait()
        self._held += 1
        return record

    def qsize(self) -> int:
        return self._queue.qsize()


def _resolve(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
