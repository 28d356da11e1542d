"""OpenTelemetry on the wire: what phasewatch exports over OTLP/HTTP, decoded as a Collector would.

The proxy (under uvicorn, its app built with `PHASEWATCH_OTEL_ENABLED`) relays a mix of
requests to the scripted upstream (streams, a non-streamed answer, an upstream error, a stream
cut off) and exports to a receiver on loopback that decodes the protobuf with
opentelemetry-proto (tests/support/otlp_receiver.py). Metrics are exported with a long interval,
so the last export is the one the proxy's shutdown flushes: it must carry the GenAI names,
units, attributes and bucket edges, and counts and sums equal to the proxy's own Prometheus
histograms. Spans must continue the client's trace and be the parent the upstream is told of.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import orjson
import pytest
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from prometheus_client import CollectorRegistry

from phasewatch.core.settings import load_settings
from phasewatch.main import create_app
from phasewatch.otel.conventions import (
    DURATION_BUCKETS,
    SEMCONV_VERSION,
    TOKEN_BUCKETS,
    TPOT_BUCKETS,
    TTFT_BUCKETS,
)
from tests.support.otlp_receiver import OtlpReceiver, Received, attributes
from tests.support.served import wait_for
from tests.support.servers import ThreadServer

SLO_TTFT_S, SLO_ITL_S = 0.3, 0.033  # neither is a recommended edge: both must be added
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"


def _script(**keys: Any) -> dict[str, str]:
    return {"x-script": orjson.dumps(keys).decode()}


def _stream(url: str, path: str, body: dict[str, Any], headers: dict[str, str]) -> None:
    with httpx.stream("POST", url + path, json=body, headers=headers, timeout=30) as response:
        for _ in response.iter_bytes():
            pass


def _traffic(url: str) -> None:
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    for i in range(3):
        tokens = [[0.01 + 0.004 * k, "t", 1] for k in range(4 + i)]
        _stream(url, "/v1/chat/completions", chat,
                {**_script(tokens=tokens, prompt_tokens=5 + i), "x-request-id": f"ok-{i}"})
    _stream(url, "/v1/chat/completions", chat,
            {**_script(tokens=[[0.01, "a", 1], [0.015, "b", 1]]), "traceparent": TRACEPARENT,
             "x-request-id": "traced"})
    _stream(url, "/v1/completions", {"model": "m", "prompt": "hi", "stream": True},
            {**_script(tokens=[[0.01, "a", 1], [0.02, "b", 2]]), "x-request-id": "completion"})
    plain = httpx.post(url + "/v1/chat/completions", json={**chat, "stream": False},
                       headers={**_script(), "x-request-id": "plain"}, timeout=30)
    assert plain.status_code == 200
    failed = httpx.post(url + "/v1/chat/completions", json=chat, timeout=30,
                        headers={**_script(status=500), "x-request-id": "failed"})
    assert failed.status_code == 500
    _stream(url, "/v1/chat/completions", chat,
            {**_script(tokens=[[0.01, "a", 1], [0.2, "b", 1]], drop_at=0.05),
             "x-request-id": "cut"})


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory, scripted_url: str
             ) -> Iterator[tuple[Received, Samples]]:
    """The receiver's view after the proxy's shutdown, and the proxy's Prometheus samples
    read just before it."""
    db = tmp_path_factory.mktemp("otel") / "pw.db"
    with OtlpReceiver() as receiver, pytest.MonkeyPatch.context() as env:
        env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)
        env.setenv("OTEL_SERVICE_NAME", "pw-under-test")
        env.setenv("OTEL_METRIC_EXPORT_INTERVAL", "600000")  # only the shutdown's export
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
        registry = CollectorRegistry()
        settings = load_settings(
            upstream_url=scripted_url, database_url=f"sqlite+aiosqlite:///{db}",
            admin_open=True, otel_enabled=True, slo_ttft_s=SLO_TTFT_S, slo_itl_s=SLO_ITL_S,
            diagnosis_interval_s=0, engine_metrics_enabled=False)
        server = ThreadServer(create_app(settings, registry=registry)).start()
        try:
            _traffic(server.url)
            # Each request is finished (its metrics observed) just after its last byte.
            wait_for(lambda: _prometheus(_samples(registry), "phasewatch_requests_total") == 8,
                     timeout=10, says="8 requests finished")
            samples = _samples(registry)
        finally:
            server.stop()  # the lifespan's end flushes the last export
        received = receiver.wait(lambda r: "gen_ai.server.request.duration" in r.last_metrics()
                                 and len(r.spans()) >= 8, says="metrics and 8 spans")
        yield received, samples


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _samples(registry: CollectorRegistry) -> Samples:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in registry.collect() for s in family.samples}


def _prometheus(samples: Samples, name: str,
                where: Callable[[dict[str, str]], bool] = lambda _: True) -> float:
    return sum(value for (found, labels), value in samples.items()
               if found == name and where(dict(labels)))


def _points(received: Received, name: str) -> list[tuple[dict[str, Any], int, float]]:
    metric, _ = received.last_metrics()[name]
    return [(attributes(p.attributes), p.count, p.sum) for p in metric.histogram.data_points]


def test_metrics_carry_the_conventions_names_units_and_edges(exported: Any) -> None:
    received, _ = exported
    metrics = received.last_metrics()
    expected = {
        "gen_ai.server.time_to_first_token": ("s", sorted({*TTFT_BUCKETS, SLO_TTFT_S})),
        "gen_ai.server.time_per_output_token": ("s", sorted({*TPOT_BUCKETS, SLO_ITL_S})),
        "gen_ai.server.request.duration": ("s", list(DURATION_BUCKETS)),
        "gen_ai.client.token.usage": ("{token}", [float(b) for b in TOKEN_BUCKETS]),
    }
    assert set(metrics) == set(expected)
    for name, (unit, bounds) in expected.items():
        metric, resource = metrics[name]
        assert metric.unit == unit, name
        assert metric.histogram.aggregation_temporality == 2, name  # cumulative
        for point in metric.histogram.data_points:
            assert list(point.explicit_bounds) == pytest.approx(bounds), name
            assert sum(point.bucket_counts) == point.count, name
        assert resource["service.name"] == "pw-under-test"
    scopes = {scope.scope.name: scope.schema_url for request in received.metrics
              for resource in request.resource_metrics for scope in resource.scope_metrics}
    assert scopes == {"phasewatch": f"https://opentelemetry.io/schemas/{SEMCONV_VERSION}"}
    assert received.content_types == {"application/x-protobuf"}


def test_metric_attributes_follow_the_conventions(exported: Any) -> None:
    received, _ = exported
    port = None
    for name in ("gen_ai.server.request.duration", "gen_ai.server.time_to_first_token"):
        for attrs, _, _ in _points(received, name):
            assert attrs["gen_ai.provider.name"] == "vllm"
            assert attrs["gen_ai.request.model"] in ("m", "other")
            assert attrs["gen_ai.operation.name"] in ("chat", "text_completion")
            assert attrs["server.address"] == "127.0.0.1"
            port = attrs["server.port"]
    assert isinstance(port, int) and port > 0
    errors = {attrs.get("error.type"): count
              for attrs, count, _ in _points(received, "gen_ai.server.request.duration")
              if attrs.get("error.type")}
    assert errors == {"500": 1, "stream_error": 1}
    types = {attrs["gen_ai.token.type"]
             for attrs, _, _ in _points(received, "gen_ai.client.token.usage")}
    assert types == {"input", "output"}


def test_counts_and_sums_equal_the_prometheus_histograms(exported: Any) -> None:
    received, samples = exported
    pairs = {
        "gen_ai.server.time_to_first_token": ("phasewatch_time_to_first_token_seconds", None),
        "gen_ai.server.time_per_output_token": (
            "phasewatch_request_time_per_output_token_seconds", None),
        "gen_ai.server.request.duration": ("phasewatch_e2e_request_latency_seconds", None),
    }
    for name, (histogram, _) in pairs.items():
        points = _points(received, name)
        count = sum(c for _, c, _ in points)
        assert count == _prometheus(samples, histogram + "_count") > 0, name
        assert sum(s for _, _, s in points) == pytest.approx(
            _prometheus(samples, histogram + "_sum"), rel=1e-9), name
    # 8 requests: each has a duration; 6 streams had a first token (the cut one included);
    # TPOT and tokens come from the 6 that ended well (5 streams with >1 token, the plain one).
    assert sum(c for _, c, _ in _points(received, "gen_ai.server.request.duration")) == 8
    assert sum(c for _, c, _ in _points(received, "gen_ai.server.time_to_first_token")) == 6
    tokens: dict[str, tuple[int, float]] = {}
    for attrs, count, total in _points(received, "gen_ai.client.token.usage"):
        had = tokens.get(attrs["gen_ai.token.type"], (0, 0.0))
        tokens[attrs["gen_ai.token.type"]] = (had[0] + count, had[1] + total)
    for kind, histogram in (("input", "phasewatch_request_prompt_tokens"),
                            ("output", "phasewatch_request_generation_tokens")):
        assert tokens[kind] == (_prometheus(samples, histogram + "_count"),
                                _prometheus(samples, histogram + "_sum")), kind


def test_a_span_per_request_continues_the_clients_trace(exported: Any,
                                                        scripted_url: str) -> None:
    received, _ = exported
    spans = {attributes(span.attributes)["phasewatch.request_id"]: (span, resource)
             for span, resource in received.spans()}
    assert set(spans) == {"ok-0", "ok-1", "ok-2", "traced", "completion", "plain", "failed",
                          "cut"}
    span, resource = spans["traced"]
    assert resource["service.name"] == "pw-under-test"
    assert (span.trace_id.hex(), span.parent_span_id.hex()) == (CLIENT_TRACE, CLIENT_SPAN)
    assert span.name == "chat m" and span.kind == Span.SPAN_KIND_CLIENT
    attrs = attributes(span.attributes)
    assert attrs["gen_ai.operation.name"] == "chat" and attrs["gen_ai.request.model"] == "m"
    assert attrs["gen_ai.usage.output_tokens"] == 2 and attrs["gen_ai.request.stream"] is True
    assert span.status.code == 0  # STATUS_CODE_UNSET: it ended well
    # TTFT is an event at the first token, timed from the span's start (the arrival).
    (event,) = span.events
    ttft = attributes(event.attributes)["gen_ai.server.time_to_first_token"]
    assert event.name == "gen_ai.first_token"
    assert (event.time_unix_nano - span.start_time_unix_nano) / 1e9 == pytest.approx(ttft,
                                                                                  abs=1e-6)
    # The upstream was told phasewatch's span is the parent, in the same trace.
    log = httpx.get(f"{scripted_url}/_log/traced", timeout=10).json()
    assert log["headers"]["traceparent"] == f"00-{CLIENT_TRACE}-{span.span_id.hex()}-01"
    # A request without a traceparent starts a trace of its own, still propagated upstream.
    own, _ = spans["ok-0"]
    assert not own.parent_span_id and own.trace_id.hex() != CLIENT_TRACE
    log = httpx.get(f"{scripted_url}/_log/ok-0", timeout=10).json()
    version, trace_id, parent_id, flags = log["headers"]["traceparent"].split("-")
    assert (version, trace_id, parent_id) == ("00", own.trace_id.hex(), own.span_id.hex())
    assert int(flags, 16) & 1  # sampled (the SDK may also set the random-trace-id flag)
    # Failures say so.
    failed, _ = spans["failed"]
    cut, _ = spans["cut"]
    assert attributes(failed.attributes)["error.type"] == "500"
    assert attributes(cut.attributes)["error.type"] == "stream_error"
    assert failed.status.code == cut.status.code == 2  # STATUS_CODE_ERROR
    assert spans["completion"][0].name == "text_completion m"


def test_off_by_default_and_nothing_of_it_runs(scripted_url: str, tmp_path: Any) -> None:
    """With the switch off, a proxy that relays a stream never imports the SDK or phasewatch's
    exporter: of phasewatch.otel only its package (which checks the switch's requirements
    without importing OpenTelemetry) is loaded. FastAPI itself imports the OpenTelemetry API,
    a no-op without an SDK."""
    program = f"""
import sys, httpx
from phasewatch.core.settings import load_settings
from phasewatch.main import create_app
from tests.support.servers import ThreadServer
settings = load_settings(upstream_url={scripted_url!r}, admin_open=True,
                         database_url="sqlite+aiosqlite:///{tmp_path}/pw.db")
server = ThreadServer(create_app(settings)).start()
with httpx.stream("POST", server.url + "/v1/chat/completions", json={{"model": "m",
        "messages": [], "stream": True}}) as response:
    assert response.status_code == 200 and b"[DONE]" in response.read()
server.stop()
print(sorted(m for m in sys.modules if m.startswith(("opentelemetry.sdk", "phasewatch.otel"))))
"""
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": "x"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "['phasewatch.otel']"
