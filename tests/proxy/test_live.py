"""The live view: TTFT and ITL observed while streams run, live gauges, and the snapshot.

A real proxy under uvicorn in front of the scripted upstream; every wait is on a condition
(polled with a deadline), never a fixed sleep.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
from collections.abc import Callable
from time import perf_counter_ns
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client import CollectorRegistry

from phasewatch.core.live import InFlight
from phasewatch.core.log_throttle import LogThrottle
from phasewatch.proxy.live import REPLAY_S, SLICE, LiveGauges, LiveStreams, LiveView, live_counts
from tests.conftest import Proxy
from tests.support.served import parse_metrics, total, wait_for

LABELS = {"model": "scripted", "endpoint": "chat.completions"}
NS = 1_000_000_000


def stream_in_thread(proxy: Proxy, script: dict[str, Any]) -> threading.Thread:
    def run() -> None:
        with httpx.stream("POST", proxy.url + "/v1/chat/completions", timeout=20,
                          json={"model": "scripted", "stream": True,
                                "messages": [{"role": "user", "content": "x"}]},
                          headers={"x-script": orjson.dumps(script).decode()}) as response:
            for _ in response.iter_bytes():
                pass

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def on_loop(proxy: Proxy, fn: Callable[[], Any]) -> Any:
    """Run `fn` on the proxy's event loop (the live registry is not thread-safe)."""
    async def call() -> Any:
        result = fn()
        return await result if inspect.isawaitable(result) else result
    assert proxy.server.loop is not None
    return asyncio.run_coroutine_threadsafe(call(), proxy.server.loop).result(5)


def live(proxy: Proxy) -> LiveStreams:
    registry: LiveStreams = proxy.server.app.api.state.proxy.live
    return registry


def test_ttft_and_itl_are_observed_while_the_stream_runs(proxy: Proxy) -> None:
    # First token at 50 ms, the second at 100 ms, then nothing until 3 s.
    thread = stream_in_thread(proxy, {"tokens": [[0.05, "a", 1], [0.1, "b", 1], [3.0, "c", 1]]})
    # As a scrape sees it: before each render the streams the native leg holds are replayed.
    wait_for(lambda: total(parse_metrics(httpx.get(proxy.url + "/metrics").text),
                           "phasewatch_inter_token_latency_seconds_count", **LABELS) == 1)
    assert thread.is_alive()  # the stream is still open: observed as it happened
    assert proxy.sample("phasewatch_time_to_first_token_seconds_count", LABELS) == 1
    assert proxy.sample("phasewatch_request_time_per_output_token_seconds_count", LABELS) == 0
    thread.join()
    record = proxy.next_record()
    assert record.itl_count == 2 == proxy.sample(
        "phasewatch_inter_token_latency_seconds_count", LABELS)
    itl_sum = proxy.sample("phasewatch_inter_token_latency_seconds_sum", LABELS)
    assert abs(itl_sum - record.itl_mean_s * record.itl_count) < 1e-9  # metrics = record
    assert proxy.sample("phasewatch_time_to_first_token_seconds_sum", LABELS) == record.ttft_s


def test_live_gauges_show_waiting_decoding_and_stalled_streams(
    make_proxy: Callable[..., Proxy], scripted_url: str
) -> None:
    proxy = make_proxy(scripted_url, stall_threshold_s=0.3, upstream_idle_timeout_s=2.0)
    model = {"model": "scripted"}
    # One stream is served first so the model has its own label, not `other`.
    stream_in_thread(proxy, {"tokens": [[0.01, "a", 1]]}).join()
    proxy.next_record()
    waiting = stream_in_thread(proxy, {"tokens": [[1.5, "a", 1]]})  # waits 1.5 s
    stalled = stream_in_thread(proxy, {"tokens": [[0.05, "a", 1], [1.5, "b", 1]]})

    def gauge(name: str) -> float:  # as a scrape reads it: the render sets the gauges
        return total(parse_metrics(httpx.get(proxy.url + "/metrics").text), name, **model)

    wait_for(lambda: gauge("phasewatch_streams_stalled") == 1
             and gauge("phasewatch_oldest_waiting_seconds") >= 0.3)
    assert gauge("phasewatch_streams_waiting") == 1
    assert gauge("phasewatch_streams_decoding") == 1
    snapshot: list[InFlight] = on_loop(proxy, lambda: live(proxy).snapshot())
    assert [s.waiting for s in snapshot] == [True, False]  # waiting ones first
    first, second = snapshot
    assert first.ttft_s is None and first.age_s >= 0.3 and first.model == "scripted"
    assert second.ttft_s is not None and second.silent_s >= 0.3 and second.itl_count == 0
    assert InFlight.from_dict(orjson.loads(orjson.dumps(first.as_dict()))) == first
    waiting.join()
    stalled.join()
    wait_for(lambda: gauge("phasewatch_streams_waiting") == 0
             and gauge("phasewatch_streams_decoding") == 0)
    assert gauge("phasewatch_streams_stalled") == 0
    assert gauge("phasewatch_oldest_waiting_seconds") == 0


class FakeExchange:
    def __init__(self, model: str, arrival_ns: int, first_token_ns: int | None,
                 last_read_ns: int, stream: bool = True) -> None:
        self.view = LiveView(model, arrival_ns, first_token_ns) if stream else None
        self.last_read_ns = last_read_ns
        self.client_blocked_ns = 0
        self.timed_out = False
        self.ended = ""
        self.refreshed = 0  # passes that brought it up to date
        self.replay_every: list[int] = []  # each refresh's `every_ns`

    def refresh(self, now_ns: int, every_ns: int) -> None:
        self.refreshed += 1
        self.replay_every.append(every_ns)

    def idle_timeout(self) -> None:
        self.timed_out = True

    def shut_down(self) -> None:
        self.ended = "shut down"

    def client_stalled(self) -> None:
        self.ended = "client stalled"

    def live_view(self) -> LiveView | None:
        return self.view

    def in_flight(self, now_ns: int, wall_now: float) -> InFlight:
        assert self.view is not None
        age = (now_ns - self.view.arrival_ns) / NS
        ttft = None if self.view.first_token_ns is None else (
            (self.view.first_token_ns - self.view.arrival_ns) / NS)
        return InFlight(self.view.model, wall_now - age, age, ttft,
                        (now_ns - self.last_read_ns) / NS, 0, None, None, None, 0)


def test_live_counts_per_model() -> None:
    now = 100 * NS
    views = [
        (LiveView("a", 90 * NS, None), 90 * NS),  # waiting 10 s
        (LiveView("a", 97 * NS, None), 97 * NS),  # waiting 3 s
        (LiveView("a", 50 * NS, 60 * NS), 99 * NS),  # decoding, read 1 s ago
        (LiveView("b", 50 * NS, 60 * NS), 80 * NS),  # decoding, silent 20 s: stalled
    ]
    counts = live_counts(views, now, stall_ns=5 * NS)
    assert (counts["a"].waiting, counts["a"].decoding, counts["a"].stalled) == (2, 1, 0)
    assert counts["a"].oldest_waiting_s == 10.0
    assert (counts["b"].waiting, counts["b"].decoding, counts["b"].stalled) == (0, 1, 1)
    assert counts["b"].oldest_waiting_s == 0.0


def test_registry_times_out_silent_exchanges_and_bounds_the_snapshot() -> None:
    registry = LiveStreams(idle_s=10.0, stall_s=5.0, snapshot_limit=2)
    silent = FakeExchange("a", 0, 1 * NS, last_read_ns=1 * NS)
    fresh = [FakeExchange("a", i * NS, None, last_read_ns=i * NS) for i in (20, 21, 22)]
    plain = FakeExchange("a", 0, None, last_read_ns=25 * NS, stream=False)
    for exchange in (silent, *fresh, plain):
        registry.watch(exchange)
    assert registry.check(25 * NS) == 1 and silent.timed_out  # silent for 24 s > 10 s
    assert not any(e.timed_out for e in (*fresh, plain))
    snapshot = asyncio.run(registry.snapshot(25 * NS))
    assert [s.age_s for s in snapshot] == [5.0, 4.0]  # the two oldest waiting, not a third


def test_registry_ends_an_exchange_whose_client_stopped_reading() -> None:
    registry = LiveStreams(idle_s=600.0, stall_s=5.0, client_stall_s=60.0)
    reading, blocked = (FakeExchange("a", 0, NS, last_read_ns=NS) for _ in range(2))
    blocked.client_blocked_ns = 10 * NS  # its client has taken nothing since 10 s
    registry.watch(reading)
    registry.watch(blocked)
    assert registry.check(65 * NS) == 0  # 55 s: within the client stall timeout
    assert registry.check(71 * NS) == 1
    assert blocked.ended == "client stalled" and reading.ended == "" and len(registry) == 1


def test_a_pass_replays_a_native_log_only_when_due_a_snapshot_and_a_scrape_always() -> None:
    """Every pass brings every stream's clocks up to date; its timing (the native leg's replay)
    only once REPLAY_S have gone by since its last; a snapshot and a full refresh (before each
    render of /metrics) replay every stream they read."""
    async def main() -> None:
        registry = LiveStreams(idle_s=600.0, stall_s=5.0)
        exchanges = [FakeExchange("a", i * NS, None, last_read_ns=i * NS) for i in range(3)]
        for exchange in exchanges:
            registry.watch(exchange)
            registry.hold(exchange)
        await registry.refresh()
        assert all(e.replay_every == [int(REPLAY_S * NS)] for e in exchanges)
        await registry.refresh(full=True)
        await registry.snapshot(10 * NS)
        assert all(e.replay_every == [int(REPLAY_S * NS), 0, 0] for e in exchanges)

    asyncio.run(main())


class BrokenExchange(FakeExchange):
    """An open stream whose catching up always fails (a fault in its replay, say)."""

    def refresh(self, now_ns: int, every_ns: int) -> None:
        super().refresh(now_ns, every_ns)
        raise RuntimeError("replay failed")


def test_a_stream_that_cannot_be_brought_up_to_date_stops_no_other_streams_timeout() -> None:
    """The passes go on past an open stream whose refresh raises, and past a failed pass: a
    silent stream beside it is still ended by the idle timeout, and the snapshot still holds
    every other stream."""
    async def main() -> None:
        registry = LiveStreams(idle_s=0.2, stall_s=5.0)
        later = perf_counter_ns() + 3600 * NS  # read "later": never silent here
        broken = BrokenExchange("a", 0, None, last_read_ns=later)
        reading = FakeExchange("b", 0, 1, last_read_ns=later)
        silent = FakeExchange("c", 0, 1, last_read_ns=0)
        ended = asyncio.Event()
        silent.idle_timeout = ended.set  # type: ignore[method-assign]
        for exchange in (broken, reading, silent):
            registry.watch(exchange)
            registry.hold(exchange)
        task = asyncio.create_task(registry.run())
        try:
            await asyncio.wait_for(ended.wait(), timeout=10)
            assert broken.refreshed >= 1 and reading.refreshed >= 1 and not task.done()
            snapshot = await registry.snapshot()
            assert [s.model for s in snapshot] == ["b"]  # the broken one left out
        finally:
            task.cancel()

    asyncio.run(main())


def test_a_stream_that_keeps_failing_is_logged_once_per_interval_not_on_every_pass(
        caplog: pytest.LogCaptureFixture) -> None:
    """A refresh that fails on every pass logs its traceback once, then nothing more within
    `FAULT_LOG_INTERVAL_S`, while the passes go on."""
    async def main() -> None:
        registry = LiveStreams(idle_s=0.2, stall_s=5.0)  # a pass every 50 ms
        passes = asyncio.Event()

        class Counted(BrokenExchange):
            def refresh(self, now_ns: int, every_ns: int) -> None:
                if self.refreshed >= 4:
                    passes.set()
                super().refresh(now_ns, every_ns)

        broken = Counted("a", 0, None, last_read_ns=perf_counter_ns() + 3600 * NS)
        registry.watch(broken)
        registry.hold(broken)
        task = asyncio.create_task(registry.run())
        try:
            await asyncio.wait_for(passes.wait(), timeout=10)
        finally:
            task.cancel()

    with caplog.at_level("ERROR", logger="phasewatch.proxy.live"):
        asyncio.run(main())
    logged = [r for r in caplog.records if "could not bring an open stream up to date" in
              r.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info is not None


def test_a_throttled_fault_is_logged_first_then_once_per_interval_with_the_unlogged_count(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    monkeypatch.setattr("phasewatch.core.log_throttle.time.monotonic", lambda: clock[0])
    throttle = LogThrottle(60.0)
    assert throttle.occurred() == 0  # the first: at once
    assert [throttle.occurred() for _ in range(3)] == [None, None, None]
    clock[0] += 59.9
    assert throttle.occurred() is None
    clock[0] += 0.1
    assert throttle.occurred() == 4  # four went unlogged since the first
    assert throttle.occurred() is None and throttle.count == 7

    logger = logging.getLogger("test.throttle")
    records: list[logging.LogRecord] = []
    logger.addHandler(handler := logging.Handler())
    handler.emit = records.append  # type: ignore[method-assign]
    try:
        raise RuntimeError("still failing")
    except RuntimeError:
        throttle.exception(logger, "could not do %s", "it")  # within the interval: not logged
        clock[0] += 60.0
        throttle.exception(logger, "could not do %s", "it")
    assert [r.getMessage() for r in records] == ["could not do it (and 2 more since the last "
                                                 "logged)"]
    assert records[0].exc_info is not None and records[0].levelno == logging.ERROR


def test_a_pass_and_a_snapshot_give_the_event_loop_its_turn_between_slices() -> None:
    """With more open streams than a slice, the per-stream work of a pass (the native leg's
    replay) and of a snapshot is interleaved with the loop's other work, and still covers
    every stream once, in the snapshot's order."""
    async def main() -> None:
        registry = LiveStreams(idle_s=600.0, stall_s=5.0, snapshot_limit=10 * SLICE)
        exchanges = [FakeExchange("a", i * NS, None, last_read_ns=i * NS)
                     for i in range(2 * SLICE + 1)]
        for exchange in exchanges:
            registry.watch(exchange)
            registry.hold(exchange)
        seen: list[int] = []  # streams refreshed, each time another task ran meanwhile

        async def other() -> None:
            while True:
                seen.append(sum(e.refreshed for e in exchanges))
                await asyncio.sleep(0)

        task = asyncio.create_task(other())
        await asyncio.sleep(0)
        await registry.refresh()
        assert [e.refreshed for e in exchanges] == [1] * len(exchanges)
        assert SLICE in seen and 2 * SLICE in seen
        runs = len(seen)
        snapshot = await registry.snapshot(1000 * NS)
        assert len(seen) - runs >= 2  # it ran twice while the three slices were taken
        task.cancel()
        assert [s.age_s for s in snapshot] == [1000.0 - i for i in range(len(exchanges))]

    asyncio.run(main())


@pytest.mark.parametrize("each_pass", [False, True])
def test_the_gauges_are_set_on_each_pass_under_several_workers_else_at_each_render(
        each_pass: bool) -> None:
    """Another worker's scrape reads this worker's gauges from its file, so under several
    workers every pass sets them; in one process the render of /metrics does, as it starts."""
    registry = CollectorRegistry()
    live = LiveStreams(idle_s=600.0, stall_s=5.0, gauges=LiveGauges(registry),
                       gauges_each_pass=each_pass)
    now = 100 * NS
    live.watch(FakeExchange("a", 90 * NS, None, last_read_ns=90 * NS))
    live.watch(FakeExchange("a", 50 * NS, 60 * NS, last_read_ns=99 * NS))
    assert live.check(now) == 0

    def gauge(name: str) -> float | None:
        return registry.get_sample_value(name, {"model": "a"})

    assert gauge("phasewatch_streams_waiting") == (1 if each_pass else None)
    asyncio.run(live.before_render())
    assert gauge("phasewatch_streams_waiting") == 1
    assert gauge("phasewatch_streams_decoding") == 1
