"""Run the scheduler and cost model without a clock: a discrete-event replay of a workload.

It follows the engine's timing rules exactly (a request queues `request_overhead_s` after it
arrives, steps run back to back, an idle engine starts when the next request is queued, tokens
are due at the end of their step) but computes the times instead of waiting for them. Sweeps
over prompt length and concurrency take milliseconds this way; tests and docs use it, and the
planner's what-ifs (`phasewatch.plan.whatif`) drive its calibrated engine with `Clockless`.
"""

from __future__ import annotations

import heapq
import itertools
import statistics
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from phasewatch.sim.config import ResolvedConfig, scheduler_for
from phasewatch.sim.scheduler import Scheduler, Step


@dataclass(frozen=True, slots=True)
class Arrival:
    request_id: str
    at_s: float
    prompt_len: int
    max_output: int


@dataclass(slots=True)
class Trace:
    """One request's model times, seconds."""

    arrival: float
    queued: float
    scheduled: float | None = None
    token_times: list[float] = field(default_factory=list)
    num_preemptions: int = 0

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.token_times)]

    @property
    def e2e(self) -> float:
        return self.token_times[-1] - self.arrival


class Clockless:
    """A scheduler driven without a clock, by the engine's rules: a request joins the
    scheduler once it is due (its arrival plus the request overhead, which the caller adds),
    steps run back to back, and an idle engine waits for the next request due. The one
    discrete-event loop that the simulator's sweeps and the planner's what-ifs share.

    `steps()` yields each step with its start and end; requests added while it runs (a
    closed-loop user's next request) join once due, in the order they were added among those
    due at the same time.
    """

    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler
        self._due: list[tuple[float, int, str, int, int]] = []
        self._order = itertools.count()

    def add(self, due_s: float, request_id: str, prompt_len: int, max_output: int) -> None:
        heapq.heappush(self._due, (due_s, next(self._order), request_id, prompt_len, max_output))

    def steps(self) -> Iterator[tuple[float, float, Step]]:
        scheduler, due = self._scheduler, self._due
        now = 0.0
        while due or scheduler.has_work():
            while due and due[0][0] <= now:
                _, _, request_id, prompt_len, max_output = heapq.heappop(due)
                scheduler.add(request_id, prompt_len, max_output)
            if not scheduler.has_work():
                now = due[0][0]
                continue
            step = scheduler.step()
            if step is None:
                raise RuntimeError(
                    "the scheduler has work it can never run (KV cache too small?)")
            end = now + step.duration_s
            yield now, end, step
            now = end


def simulate(config: ResolvedConfig, arrivals: Iterable[Arrival]) -> dict[str, Trace]:
    engine = Clockless(scheduler_for(config))
    overhead = config.request_overhead_s
    traces: dict[str, Trace] = {}
    for a in sorted(arrivals, key=lambda a: a.at_s):
        traces[a.request_id] = Trace(a.at_s, a.at_s + overhead)
        engine.add(a.at_s + overhead, a.request_id, a.prompt_len, a.max_output)
    for start, end, step in engine.steps():
        for request_id in step.first_scheduled:
            traces[request_id].scheduled = start
        for request_id in step.preempted:
            traces[request_id].num_preemptions += 1
        for token in step.tokens:
            traces[token.request_id].token_times.append(end)
    return traces


@dataclass(frozen=True, slots=True)
class Summary:
    """Medians across requests, as the article's harness reports them (milliseconds)."""

    ttft_ms: float
    itl_ms: float
    max_itl_ms: float
    throughput_tok_s: float


def summarize(traces: Sequence[Trace]) -> Summary:
    ttfts = [t.ttft for t in traces]
    itls = [statistics.median(t.itls) for t in traces if t.itls]
    max_gap = max((max(t.itls) for t in traces if t.itls), default=0.0)
    tokens = sum(len(t.token_times) for t in traces)
    span = max(t.token_times[-1] for t in traces) - min(t.arrival for t in traces)
    return Summary(
        ttft_ms=statistics.median(ttfts) * 1e3,
        itl_ms=statistics.median(itls) * 1e3 if itls else 0.0,
        max_itl_ms=max_gap * 1e3,
        throughput_tok_s=tokens / span,
    )


def burst(concurrency: int, prompt_len: int, max_output: int, prefix: str = "r") -> list[Arrival]:
    """`concurrency` identical requests arriving together, as the article's harness sends them."""
    return [Arrival(f"{prefix}{i}", 0.0, prompt_len, max_output) for i in range(concurrency)]
