"""Run the scheduler and cost model without a clock: a discrete-event replay of a workload.

It follows the engine's timing rules exactly (a request queues `request_overhead_s` after it
arrives, steps run back to back, an idle engine starts when the next request is queued, tokens
are due at the end of their step) but computes the times instead of waiting for them. Sweeps
over prompt length and concurrency take milliseconds this way; tests and docs use it.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from phasewatch.sim.config import ResolvedConfig, scheduler_for


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


def simulate(config: ResolvedConfig, arrivals: Iterable[Arrival]) -> dict[str, Trace]:
    scheduler = scheduler_for(config)
    overhead = config.request_overhead_s
    pending = sorted(arrivals, key=lambda a: a.at_s)
    traces = {a.request_id: Trace(a.at_s, a.at_s + overhead) for a in pending}
    now = 0.0
    index = 0
    while index < len(pending) or scheduler.has_work():
        while index < len(pending) and traces[pending[index].request_id].queued <= now:
            a = pending[index]
            scheduler.add(a.request_id, a.prompt_len, a.max_output)
            index += 1
        if not scheduler.has_work():
            now = traces[pending[index].request_id].queued
            continue
        step = scheduler.step()
        if step is None:
            raise RuntimeError("the scheduler has work it can never run (KV cache too small?)")
        end = now + step.duration_s
        for request_id in step.first_scheduled:
            traces[request_id].scheduled = now
        for request_id in step.preempted:
            traces[request_id].num_preemptions += 1
        for token in step.tokens:
            traces[token.request_id].token_times.append(end)
        now = end
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
