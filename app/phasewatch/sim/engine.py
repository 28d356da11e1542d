"""The async driver: advances the model clock step by step and hands out tokens when due.

The pure `Scheduler` says what a step does and how long it lasts; this module is the only
place that knows about time. The model clock runs `time_scale` times slower than the wall
clock (`ModelClock`); a step that lasts d model seconds takes d x time_scale wall seconds.

Clocks, all model seconds since the clock's anchor unless named otherwise:
- arrival: the API handler received the request (vLLM's frontend arrival; TTFT starts here);
- queued: it entered the scheduler's waiting queue, `request_overhead_s` after arrival;
- scheduled: start of the first step that ran it (queue time = scheduled - queued);
- token due times: end of the step that produced each token.
Steps run back to back while there is work: a step starts when the previous one is due to end,
not when the loop got round to it, so Python's own delays do not accumulate into the model.
How late the loop delivers against the model is measured and reported (`lateness`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from phasewatch.sim.metrics import SimMetrics
from phasewatch.sim.scheduler import Scheduler, Step

log = logging.getLogger("phasewatch.sim")

# The last stretch before a step is due is waited out by yielding to the loop rather than by a
# timer: event-loop timers (uvloop's especially) are only millisecond-accurate.
_SPIN_S = 0.0015


class ModelClock:
    def __init__(self, time_scale: float) -> None:
        self.time_scale = time_scale
        self.anchor_ns = time.perf_counter_ns()  # wall time of model time 0

    def now(self) -> float:
        return (time.perf_counter_ns() - self.anchor_ns) / 1e9 / self.time_scale

    def wall_ns(self, model_t: float) -> int:
        """The perf_counter_ns() reading at which model time `model_t` falls."""
        return self.anchor_ns + round(model_t * self.time_scale * 1e9)

    async def sleep_until(self, model_t: float) -> None:
        target = self.wall_ns(model_t)
        while True:
            remaining = (target - time.perf_counter_ns()) / 1e9
            if remaining <= 0:
                return
            await asyncio.sleep(remaining - _SPIN_S if remaining > 2 * _SPIN_S else 0)

    async def sleep(self, model_s: float) -> None:
        """Sleep for a model duration where precision does not matter (frontend costs, stalls)."""
        await asyncio.sleep(model_s * self.time_scale)


@dataclass(frozen=True, slots=True)
class TokenEvent:
    index: int
    due: float  # model seconds
    finished: bool


class EngineStopped(Exception):
    """The engine shut down before the request finished."""


@dataclass(slots=True, eq=False)
class SimRequest:
    """One request's life in the engine, and the queue its tokens arrive on."""

    request_id: str
    prompt_len: int
    max_output: int
    finish_reason: str  # for the last token: "length" at max_tokens, "stop" at a drawn EOS
    seed: int
    arrival: float
    queued: float | None = None
    scheduled: float | None = None
    finished_at: float | None = None
    token_due: list[float] = field(default_factory=list)
    emitted_ns: list[tuple[int, int]] = field(default_factory=list)  # (perf_counter_ns, tokens)
    num_preemptions: int = 0
    aborted: bool = False
    events: asyncio.Queue[TokenEvent | None] = field(default_factory=asyncio.Queue)

    def timeline(self, clock: ModelClock) -> dict[str, Any]:
        """The request's model times, and the wall times they map to on this machine."""
        return {
            "id": self.request_id,
            "prompt_tokens": self.prompt_len,
            "completion_tokens": len(self.token_due),
            "time_scale": clock.time_scale,
            "arrival_s": self.arrival,
            "queued_s": self.queued,
            "scheduled_s": self.scheduled,
            "finished_s": self.finished_at,
            "num_preemptions": self.num_preemptions,
            "aborted": self.aborted,
            "token_due_s": self.token_due,
            "token_due_wall_ns": [clock.wall_ns(t) for t in self.token_due],
            "emitted": [{"wall_ns": ns, "tokens": n} for ns, n in self.emitted_ns],
        }


@dataclass(slots=True)
class Lateness:
    """How far behind the model the loop delivered tokens (model seconds)."""

    steps: int = 0
    late_steps: int = 0  # delivered more than 1 ms (model) after due
    max_s: float = 0.0
    total_s: float = 0.0

    def record(self, late_s: float) -> None:
        self.steps += 1
        if late_s > 0:
            self.total_s += late_s
            self.max_s = max(self.max_s, late_s)
            if late_s > 0.001:
                self.late_steps += 1


class Engine:
    def __init__(
        self,
        scheduler: Scheduler,
        clock: ModelClock,
        metrics: SimMetrics,
        request_overhead_s: float,
        timeline_capacity: int,
    ) -> None:
        self.scheduler = scheduler
        self.clock = clock
        self.metrics = metrics
        self.request_overhead_s = request_overhead_s
        self.lateness = Lateness()
        self.num_steps = 0
        self._capacity = timeline_capacity
        self._live: dict[str, SimRequest] = {}
        self._inbox: deque[SimRequest] = deque()  # submitted, not yet in the scheduler
        self._done: OrderedDict[str, SimRequest] = OrderedDict()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="sim-engine")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for request in list(self._live.values()):
            request.events.put_nowait(None)

    # -- requests ------------------------------------------------------------------------------

    def submit(self, request: SimRequest) -> None:
        """Hand a request to the engine; it joins the scheduler once its frontend cost is paid.

        The frontend cost is modelled, not waited for here: the request is queued at model time
        arrival + request_overhead_s and the step loop admits it at the first step boundary at
        or after that time, exactly as the offline replay does.
        """
        request.queued = request.arrival + self.request_overhead_s
        self._live[request.request_id] = request
        self._inbox.append(request)
        self._wake.set()

    def abort(self, request_id: str) -> None:
        """The client went away (or a fault ended the stream): free the request's slot."""
        request = self._live.pop(request_id, None)
        if request is None:
            return
        request.aborted = True
        if self.scheduler.abort(request_id):
            self._update_gauges()
        self._retire(request)

    def lookup(self, request_id: str) -> SimRequest | None:
        return self._live.get(request_id) or self._done.get(request_id)

    def state(self) -> dict[str, Any]:
        return {
            "model_time_s": self.clock.now(),
            "time_scale": self.clock.time_scale,
            "clock_anchor_ns": self.clock.anchor_ns,
            "num_steps": self.num_steps,
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "kv_cache_usage": self.scheduler.kv_usage,
            "num_preemptions": self.scheduler.num_preemptions,
            "lateness": {
                "steps": self.lateness.steps,
                "late_steps_over_1ms": self.lateness.late_steps,
                "max_ms": self.lateness.max_s * 1e3,
                "mean_ms": self.lateness.total_s / max(1, self.lateness.steps) * 1e3,
            },
        }

    # -- the step loop -------------------------------------------------------------------------

    async def _run(self) -> None:
        prev_end = 0.0
        inbox = self._inbox
        while True:
            while inbox and inbox[0].aborted:
                inbox.popleft()
            if not self.scheduler.has_work():
                if not inbox:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                head = inbox[0].queued or 0.0
                if self.clock.now() < head:
                    # Idle until the next request reaches the queue; later arrivals queue later.
                    await self.clock.sleep_until(head)
                    continue
                start = max(prev_end, head)
            elif self.scheduler.num_running:
                start = prev_end  # back to back with the step that just ended
            else:
                start = max(prev_end, self.clock.now())
            # Admit what had reached the queue by the time this step starts, in arrival order.
            while inbox and (inbox[0].queued or 0.0) <= start:
                request = inbox.popleft()
                if not request.aborted:
                    self.scheduler.add(request.request_id, request.prompt_len, request.max_output)
            step = self.scheduler.step()
            if step is None:
                continue
            end = start + step.duration_s
            self._begin(step, start)
            await self.clock.sleep_until(end)
            self.lateness.record(self.clock.now() - end)
            self._deliver(step, end)
            self._update_gauges()
            prev_end = end

    def _begin(self, step: Step, start: float) -> None:
        self.num_steps += 1
        for request_id in step.first_scheduled:
            request = self._live.get(request_id)
            if request is not None and request.queued is not None:
                request.scheduled = start
                self.metrics.queue_time.observe(start - request.queued)
        for request_id in step.preempted:
            request = self._live.get(request_id)
            if request is not None:
                request.num_preemptions += 1
        if step.preempted:
            self.metrics.preemptions.inc(len(step.preempted))
        self._update_gauges()

    def _update_gauges(self) -> None:
        self.metrics.running.set(self.scheduler.num_running)
        self.metrics.waiting.set(self.scheduler.num_waiting + len(self._inbox))
        self.metrics.kv_usage.set(self.scheduler.kv_usage)

    def _deliver(self, step: Step, end: float) -> None:
        metrics = self.metrics
        for token in step.tokens:
            request = self._live.get(token.request_id)
            if request is None:
                continue  # aborted while the step ran
            if request.token_due:
                metrics.itl.observe(end - request.token_due[-1])
            else:
                metrics.ttft.observe(end - request.arrival)
                metrics.prompt_tokens.inc(request.prompt_len)
            request.token_due.append(end)
            metrics.generation_tokens.inc()
            request.events.put_nowait(TokenEvent(token.index, end, token.finished))
            if token.finished:
                request.finished_at = end
                e2e = end - request.arrival
                metrics.e2e.observe(e2e)
                n = len(request.token_due)
                if n > 1:
                    metrics.tpot.observe((end - request.token_due[0]) / (n - 1))
                del self._live[request.request_id]
                self._retire(request)

    def _retire(self, request: SimRequest) -> None:
        self._done[request.request_id] = request
        while len(self._done) > self._capacity:
            self._done.popitem(last=False)
