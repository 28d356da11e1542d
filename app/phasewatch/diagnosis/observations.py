"""What the diagnosis reads: one `Observation` per proxied request, grouped in `Sample`s.

Plain frozen dataclasses built by the shell from stored records. Times are seconds on one wall
clock shared by every observation (the shell uses POSIX timestamps of the proxy's arrival
time); durations are the proxy's own measurements (`perf_counter` intervals). Nothing here
reads a clock or a database.

`EngineSignals` is what the diagnosis reads from the engine's own metrics over the window, when
the engine exposes them (`phasewatch.engine.window.EngineWindow` has this shape); every figure
may be missing, since metric names differ across vLLM versions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from phasewatch.core.live import InFlight


class Stage(StrEnum):
    """Where a request was when observed."""

    FINISHED = "finished"
    WAITING = "waiting"  # in flight, no first token yet
    DECODING = "decoding"  # in flight, first token received


# Not frozen, because a round builds thousands and a frozen dataclass's constructor costs about
# six times a plain one's; invariant: nothing changes one after it is built.
@dataclass(slots=True)
class Observation:
    """One request as the proxy recorded it."""

    started_s: float  # arrival at the proxy, wall-clock seconds (the same clock for all)
    ok: bool  # outcome "ok"
    ttft_s: float | None  # arrival -> first output-carrying event; None if none came
    e2e_s: float | None  # arrival -> last read of the response
    itl_count: int  # token gaps measured
    itl_p50_s: float | None  # this request's median token gap
    itl_max_s: float | None  # this request's longest token gap
    prompt_tokens: int | None  # from the upstream's usage
    in_flight: int  # other requests in flight at the proxy when this one arrived
    # FINISHED: a stored record. WAITING / DECODING: still in flight in a live snapshot, so
    # e2e_s is None; while WAITING, ttft_s is its age, a lower bound (censored).
    stage: Stage = Stage.FINISHED

    @property
    def first_token_s(self) -> float | None:
        """Wall-clock time of the first token (the end of this request's prefill)."""
        return None if self.ttft_s is None else self.started_s + self.ttft_s

    @property
    def ended_s(self) -> float | None:
        return None if self.e2e_s is None else self.started_s + self.e2e_s


@dataclass(frozen=True, slots=True)
class Sample:
    """The requests of one span (the window, or the baseline).

    `requests` counts every request of the span; `observations` may be an even thinning of
    them when the span held more than the shell reads (rates use `requests`, never the
    thinned count). `span_s` is the span of it that had traffic (`traffic_span_s`), for
    request rates. `in_flight`: requests still open at the span's end, from live snapshots
    (the window only; app/phasewatch/diagnosis/live_view.py).
    """

    observations: Sequence[Observation]
    span_s: float
    requests: int
    in_flight: Sequence[InFlight] = ()

    @property
    def rate_rps(self) -> float:
        return self.requests / self.span_s if self.span_s > 0 else 0.0


def traffic_span_s(nominal_s: float, first_s: float | None, until_s: float,
                   requests: int) -> float:
    """The part of a span [until - nominal, until] that had traffic, for its request rate:
    from the first arrival in it to its end, widened by one mean gap (n arrivals from the first
    mark n - 1 gaps), never longer than the span. A span reaching back before the proxy (or the
    traffic) started would otherwise count that time as idle and read a low rate: a steady
    load then looks like a rise for the whole first baseline after a start."""
    if first_s is None or requests < 2:
        return nominal_s
    covered = max(0.0, until_s - first_s)
    return min(nominal_s, covered * requests / (requests - 1))


class EngineSignals(Protocol):
    """The engine's view of the window, from scrapes of its /metrics (see app/phasewatch/engine)."""

    @property
    def scrapes(self) -> int: ...  # scrapes that fell in the window
    @property
    def waiting_mean(self) -> float | None: ...  # requests waiting for a slot
    @property
    def waiting_max(self) -> float | None: ...
    @property
    def running_mean(self) -> float | None: ...  # requests in the running batch
    @property
    def running_max(self) -> float | None: ...
    @property
    def kv_usage_mean(self) -> float | None: ...  # KV cache in use, 0-1
    @property
    def kv_usage_max(self) -> float | None: ...
    @property
    def preemptions(self) -> float | None: ...  # preemptions during the window
    @property
    def ttft_count(self) -> float | None: ...  # first tokens the engine observed
    @property
    def ttft_mean_s(self) -> float | None: ...  # exact, from the histogram's sum and count
    @property
    def ttft_p50_s(self) -> float | None: ...  # interpolated within the histogram's buckets
    @property
    def ttft_p95_s(self) -> float | None: ...
    @property
    def queue_time_mean_s(self) -> float | None: ...  # engine's waiting-phase time per request
    @property
    def metric_names(self) -> Mapping[str, str]: ...  # signal -> the metric name that had it
