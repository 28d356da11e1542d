"""A small OTLP/HTTP receiver for tests: what an OpenTelemetry Collector would receive.

It listens on loopback, accepts `POST /v1/metrics` and `POST /v1/traces` (protobuf, gzip or
not), decodes them with the `opentelemetry-proto` package (the protocol's own generated
classes) and keeps every request. `wait(...)` blocks on a condition until an export makes it
true. No Collector binary can be had on these machines; this checks the same wire format.
"""

from __future__ import annotations

import gzip
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.metrics.v1.metrics_pb2 import Metric
from opentelemetry.proto.trace.v1.trace_pb2 import Span


def value_of(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    return None if kind is None else getattr(value, kind)


def attributes(pairs: Iterator[KeyValue] | Any) -> dict[str, Any]:
    return {pair.key: value_of(pair.value) for pair in pairs}


@dataclass
class Received:
    metrics: list[ExportMetricsServiceRequest] = field(default_factory=list)
    traces: list[ExportTraceServiceRequest] = field(default_factory=list)
    content_types: set[str] = field(default_factory=set)

    def last_metrics(self) -> dict[str, tuple[Metric, dict[str, Any]]]:
        """Each metric of the latest export that had it, with its resource's attributes
        (cumulative temporality: the latest holds the totals)."""
        found: dict[str, tuple[Metric, dict[str, Any]]] = {}
        for request in self.metrics:
            for resource in request.resource_metrics:
                for scope in resource.scope_metrics:
                    for metric in scope.metrics:
                        found[metric.name] = (metric, attributes(resource.resource.attributes))
        return found

    def spans(self) -> list[tuple[Span, dict[str, Any]]]:
        """Every span received, with its resource's attributes."""
        return [(span, attributes(resource.resource.attributes))
                for request in self.traces for resource in request.resource_spans
                for scope in resource.scope_spans for span in scope.spans]


class OtlpReceiver:
    def __init__(self) -> None:
        self.received = Received()
        self._changed = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                reply: bytes
                with receiver._changed:
                    receiver.received.content_types.add(self.headers.get("content-type", ""))
                    if self.path == "/v1/metrics":
                        receiver.received.metrics.append(
                            ExportMetricsServiceRequest.FromString(body))
                        reply = ExportMetricsServiceResponse().SerializeToString()
                    elif self.path == "/v1/traces":
                        receiver.received.traces.append(ExportTraceServiceRequest.FromString(body))
                        reply = ExportTraceServiceResponse().SerializeToString()
                    else:
                        self.send_error(404)
                        return
                    receiver._changed.notify_all()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *_: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def wait(self, condition: Callable[[Received], bool], timeout: float = 30.0,
             says: str = "export") -> Received:
        """Block until `condition(received)` holds after some export (or fail)."""
        with self._changed:
            if not self._changed.wait_for(lambda: condition(self.received), timeout):
                raise AssertionError(f"{says}: not received within {timeout} s")
            return self.received
