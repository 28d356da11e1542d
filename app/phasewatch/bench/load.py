"""How requests are sent: a closed loop of N streams, or an open loop on a fixed schedule.

Closed loop: `concurrency` workers, each sending its next request as soon as its last one ended,
until `requests` have been sent (the article's experiments: one at a time, or N together).
Open loop: each request is sent at its scheduled offset whatever the server does, so a slow
server gets more streams in flight instead of slower arrivals (closed-loop load hides queueing).
Poisson schedules are seeded: the same seed gives the same draws at every rate, scaled by
1/rate, so steps of a rate sweep differ only in their rate.

Clock: `time.monotonic_ns()` (the client's). Every request carries an `x-request-id` made of
the batch's prefix and its index, and the run id header when there is one, so a phasewatch in
between stores records that can be matched back to each request. Nothing here aggregates.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from time import monotonic_ns
from typing import Any

import aiohttp

from phasewatch.bench.client import RequestResult, stream_request
from phasewatch.bench.workload import REQUEST_ID_HEADER, RUN_ID_HEADER, admin_headers


@dataclass(slots=True)
class Batch:
    """One batch of requests: results in send order, and its span on the client's clock."""

    results: list[RequestResult] = field(default_factory=list)
    start_ns: int = 0  # the first send
    end_ns: int = 0  # the last response's end
    lateness_ns: list[int] = field(default_factory=list)  # open loop: send time - scheduled time

    @property
    def span_s(self) -> float:
        return max(0, self.end_ns - self.start_ns) / 1e9


@dataclass(slots=True)
class Sender:
    """Sends one kind of request: the same body to one URL, each with its own request id."""

    session: aiohttp.ClientSession
    url: str
    body: dict[str, Any]
    run_id: str | None = None
    id_prefix: str = "bench"
    trace: Callable[[int, bytes], None] | None = None
    sent: int = 0

    async def send(self) -> RequestResult:
        headers = {REQUEST_ID_HEADER: f"{self.id_prefix}-{self.sent}"}
        if self.run_id:
            headers[RUN_ID_HEADER] = self.run_id
            headers.update(admin_headers())
        self.sent += 1
        return await stream_request(self.session, self.url, self.body, headers, self.trace)


def _finish(batch: Batch, start_ns: int) -> Batch:
    batch.start_ns = min((r.sent_ns for r in batch.results), default=start_ns)
    batch.end_ns = max((r.ended_ns for r in batch.results), default=batch.start_ns)
    return batch


async def closed_loop(sender: Sender, concurrency: int, requests: int) -> Batch:
    """`concurrency` streams at once, each sending back to back, `requests` in all."""
    start = monotonic_ns()
    remaining = requests
    results: list[RequestResult] = []

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            results.append(await sender.send())

    await asyncio.gather(*(worker() for _ in range(min(concurrency, requests))))
    results.sort(key=lambda r: r.sent_ns)
    return _finish(Batch(results), start)


async def open_loop(sender: Sender, offsets_s: Sequence[float]) -> Batch:
    """Send one request at each offset (wall seconds from now), then wait for all of them."""
    loop = asyncio.get_running_loop()
    batch = Batch()
    tasks: list[asyncio.Task[RequestResult]] = []
    start = loop.time()
    start_ns = monotonic_ns()
    for offset in offsets_s:
        delay = start + offset - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        batch.lateness_ns.append(max(0, int((loop.time() - start - offset) * 1e9)))
        tasks.append(loop.create_task(sender.send()))
    batch.results = list(await asyncio.gather(*tasks))
    return _finish(batch, start_ns)


def poisson_offsets(rate: float, count: int, seed: int) -> list[float]:
    """`count` arrival offsets (seconds) of a Poisson process at `rate` per second."""
    rng = random.Random(seed)
    offsets: list[float] = []
    t = 0.0
    for _ in range(count):
        t += rng.expovariate(1.0) / rate
        offsets.append(t)
    return offsets


def poisson_schedule(rate: float, duration_s: float, seed: int) -> list[float]:
    """Arrival offsets in seconds of a Poisson process at `rate`, cut at `duration_s`."""
    rng = random.Random(seed)
    arrivals: list[float] = []
    t = rng.expovariate(rate)
    while t < duration_s:
        arrivals.append(t)
        t += rng.expovariate(rate)
    return arrivals
