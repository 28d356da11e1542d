"""OpenTelemetry through a real vLLM: phasewatch's GenAI metrics agree with its Prometheus
histograms, and vLLM's own request spans join phasewatch's trace.

The proxy exports to a receiver on loopback (tests/support/otlp_receiver.py); the session's
vLLM exports its `llm_request` spans to the same receiver (`--otlp-traces-endpoint`). Each
request arrives with a client `traceparent`; phasewatch's span must be its child, and vLLM's
span the child of phasewatch's, all in the client's trace.
"""

from __future__ import annotations

import httpx
import pytest
from prometheus_client import CollectorRegistry

from phasewatch.core.settings import load_settings
from phasewatch.main import create_app
from tests.support.otlp_receiver import OtlpReceiver, Received, attributes
from tests.support.served import wait_for
from tests.support.servers import ThreadServer
from tests.vllm.server import VLLMServer
from tests.vllm.streams import text_prompt

REQUESTS = 4


def _trace(i: int) -> tuple[str, str]:
    return f"{i + 1:032x}", f"{i + 1:016x}"


def test_genai_metrics_and_a_trace_through_vllm(
        vllm_server: VLLMServer, otlp_receiver: OtlpReceiver,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    db = tmp_path_factory.mktemp("otel") / "pw.db"
    registry = CollectorRegistry()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", otlp_receiver.url)
        env.setenv("OTEL_SERVICE_NAME", "phasewatch")
        env.setenv("OTEL_METRIC_EXPORT_INTERVAL", "600000")  # only the shutdown's export
        settings = load_settings(upstream_url=vllm_server.url, admin_open=True, otel_enabled=True,
                                 database_url=f"sqlite+aiosqlite:///{db}",
                                 diagnosis_interval_s=0, engine_metrics_enabled=False)
        server = ThreadServer(create_app(settings, registry=registry)).start()
        try:
            for i in range(REQUESTS):
                trace_id, span_id = _trace(i)
                body = {"model": vllm_server.model, "stream": True, "max_tokens": 16 + 4 * i,
                        "ignore_eos": True, "messages": [
                            {"role": "user", "content": text_prompt(20, seed=i)}]}
                with httpx.stream("POST", server.url + "/v1/chat/completions", json=body,
                                  headers={"traceparent": f"00-{trace_id}-{span_id}-01"},
                                  timeout=120) as response:
                    assert response.status_code == 200
                    assert b"[DONE]" in response.read()
            wait_for(lambda: registry.get_sample_value(
                "phasewatch_requests_total", {"model": vllm_server.model,
                                              "endpoint": "chat.completions", "outcome": "ok"})
                == REQUESTS, timeout=10, says="every request finished")
            prometheus = {name: registry.get_sample_value(name, {
                "model": vllm_server.model, "endpoint": "chat.completions"}) for name in (
                "phasewatch_time_to_first_token_seconds_count",
                "phasewatch_time_to_first_token_seconds_sum",
                "phasewatch_request_time_per_output_token_seconds_count",
                "phasewatch_request_time_per_output_token_seconds_sum")}
        finally:
            server.stop()  # flushes the last metrics export and the spans

    def ours(received: Received) -> list[tuple[str, str, str]]:
        return [(span.trace_id.hex(), span.span_id.hex(), span.parent_span_id.hex())
                for span, resource in received.spans()
                if resource.get("service.name") == "phasewatch"]

    def theirs(received: Received) -> dict[str, str]:
        """vLLM's request spans: parent span id -> trace id."""
        return {span.parent_span_id.hex(): span.trace_id.hex()
                for span, resource in received.spans()
                if resource.get("service.name") == "vllm" and span.name == "llm_request"}

    received = otlp_receiver.wait(lambda r: len(ours(r)) >= REQUESTS, says="phasewatch's spans")
    spans = sorted(ours(received))
    assert [(trace_id, parent) for trace_id, _, parent in spans] == [
        _trace(i) for i in range(REQUESTS)]
    # vLLM exports its spans on its own schedule: wait until each of ours has a child there.
    received = otlp_receiver.wait(
        lambda r: all(span_id in theirs(r) for _, span_id, _ in spans), timeout=30,
        says="vLLM's llm_request spans under phasewatch's")
    children = theirs(received)
    assert all(children[span_id] == trace_id for trace_id, span_id, _ in spans)

    metrics = {
        name: [(attributes(p.attributes), p.count, p.sum) for p in metric.histogram.data_points]
        for name, (metric, resource) in received.last_metrics().items()
        if resource.get("service.name") == "phasewatch"}
    for name, histogram in (
            ("gen_ai.server.time_to_first_token", "phasewatch_time_to_first_token_seconds"),
            ("gen_ai.server.time_per_output_token",
             "phasewatch_request_time_per_output_token_seconds")):
        (point,) = metrics[name]
        attrs, count, total = point
        assert attrs["gen_ai.request.model"] == vllm_server.model
        assert attrs["gen_ai.operation.name"] == "chat"
        assert count == prometheus[histogram + "_count"] == REQUESTS
        assert total == pytest.approx(prometheus[histogram + "_sum"], rel=1e-9)
