"""A window's engine figures from a series of timed snapshots. Pure: no clock, no I/O.

Gauges (waiting, running, KV usage) are averaged and maxed over the scrapes inside the window.
Counters and histograms are differenced from the last scrape before the window (or the first
inside it, when there is none) to the last inside it, as Prometheus' `increase()` does: a value
that went down means the engine restarted, and counting resumes from zero. Quantiles of the
TTFT histogram are interpolated linearly within a bucket, as `histogram_quantile()` does; the
mean is exact (sum / count).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from phasewatch.engine.parser import EngineSnapshot, EngineState, Histogram


@dataclass(frozen=True, slots=True)
class EngineWindow:
    """The engine over one window (the shape
    `phasewatch.diagnosis.observations.EngineSignals` reads)."""

    scrapes: int
    waiting_mean: float | None = None
    waiting_max: float | None = None
    running_mean: float | None = None
    running_max: float | None = None
    kv_usage_mean: float | None = None
    kv_usage_max: float | None = None
    preemptions: float | None = None
    ttft_count: float | None = None
    ttft_mean_s: float | None = None
    ttft_p50_s: float | None = None
    ttft_p95_s: float | None = None
    queue_time_mean_s: float | None = None
    metric_names: Mapping[str, str] = field(default_factory=dict)


def increase(values: Sequence[float]) -> float:
    """Total increase of a counter sampled in order; a drop is a reset to zero."""
    total = 0.0
    for previous, current in itertools.pairwise(values):
        total += current - previous if current >= previous else current
    return total


def histogram_increase(first: Histogram | None, last: Histogram) -> Histogram:
    """`last` minus `first`, bucket by bucket (`last` alone after a reset or with no `first`)."""
    if first is None or last.count < first.count:
        return last
    before = dict(first.buckets)
    return Histogram(
        tuple((bound, max(0.0, count - before.get(bound, 0.0))) for bound, count in last.buckets),
        last.count - first.count, last.sum - first.sum,
    )


def histogram_quantile(q: float, histogram: Histogram) -> float | None:
    """Prometheus' estimate: linear within the bucket holding rank q * count. None if empty;
    the highest finite bound when the rank falls in the +Inf bucket."""
    buckets = histogram.buckets
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            share = (rank - lower_count) / (count - lower_count)
            return lower_bound + (bound - lower_bound) * share
        lower_bound, lower_count = bound, count
    return lower_bound


def _mean_max(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    return math.fsum(values) / len(values), max(values)


def summarize(
    history: Sequence[tuple[float, EngineSnapshot]], since_s: float, until_s: float,
    model: str | None,
) -> EngineWindow | None:
    """`history` is (time, snapshot) in time order. None when no scrape in the window had the
    model."""
    inside: list[EngineState] = []
    before: EngineState | None = None
    names: dict[str, str] = {}
    for at, snapshot in history:
        state = snapshot.for_model(model)
        if state is None:
            continue
        if at < since_s:
            before = state
        elif at <= until_s:
            inside.append(state)
            names.update(snapshot.names)
    if not inside:
        return None
    series = [before, *inside] if before is not None else inside

    def gauge(values: list[float | None]) -> tuple[float | None, float | None]:
        return _mean_max([v for v in values if v is not None])

    waiting = gauge([s.waiting for s in inside])
    running = gauge([s.running for s in inside])
    kv = gauge([s.kv_usage for s in inside])
    counter = [s.preemptions for s in series if s.preemptions is not None]
    preemptions = increase(counter) if counter else None

    ttft_count = ttft_mean = ttft_p50 = ttft_p95 = None
    last = inside[-1].ttft
    if last is not None:
        first = series[0].ttft if len(series) > 1 else None
        delta = histogram_increase(first, last)
        ttft_count = delta.count
        if delta.count > 0:
            ttft_mean = delta.sum / delta.count
            ttft_p50 = histogram_quantile(0.5, delta)
            ttft_p95 = histogram_quantile(0.95, delta)
    queue_mean = None
    last_queue = inside[-1].queue_time
    if last_queue is not None:
        first_queue = series[0].queue_time if len(series) > 1 else None
        delta = histogram_increase(first_queue, last_queue)
        if delta.count > 0:
            queue_mean = delta.sum / delta.count

    return EngineWindow(
        scrapes=len(inside),
        waiting_mean=waiting[0], waiting_max=waiting[1],
        running_mean=running[0], running_max=running[1],
        kv_usage_mean=kv[0], kv_usage_max=kv[1],
        preemptions=preemptions,
        ttft_count=ttft_count, ttft_mean_s=ttft_mean, ttft_p50_s=ttft_p50, ttft_p95_s=ttft_p95,
        queue_time_mean_s=queue_mean,
        metric_names=names,
    )
