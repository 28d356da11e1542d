"""What is in flight right now: the timeouts, the live gauges, and the snapshot.

Every open exchange is registered here for its life, and one pass over them runs every
`min(1 s, idle / 4, client stall / 4)`: it ends exchanges whose client has read nothing for the
client stall timeout or whose upstream has been silent past the idle timeout (one periodic
look, not a timer re-armed per read), and under several workers sets the live gauges of each
model (in one process the `/metrics` render sets them, `before_render`). `snapshot()` gives the
open streams as `InFlight` values for the diagnosis.

Invariants:
- nothing here runs per chunk: the relay only keeps each exchange's `last_read_ns`;
- a timeout fires between its limit and its limit plus one period after the last read;
- a stream the native leg holds is brought up to date (`refresh`, native.py) before a timeout
  reads its clocks, on every pass until its first token, at least every `REPLAY_S`, and in
  full before each snapshot and each `/metrics` render; the thread names the streams that need
  it (`NativeRelay.due`), so a held stream that needs nothing costs a pass no Python;
- per-stream work (a replay, a stream's figures) runs `SLICE` streams at a time, yielding to
  the event loop between slices, so a thousand open streams never hold other requests' chunks
  for the whole pass.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from time import perf_counter_ns
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, Gauge

from phasewatch.core.live import InFlight, LiveCounts
from phasewatch.core.log_throttle import LogThrottle

if TYPE_CHECKING:
    from phasewatch.proxy.native import NativeRelay
    from phasewatch.proxy.timing import StreamTiming

log = logging.getLogger(__name__)

NS = 1_000_000_000
SLICE = 64  # streams refreshed or snapshotted between two yields to the event loop (~1 ms)
REPLAY_S = 5.0  # a pass replays a native stream's log this long after its last replay


def in_flight_view(label: str, timing: StreamTiming, last_read_ns: int, at_arrival: int,
                   now_ns: int, wall_now: float) -> InFlight:
    """An open stream as the snapshot gives it (`Watched.in_flight`)."""
    ttft = None if timing.first_output_ns is None else (
        (timing.first_output_ns - timing.arrival_ns) / NS)
    age = (now_ns - timing.arrival_ns) / NS
    count, _, p50, _, largest = timing.gaps.summary()
    return InFlight(
        model=label, started_s=wall_now - age, age_s=age, ttft_s=ttft,
        silent_s=(now_ns - last_read_ns) / NS, itl_count=count, itl_p50_s=p50,
        itl_max_s=largest, prompt_tokens=timing.prompt_tokens, in_flight=at_arrival)


class Watched(Protocol):
    """An open exchange, as this registry sees it."""

    last_read_ns: int  # perf_counter_ns() of the upstream's last read (or the request's arrival)
    client_blocked_ns: int  # since when the client has not taken what is written (0: it does)

    def refresh(self, now_ns: int, every_ns: int) -> None:
        """Bring the two clocks up to date, and the timing too if its last update is `every_ns`
        or more before `now_ns` (the native leg, native.py)."""

    def idle_timeout(self) -> None: ...

    def shut_down(self) -> None: ...

    def client_stalled(self) -> None: ...

    def live_view(self) -> LiveView | None:
        """Where the stream is (None: not a stream, so not in the live gauges)."""

    def in_flight(self, now_ns: int, wall_now: float) -> InFlight:
        """The stream as a plain value for the diagnosis (`wall_now`: POSIX seconds)."""


@dataclass(slots=True)
class LiveView:
    """One open stream's live state, read on each pass."""

    model: str  # its model label
    arrival_ns: int
    first_token_ns: int | None  # None: still waiting for its first token


class LiveGauges:
    """The live gauges, per model label; summed over workers (oldest wait: the max)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.waiting = Gauge(
            "phasewatch_streams_waiting",
            "Streams waiting for their first token (queued or in prefill): the proxy's view "
            "of the engine's waiting queue.",
            ("model",), registry=registry, multiprocess_mode="livesum")
        self.decoding = Gauge(
            "phasewatch_streams_decoding",
            "Streams that have had their first token and not ended.",
            ("model",), registry=registry, multiprocess_mode="livesum")
        self.oldest_waiting = Gauge(
            "phasewatch_oldest_waiting_seconds",
            "Age of the oldest stream still waiting for its first token (0: none waits).",
            ("model",), registry=registry, multiprocess_mode="livemax")
        self.stalled = Gauge(
            "phasewatch_streams_stalled",
            "Decoding streams silent for longer than the stall threshold "
            "(PHASEWATCH_STALL_THRESHOLD_S).",
            ("model",), registry=registry, multiprocess_mode="livesum")
        self._shown: set[str] = set()

    def set(self, counts: dict[str, LiveCounts]) -> None:
        for model in self._shown - counts.keys():
            counts[model] = LiveCounts()  # its streams have ended
        for model, c in counts.items():
            self.waiting.labels(model).set(c.waiting)
            self.decoding.labels(model).set(c.decoding)
            self.oldest_waiting.labels(model).set(c.oldest_waiting_s)
            self.stalled.labels(model).set(c.stalled)
        self._shown = set(counts)


def live_counts(views: Iterable[tuple[LiveView, int]], now_ns: int,
                stall_ns: int) -> dict[str, LiveCounts]:
    """Per model, the gauges' values from (view, last read) pairs. Pure."""
    waiting: dict[str, int] = {}
    decoding: dict[str, int] = {}
    oldest: dict[str, int] = {}
    stalled: dict[str, int] = {}
    for view, last_read_ns in views:
        model = view.model
        if view.first_token_ns is None:
            waiting[model] = waiting.get(model, 0) + 1
            age = now_ns - view.arrival_ns
            if age > oldest.get(model, 0):
                oldest[model] = age
        else:
            decoding[model] = decoding.get(model, 0) + 1
            if now_ns - last_read_ns > stall_ns:
                stalled[model] = stalled.get(model, 0) + 1
    return {
        model: LiveCounts(waiting.get(model, 0), decoding.get(model, 0),
                          oldest.get(model, 0) / NS, stalled.get(model, 0))
        for model in waiting.keys() | decoding.keys()
    }


class LiveStreams:
    def __init__(self, idle_s: float, stall_s: float, gauges: LiveGauges | None = None,
                 snapshot_limit: int = 1000, client_stall_s: float = 60.0,
                 gauges_each_pass: bool = False) -> None:
        self.idle_ns = int(idle_s * NS)
        self.client_stall_ns = int(client_stall_s * NS)
        self.stall_ns = int(stall_s * NS)
        self.period_s = min(1.0, idle_s / 4, client_stall_s / 4)
        self.snapshot_limit = snapshot_limit
        self._gauges = gauges
        # Several workers: every pass sets the gauges (another worker's scrape reads them).
        self.gauges_each_pass = gauges_each_pass
        # The process's native relay (set with it): names the held streams a pass must see.
        self.native: NativeRelay | None = None
        self._open: set[Watched] = set()
        self._held: set[Watched] = set()  # those the native leg holds (`hold`)
        # A fault in a stream's refresh, its snapshot entry or a pass recurs on every pass
        # while it lasts: each kind is logged at most once a minute (log_throttle.py).
        self._refresh_faults, self._snapshot_faults, self._pass_faults = (
            LogThrottle(), LogThrottle(), LogThrottle())

    def __len__(self) -> int:
        return len(self._open)

    def watch(self, exchange: Watched) -> None:
        self._open.add(exchange)

    def forget(self, exchange: Watched) -> None:
        self._open.discard(exchange)
        self._held.discard(exchange)

    def hold(self, exchange: Watched) -> None:
        """The native leg took the exchange's stream: its clocks are the thread's now."""
        if exchange in self._open:
            self._held.add(exchange)

    def release(self, exchange: Watched) -> None:
        """The native leg gave the stream back: Python keeps its clocks again."""
        self._held.discard(exchange)

    async def refresh(self, full: bool = False) -> list[Watched]:
        """Bring the held exchanges up to date (`Watched.refresh`), a slice at a time: those
        whose timing has not been for `REPLAY_S` or whose clocks may be past a timeout (`full`:
        every one, its timing too). Return those whose clocks were read: the held streams
        the timeouts may end (`check`)."""
        if full and self.native is not None:
            # Streams handed back whose wake-up the loop has not served yet: taken now, and
            # their records finished, before the render.
            self.native.take_back()
            await asyncio.sleep(0)
        now_ns = perf_counter_ns()
        every_ns = 0 if full else int(REPLAY_S * NS)
        if full or self.native is None or self.gauges_each_pass:
            exchanges = list(self._held)
        else:
            exchanges = [e for e in self.native.due(now_ns - every_ns, now_ns - self.idle_ns,
                                                    now_ns - self.client_stall_ns)
                         if e in self._held]
        for start in range(0, len(exchanges), SLICE):
            if start:
                await asyncio.sleep(0)
            for exchange in exchanges[start:start + SLICE]:
                try:
                    exchange.refresh(now_ns, every_ns)
                except Exception:  # one exchange's fault must not stop the others' timeouts
                    self._refresh_faults.exception(
                        log, "could not bring an open stream up to date")
        return exchanges

    async def before_render(self) -> None:
        """Before a render of `/metrics` by this process: every stream's timing replayed, and
        the gauges set as of now."""
        await self.refresh(full=True)
        self.set_gauges(perf_counter_ns())

    def set_gauges(self, now_ns: int) -> None:
        if self._gauges is not None:
            self._gauges.set(self.counts(now_ns))

    def check(self, now_ns: int, refreshed: Iterable[Watched] = ()) -> int:
        """End every exchange silent past the idle timeout, or whose client has not read for
        the client stall timeout, and set the gauges if every pass does; return how many were
        ended. Reads the clocks as they are: of the held exchanges, only those `refreshed`
        (what `refresh()` returned) are up to date, and only those are looked at."""
        held = self._held
        looked = (self._open - held) | held.intersection(refreshed) if held else self._open
        silent = [e for e in looked if now_ns - e.last_read_ns > self.idle_ns]
        for exchange in silent:
            self.forget(exchange)
            exchange.idle_timeout()
        blocked = [e for e in looked
                   if e.client_blocked_ns and now_ns - e.client_blocked_ns > self.client_stall_ns
                   and e in self._open]
        for exchange in blocked:
            self.forget(exchange)
            exchange.client_stalled()
        if self.gauges_each_pass:
            self.set_gauges(now_ns)
        return len(silent) + len(blocked)

    def end_all(self) -> int:
        """End every open exchange now (shutting down, its grace over); return how many."""
        ending = list(self._open)
        self._open.clear()
        self._held.clear()
        for exchange in ending:
            exchange.shut_down()
        return len(ending)

    def counts(self, now_ns: int) -> dict[str, LiveCounts]:
        return live_counts(self._views(), now_ns, self.stall_ns)

    def _views(self) -> Iterable[tuple[LiveView, int]]:
        for exchange in self._open:
            view = exchange.live_view()
            if view is not None:
                yield view, exchange.last_read_ns

    async def snapshot(self, now_ns: int | None = None) -> list[InFlight]:
        """The open streams as plain values, at most `snapshot_limit`: those waiting for their
        first token first (the earliest sign of queueing), then the longest open. All are
        read as at `now_ns` (a stream that ends while the snapshot is taken is still in it),
        a slice at a time."""
        now_ns = perf_counter_ns() if now_ns is None else now_ns
        wall_now = time.time()
        open_streams = [(e, v) for e in self._open if (v := e.live_view()) is not None]
        open_streams.sort(key=lambda ev: (ev[1].first_token_ns is not None, ev[1].arrival_ns))
        chosen = [exchange for exchange, _ in open_streams[: self.snapshot_limit]]
        values: list[InFlight] = []
        replayed_ns = perf_counter_ns()
        for start in range(0, len(chosen), SLICE):
            if start:
                await asyncio.sleep(0)
            for exchange in chosen[start:start + SLICE]:
                try:
                    exchange.refresh(replayed_ns, 0)  # its gaps so far, for its ITL figures
                    values.append(exchange.in_flight(now_ns, wall_now))
                except Exception:  # left out; the others are still worth publishing
                    self._snapshot_faults.exception(
                        log, "could not take an open stream into the snapshot")
        return values

    async def run(self) -> None:
        """A pass every `period_s` until cancelled. A pass that fails is logged and the next
        one comes as usual: the timeouts of every open stream depend on this loop."""
        while True:
            await asyncio.sleep(self.period_s)
            try:
                refreshed = await self.refresh()
                now_ns = perf_counter_ns()
                self.check(now_ns, refreshed)
            except Exception:
                self._pass_faults.exception(log, "a pass over the open streams failed")
