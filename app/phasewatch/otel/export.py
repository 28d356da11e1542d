"""OpenTelemetry export: the GenAI metrics and one span per relayed request, over OTLP/HTTP.

Built by the app's lifespan only when `PHASEWATCH_OTEL_ENABLED` is on; the only module of
phasewatch that imports OpenTelemetry. Configured the standard way, by the variables the SDK
and the OTLP/HTTP exporters read: OTEL_EXPORTER_OTLP_ENDPOINT (and its _METRICS_ / _TRACES_
forms), _HEADERS, _TIMEOUT, _COMPRESSION, OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES,
OTEL_METRIC_EXPORT_INTERVAL, OTEL_TRACES_SAMPLER, OTEL_PROPAGATORS, and OTEL_METRICS_EXPORTER /
OTEL_TRACES_EXPORTER=none to leave a signal out.

The providers belong to the app, never to the process (no global is set), and the app's
shutdown flushes them. Per request, while exporting: the span is started once the body is
read (its start time is the arrival) and its context replaces the client's `traceparent`
upstream, so the engine's own spans are its children; at the end the histograms are recorded
and the span ended. Nothing runs per chunk; the exporters work on their own threads.

What is exported (conventions.py names the version): the four histograms with
`gen_ai.operation.name`, `gen_ai.provider.name`, `gen_ai.request.model` (the same bounded
model label as the Prometheus metrics), `server.address`, `server.port`, and `error.type` on
a request that ended in error. Which requests each histogram counts is the same as its
Prometheus counterpart's (README, "OpenTelemetry (OTLP)").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from time import perf_counter_ns

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.propagate import get_global_textmap
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.util.types import AttributeValue
from yarl import URL

from phasewatch import __version__
from phasewatch.core.log_throttle import LogThrottle
from phasewatch.core.records import Outcome, RequestRecord
from phasewatch.otel import signals
from phasewatch.otel.conventions import OPERATIONS, SCHEMA_URL, error_type, instruments

log = logging.getLogger(__name__)

Attributes = dict[str, AttributeValue]
Headers = list[tuple[bytes, bytes]]
NS = 1_000_000_000
FIRST_TOKEN_EVENT = "gen_ai.first_token"
MAX_NAME = 128  # characters of a client's model name kept on a span


@dataclass(slots=True)
class RequestTrace:
    """One request's span, while it is relayed."""

    span: trace.Span
    wall_offset_ns: int  # time.time_ns() - perf_counter_ns() when it started
    replaces: frozenset[bytes]  # the client's headers it replaces upstream (traceparent, ...)
    upstream_headers: Headers  # the span's context, for the upstream, in their place
    trace_id: str | None  # hex, when sampled: goes into the metrics' exemplars


class OtelExport:
    """The app's meter and tracer providers, and what each request records into them."""

    def __init__(self, slo_ttft_s: float, slo_itl_s: float, provider_name: str,
                 upstream_base: str) -> None:
        export_metrics, export_traces = signals(os.environ)
        resource = Resource.create({"service.version": __version__})
        if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
            resource = resource.merge(Resource({"service.name": "phasewatch"}))
        upstream = URL(upstream_base)
        self._base: Attributes = {"gen_ai.provider.name": provider_name,
                                  "server.address": upstream.host or "",
                                  "server.port": upstream.port or 0}
        self._by_label: dict[tuple[str, str], Attributes] = {}
        self._begin_faults = LogThrottle()  # would recur per request: once a minute
        self.meter_provider: MeterProvider | None = None
        self.tracer_provider: TracerProvider | None = None
        if export_metrics:
            # shutdown_on_exit off: `shutdown()` below is the bounded one (an SDK exit hook
            # would wait for a hung collector).
            self.meter_provider = MeterProvider(
                resource=resource, shutdown_on_exit=False,
                metric_readers=[PeriodicExportingMetricReader(OTLPMetricExporter())])
            meter = self.meter_provider.get_meter("phasewatch", __version__, SCHEMA_URL)
            made = {key: meter.create_histogram(
                        spec.name, spec.unit, spec.description,
                        explicit_bucket_boundaries_advisory=spec.buckets)
                    for key, spec in instruments(slo_ttft_s, slo_itl_s).items()}
            self._ttft, self._tpot = made["ttft"], made["tpot"]
            self._duration, self._tokens = made["duration"], made["tokens"]
        if export_traces:
            self.tracer_provider = TracerProvider(resource=resource, shutdown_on_exit=False)
            self.tracer_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
            self._tracer = self.tracer_provider.get_tracer("phasewatch", __version__,
                                                           SCHEMA_URL)
            self._propagator = get_global_textmap()
            self.trace_fields = frozenset(name.encode() for name in self._propagator.fields)
        log.info("OpenTelemetry: exporting %s over OTLP/HTTP",
                 " and ".join(name for name, on in (("metrics", export_metrics),
                                                    ("traces", export_traces)) if on) or "nothing")

    # -- per request ------------------------------------------------------------------------

    def begin(self, headers: Iterable[tuple[bytes, bytes]], endpoint: str, model: str | None,
              stream: bool, arrival_ns: int) -> RequestTrace | None:
        """Start the request's span (None when traces are not exported, or when starting it
        failed: that is logged, and the request goes on untraced)."""
        if self.tracer_provider is None:
            return None
        try:
            return self._begin(headers, endpoint, model, stream, arrival_ns)
        except Exception:
            self._begin_faults.exception(
                log, "could not start a span; the request is relayed untraced")
            return None

    def _begin(self, headers: Iterable[tuple[bytes, bytes]], endpoint: str, model: str | None,
               stream: bool, arrival_ns: int) -> RequestTrace:
        fields = self.trace_fields
        carrier = {name.decode("latin-1"): value.decode("latin-1")
                   for name, value in headers if name in fields}
        parent = self._propagator.extract(carrier)
        wall_offset_ns = time.time_ns() - perf_counter_ns()
        operation = OPERATIONS[endpoint]
        attributes: Attributes = {**self._base, "gen_ai.operation.name": operation}
        name = operation
        if model is not None:
            attributes["gen_ai.request.model"] = model[:MAX_NAME]
            name = f"{operation} {model[:MAX_NAME]}"
        if stream:
            attributes["gen_ai.request.stream"] = True
        span = self._tracer.start_span(name, context=parent, kind=SpanKind.CLIENT,
                                       attributes=attributes,
                                       start_time=arrival_ns + wall_offset_ns)
        outgoing: dict[str, str] = {}
        self._propagator.inject(outgoing, context=trace.set_span_in_context(span))
        context = span.get_span_context()
        return RequestTrace(
            span, wall_offset_ns, fields,
            [(name.encode("latin-1"), value.encode("latin-1")) for name, value in outgoing.items()],
            trace.format_trace_id(context.trace_id) if context.trace_flags.sampled else None)

    def finish(self, request_trace: RequestTrace | None, record: RequestRecord, label: str,
               arrival_ns: int) -> None:
        """Record the request's histograms and end its span, from its finished record."""
        error = error_type(record.outcome, record.http_status)
        if self.meter_provider is not None:
            attributes = self._attributes(label, record.endpoint)
            if error is not None:
                attributes = {**attributes, "error.type": error}
            # The same requests as the Prometheus histograms: a TTFT for every stream that had
            # a first token, the rest for requests that ended well.
            if record.ttft_s is not None:
                self._ttft.record(record.ttft_s, attributes)
            if record.e2e_s is not None:
                self._duration.record(record.e2e_s, attributes)
            if record.outcome is Outcome.OK:
                if record.tpot_s is not None:
                    self._tpot.record(record.tpot_s, attributes)
                if record.prompt_tokens is not None:
                    self._tokens.record(record.prompt_tokens,
                                        {**attributes, "gen_ai.token.type": "input"})
                if record.output_tokens is not None:
                    self._tokens.record(record.output_tokens,
                                        {**attributes, "gen_ai.token.type": "output"})
        if request_trace is not None:
            _end_span(request_trace, record, arrival_ns, error)

    def _attributes(self, label: str, endpoint: str) -> Attributes:
        key = (label, endpoint)
        attributes = self._by_label.get(key)
        if attributes is None:  # as many as Prometheus label sets: bounded by ModelLabels
            attributes = {**self._base, "gen_ai.operation.name": OPERATIONS[endpoint],
                          "gen_ai.request.model": label}
            self._by_label[key] = attributes
        return attributes

    # -- shutdown ---------------------------------------------------------------------------

    async def shutdown(self, timeout_s: float) -> None:
        """Export what is left (the last metrics, the spans queued) and stop, within
        `timeout_s`; an exporter still trying after that is abandoned, with a warning."""
        loop = asyncio.get_running_loop()
        stopped: asyncio.Future[None] = loop.create_future()

        def stop() -> None:
            try:
                if self.tracer_provider is not None:
                    self.tracer_provider.shutdown()
                if self.meter_provider is not None:
                    self.meter_provider.shutdown(timeout_millis=timeout_s * 1000)
            finally:
                with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits
                    loop.call_soon_threadsafe(_resolve, stopped)

        # A daemon thread, not the loop's executor: an exporter stuck on a hung collector
        # must not hold the process at exit (the executor's threads are joined then).
        threading.Thread(target=stop, name="otel-shutdown", daemon=True).start()
        try:
            await asyncio.wait_for(asyncio.shield(stopped), timeout_s)
        except TimeoutError:
            log.warning("OpenTelemetry: the last export did not finish within %.0f s", timeout_s)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _end_span(request_trace: RequestTrace, record: RequestRecord, arrival_ns: int,
              error: str | None) -> None:
    span, offset = request_trace.span, request_trace.wall_offset_ns
    attributes: Attributes = {"phasewatch.request_id": record.request_id,
                              "phasewatch.outcome": record.outcome.value}
    if record.http_status is not None:
        attributes["http.response.status_code"] = record.http_status
    if record.model is not None:
        attributes["gen_ai.request.model"] = record.model[:MAX_NAME]
    if record.prompt_tokens is not None:
        attributes["gen_ai.usage.input_tokens"] = record.prompt_tokens
    if record.output_tokens is not None:
        attributes["gen_ai.usage.output_tokens"] = record.output_tokens
    if record.tpot_s is not None:
        attributes["gen_ai.server.time_per_output_token"] = record.tpot_s
    if error is not None:
        attributes["error.type"] = error
    span.set_attributes(attributes)
    if record.ttft_s is not None:
        span.add_event(FIRST_TOKEN_EVENT,
                       {"gen_ai.server.time_to_first_token": record.ttft_s},
                       timestamp=arrival_ns + offset + round(record.ttft_s * NS))
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, error))
    end_ns = arrival_ns + round(record.e2e_s * NS) if record.e2e_s is not None else None
    span.end(end_time=None if end_ns is None else end_ns + offset)
