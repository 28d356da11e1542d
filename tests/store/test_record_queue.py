"""The record queue's batch wait (`RecordQueue.fill`): the writer wakes once per batch, when
the batch is full or the flush interval has passed, never once per record."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime

from phasewatch.core.records import Outcome, RecordQueue, RequestRecord


def _record(i: int) -> RequestRecord:
    return RequestRecord(request_id=f"r{i}", started_at=datetime.now(UTC), endpoint="completions",
                         model="m", upstream="u", stream=True, outcome=Outcome.OK,
                         http_status=200, in_flight_at_arrival=0)


def test_fill_returns_as_the_batch_fills_not_at_the_interval() -> None:
    async def main() -> float:
        queue = RecordQueue(100, lambda: None)
        waiter = asyncio.create_task(queue.fill(3, 60.0))
        for i in range(2):
            queue.offer(_record(i))
            await asyncio.sleep(0)
            assert not waiter.done()  # two of three: still waiting
        start = time.monotonic()
        queue.offer(_record(2))
        await asyncio.wait_for(waiter, 10)  # woken by the third offer, not the 60 s interval
        return time.monotonic() - start

    assert asyncio.run(main()) < 10


def test_fill_returns_at_the_interval_with_a_partial_batch() -> None:
    async def main() -> tuple[float, int]:
        queue = RecordQueue(100, lambda: None)
        queue.offer(_record(0))
        start = time.monotonic()
        await queue.fill(5, 0.05)
        return time.monotonic() - start, queue.qsize()

    waited, queued = asyncio.run(main())
    assert waited >= 0.05
    assert queued == 1


def test_fill_does_not_wait_for_what_is_already_there() -> None:
    async def main() -> None:
        queue = RecordQueue(100, lambda: None)
        for i in range(4):
            queue.offer(_record(i))
        await asyncio.wait_for(queue.fill(3, 60.0), 10)
        await asyncio.wait_for(queue.fill(1, 0.0), 10)

    asyncio.run(main())


def test_a_cancelled_fill_leaves_no_waiter_behind() -> None:
    async def main() -> None:
        queue = RecordQueue(100, lambda: None)
        waiter = asyncio.create_task(queue.fill(2, 60.0))
        await asyncio.sleep(0)
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        assert queue.offer(_record(0)) and queue.offer(_record(1))  # no resolved-future error
        await asyncio.wait_for(queue.fill(2, 60.0), 10)

    asyncio.run(main())
