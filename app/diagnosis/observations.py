"""What the diagnosis reads: one `Observation` per proxied request, grouped in `Sample`s.

Plain frozen dataclasses built by the shell from stored records. Times are seconds on one wall
clock shared by every observation (the shell uses POSIX timestamps of the proxy's arrival
time); durations are the proxy's own measurements (`perf_counter` intervals). Nothing here
reads a clock or a database.

`EngineSignals` is what the diagnosis reads from the engine's own metrics over the window, when
the engine exposes them (`app.engine.window.EngineWindow` has this shape); every figure may be
missing, since metric names differ across vLLM versions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
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
    thinned count). `span_s` is the span's length, for request rates.
    """

    observations: Sequence[Observation]
    span_s: float
    requests: int

    @property
    def rate_rps(self) -> float:
        return self.requests / self.span_s if self.span_s > 0 else 0.0


class EngineSignals(Protocol):
    """The engine's view of the window, from scrapes of its /metrics (see app/engine)."""

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
