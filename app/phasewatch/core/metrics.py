"""The proxy's Prometheus metrics, built on an injected registry.

Names follow vLLM's (`vllm:time_to_first_token_seconds` -> `phasewatch_time_to_first_token_seconds`)
so vLLM users find them where they expect. Label children are bound once per (model, endpoint)
and reused, because `.labels()` costs more than the observation itself.

Bucket lists: vLLM's own stop at 10 ms for ITL and have no 2 s edge for TTFT. Ours cover
sub-millisecond to minutes, and always contain the configured SLO thresholds as exact edges,
because a latency SLI is `bucket{le="T"} / count` and needs an edge at exactly T.

Under several workers (app/phasewatch/core/exposition.py) counters and histograms are summed over
them; each gauge says how with its `multiprocess_mode` (ignored with one process).
"""

from __future__ import annotations

import time
from array import array
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.samples import Exemplar as SampledExemplar
from prometheus_client.values import MutexValue

# An exemplar's labels.
Exemplar = dict[str, str]


class Observe(Protocol):
    """A histogram child's `observe(value, exemplar=None)`."""

    def __call__(self, amount: float, exemplar: Exemplar | None = None, /) -> None: ...


# Observations made together: (bucket index, how many fell in it) for the buckets they fell
# in, their sum, and (bucket index, value) for each bucket whose exemplar one of them sets.
ObserveCounts = Callable[[list[tuple[int, int]], float, list[tuple[int, float]],
                          Exemplar | None], None]


# TTFT spans an idle prefill (milliseconds) to a deep queue (minutes).
TTFT_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5,
    2.0, 2.5, 3.0, 4.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0,
)
# ITL and TPOT: a decode step on a fast GPU is a few ms; 20-30 tokens/s per user reads as
# comfortable (33-50 ms); a stall from a long unchunked prefill can reach seconds.
ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.05, 0.06,
    0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
)
E2E_BUCKETS = (
    0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0,
    2400.0,
)
# Time a request spends inside the proxy before it is sent upstream: sub-millisecond when the
# proxy keeps up, tens of milliseconds when its event loop is saturated.
PROXY_QUEUE_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
)
# Powers of two, from one token to a long-context prompt.
TOKEN_BUCKETS = tuple(float(2**i) for i in range(0, 18))


# OpenMetrics allows 128 characters of exemplar labels, names included: a request id longer
# than this (a client's own x-request-id can be) gets no exemplar rather than a cut one.
EXEMPLAR_MAX_ID = 64


def request_exemplar(request_id: str, trace_id: str | None) -> Exemplar | None:
    """The exemplar a request's TTFT and ITL observations carry: its id (what
    `/api/requests?request_id=` finds), and its trace id when OpenTelemetry traces it."""
    if len(request_id) > EXEMPLAR_MAX_ID:
        return None
    if trace_id is None:
        return {"request_id": request_id}
    return {"request_id": request_id, "trace_id": trace_id}


def with_edges(buckets: tuple[float, ...], *edges: float) -> tuple[float, ...]:
    """`buckets` plus each of `edges` as an exact bucket boundary, sorted."""
    return tuple(sorted(set(buckets) | set(edges)))


class LoopValue:
    """prometheus_client's `MutexValue` without its lock, for a series that one thread alone
    writes: the relay's, all written on the event loop's thread. The lock costs more than the
    addition it guards (two C calls and a dozen bytecodes for each of the twenty or so
    increments of a request), and guards nothing there: no other thread writes, and a read
    (a scrape's render, in a worker thread) sees the whole float before or after an increment."""

    __slots__ = ("_exemplar", "_value")
    _multiprocess = False

    def __init__(self, value: float = 0.0, exemplar: SampledExemplar | None = None) -> None:
        self._value = value
        self._exemplar = exemplar

    def inc(self, amount: float) -> None:
        self._value += amount

    def set(self, value: float, timestamp: float | None = None) -> None:
        self._value = value

    def set_exemplar(self, exemplar: SampledExemplar) -> None:
        self._exemplar = exemplar

    def get(self) -> float:
        return self._value

    def get_exemplar(self) -> SampledExemplar | None:
        return self._exemplar


def loop_owned(metric: Histogram | Counter | Gauge) -> None:
    """Give a metric without labels, or a labelled child, `LoopValue`s in place of its
    `MutexValue`s (with what they hold). Under several workers its values are the multiprocess
    files' (`MmapedValue`) and stay so. The attributes are prometheus_client's own, not its
    public API: `tests/proxy/test_metrics.py` renders a metric both ways and compares."""
    def own(value: object) -> object:
        if type(value) is not MutexValue:
            return value
        return LoopValue(value._value, value._exemplar)

    if isinstance(metric, Histogram):
        metric._sum = own(metric._sum)
        metric._buckets = [own(bucket) for bucket in metric._buckets]
    else:
        metric._value = own(metric._value)


def fast_observe(child: Histogram) -> Observe:
    """`child.observe`, for the observations the relay makes per token and per request.

    prometheus_client's `Histogram.observe` checks the child is observable and then walks its
    bounds one by one to the first that holds the value: at a typical ITL that is a dozen
    iterations of interpreted code per token; with an exemplar it also validates the
    exemplar's labels. This finds the same bucket by bisection (for any number but NaN, which
    a gap between two clock readings or a token count never is), increments the same values
    (in-process or, under several workers, the multiprocess files) and sets the same exemplar
    on the bucket, so scrapes read exactly what `observe` would have left. `child` is a
    labelled child (`.labels(...)`), which is always observable. Exemplars are not validated
    again: phasewatch's own (`request_exemplar`) fit OpenMetrics' 128 characters by
    construction. The attributes read here are prometheus_client's own, not its public API:
    `tests/proxy/test_metrics.py` holds the two equal, so an upgrade that changes them fails
    there, not in production.
    """
    bounds, increments, add_to_sum = _parts(child)
    set_exemplar = [bucket.set_exemplar for bucket in child._buckets]

    def observe(amount: float, exemplar: Exemplar | None = None) -> None:
        add_to_sum(amount)
        index = bisect_left(bounds, amount)
        increments[index](1)
        if exemplar:
            set_exemplar[index](SampledExemplar(exemplar, amount, time.time()))

    return observe


def fast_observe_counts(child: Histogram) -> ObserveCounts:
    """Observations made together (the native leg's replay, timing.py), counted per bucket by
    the caller against `child._upper_bounds`: each bucket and the sum are incremented once,
    and each exemplar set once, leaving what as many `observe` calls leave, the sum to within
    rounding in its last bits (it adds their total) and the exemplars' times within the call."""
    _, increments, add_to_sum = _parts(child)
    set_exemplar = [bucket.set_exemplar for bucket in child._buckets]

    def observe_counts(counts: list[tuple[int, int]], total: float,
                       marked: list[tuple[int, float]], exemplar: Exemplar | None) -> None:
        for index, count in counts:
            increments[index](count)
        add_to_sum(total)
        if exemplar and marked:
            now = time.time()
            for index, amount in marked:
                set_exemplar[index](SampledExemplar(exemplar, amount, now))

    return observe_counts


def _parts(child: Histogram) -> tuple[list[float], list[Callable[[float], None]],
                                      Callable[[float], None]]:
    """A labelled histogram child's bounds, its buckets' and its sum's increments (the
    relay's: the loop's alone, `loop_owned`)."""
    loop_owned(child)
    return (list(child._upper_bounds), [bucket.inc for bucket in child._buckets],
            child._sum.inc)


@dataclass(slots=True, frozen=True)
class BoundMetrics:
    """Label children for one (model, endpoint), bound once."""

    observe_ttft: Observe  # each histogram's child, observed by fast_observe
    observe_itl: Observe
    observe_itl_counts: ObserveCounts  # the ITL's child, by fast_observe_counts
    itl_bounds: array[float]  # its buckets' upper bounds, for the counts
    observe_tpot: Observe
    observe_prompt_tokens: Observe
    observe_output_tokens: Observe


@dataclass(slots=True, frozen=True)
class EndedMetrics:
    """Label children for one (model, endpoint, outcome), bound once."""

    observe_e2e: Observe
    count_request: Callable[[], None]


class ProxyMetrics:
    def __init__(self, registry: CollectorRegistry, slo_ttft_s: float, slo_itl_s: float) -> None:
        labels = ("model", "endpoint")
        self.ttft_buckets = with_edges(TTFT_BUCKETS, slo_ttft_s)
        self.itl_buckets = with_edges(ITL_BUCKETS, slo_itl_s)
        self.ttft = Histogram(
            "phasewatch_time_to_first_token_seconds",
            "Arrival at the proxy to the first output-carrying chunk, as the client sees it.",
            labels, registry=registry, buckets=self.ttft_buckets,
        )
        self.itl = Histogram(
            "phasewatch_inter_token_latency_seconds",
            "Gap between output tokens as relayed; one observation per token.",
            labels, registry=registry, buckets=self.itl_buckets,
        )
        self.tpot = Histogram(
            "phasewatch_request_time_per_output_token_seconds",
            "(E2E - TTFT) / (output tokens - 1), one observation per request.",
            labels, registry=registry, buckets=self.itl_buckets,
        )
        self.e2e = Histogram(
            "phasewatch_e2e_request_latency_seconds",
            "Arrival at the proxy to the end of the response.",
            (*labels, "outcome"), registry=registry, buckets=E2E_BUCKETS,
        )
        self.prompt_tokens = Histogram(
            "phasewatch_request_prompt_tokens",
            "Prompt tokens per request, from the upstream's usage.",
            labels, registry=registry, buckets=TOKEN_BUCKETS,
        )
        self.output_tokens = Histogram(
            "phasewatch_request_generation_tokens",
            "Output tokens per request, from the upstream's usage.",
            labels, registry=registry, buckets=TOKEN_BUCKETS,
        )
        self.requests = Counter(
            "phasewatch_requests",
            "Finished requests by how they ended.",
            (*labels, "outcome"), registry=registry,
        )
        self.proxy_queue = Histogram(
            "phasewatch_proxy_queue_seconds",
            "Arrival (the request's first bytes read from the client) to the relay starting to "
            "send it upstream: time spent inside phasewatch before the engine is asked; part of "
            "TTFT.",
            registry=registry, buckets=PROXY_QUEUE_BUCKETS,
        )
        self.in_flight = Gauge(
            "phasewatch_requests_in_flight",
            "Inference requests received and not yet finished.",
            registry=registry, multiprocess_mode="livesum",  # over the workers alive
        )
        self.native_streams = Counter(
            "phasewatch_native_relay_streams",
            "Handoffs of a stream's running token chunks to the native relay (a stream may be "
            "handed off again after an event it gives back).",
            registry=registry,
        )
        self.native_failures = Counter(
            "phasewatch_native_relay_failures",
            "Failures of the native relay's thread: each time, every stream it held went on in "
            "Python, and the process relays every stream in Python from then on.",
            registry=registry,
        )
        self.records_dropped = Counter(
            "phasewatch_records_dropped",
            "Request records dropped because the record queue was full.",
            registry=registry,
        )
        self.records_written = Counter(
            "phasewatch_records_written",
            "Request records stored in the database.",
            registry=registry,
        )
        self.records_rejected = Counter(
            "phasewatch_records_rejected",
            "Request records the database refused (invalid data); the rest of their batch is kept.",
            registry=registry,
        )
        self.record_write_failures = Counter(
            "phasewatch_record_write_failures",
            "Failed attempts to store a batch of records (the batch is retried).",
            registry=registry,
        )
        self.record_queue_depth = Gauge(
            "phasewatch_record_queue_depth",
            "Request records waiting to be stored.",
            registry=registry, multiprocess_mode="livesum",
        )
        self._bound: dict[tuple[str, str], BoundMetrics] = {}
        self._ended: dict[tuple[str, str, str], EndedMetrics] = {}
        self.observe_proxy_queue = fast_observe(self.proxy_queue)
        loop_owned(self.in_flight)
        loop_owned(self.native_streams)
        loop_owned(self.native_failures)
        # Set by each record queued and each batch stored, both on the event loop.
        loop_owned(self.record_queue_depth)

    def bind(self, model: str, endpoint: str) -> BoundMetrics:
        key = (model, endpoint)
        bound = self._bound.get(key)
        if bound is None:
            itl = self.itl.labels(model, endpoint)
            bound = BoundMetrics(
                observe_ttft=fast_observe(self.ttft.labels(model, endpoint)),
                observe_itl=fast_observe(itl),
                observe_itl_counts=fast_observe_counts(itl),
                itl_bounds=array("d", itl._upper_bounds),
                observe_tpot=fast_observe(self.tpot.labels(model, endpoint)),
                observe_prompt_tokens=fast_observe(self.prompt_tokens.labels(model, endpoint)),
                observe_output_tokens=fast_observe(self.output_tokens.labels(model, endpoint)),
            )
            self._bound[key] = bound
        return bound

    def ended(self, model: str, endpoint: str, outcome: str) -> EndedMetrics:
        """The children a request's ending is counted in. Bounded like the labels themselves:
        models by `ModelLabels`, endpoints and outcomes are fixed sets."""
        key = (model, endpoint, outcome)
        ended = self._ended.get(key)
        if ended is None:
            requests = self.requests.labels(model, endpoint, outcome)
            loop_owned(requests)
            ended = EndedMetrics(
                observe_e2e=fast_observe(self.e2e.labels(model, endpoint, outcome)),
                count_request=requests.inc,
            )
            self._ended[key] = ended
        return ended
