"""What `/metrics` exposes, read from a real proxy's endpoint and its injected registry."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import orjson
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.parser import text_string_to_metric_families

from phasewatch.core.metrics import LoopValue, ProxyMetrics, loop_owned
from tests.conftest import Proxy
from tests.support.served import wait_for

SCRIPT = {"x-script": orjson.dumps({"tokens": [[0.01, "a", 1], [0.02, "b", 1]]}).decode()}


def test_slo_thresholds_are_exact_bucket_edges() -> None:
    metrics = ProxyMetrics(CollectorRegistry(), slo_ttft_s=0.35, slo_itl_s=0.0125)
    assert 0.35 in metrics.ttft_buckets and 0.0125 in metrics.itl_buckets
    assert min(metrics.itl_buckets) < 0.005  # sub-10 ms decode steps are resolved


def test_metrics_endpoint_has_the_histograms_with_slo_edges(proxy: Proxy) -> None:
    httpx.post(proxy.url + "/v1/completions",
               json={"model": "scripted", "prompt": "x", "stream": True}, headers=SCRIPT).read()
    proxy.next_record()
    text = httpx.get(proxy.url + "/metrics").text
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    labels = (("endpoint", "completions"), ("model", "scripted"))
    assert samples["phasewatch_time_to_first_token_seconds_bucket", (*labels[:1], ("le", "0.5"),
                                                                     *labels[1:])] == 1
    assert samples["phasewatch_inter_token_latency_seconds_bucket", (*labels[:1], ("le", "0.04"),
                                                                    *labels[1:])] == 1
    for name in ("phasewatch_request_time_per_output_token_seconds_count",
                 "phasewatch_e2e_request_latency_seconds_count",
                 "phasewatch_request_prompt_tokens_sum", "phasewatch_request_generation_tokens_sum",
                 "phasewatch_requests_total", "phasewatch_requests_in_flight",
                 "phasewatch_records_dropped_total"):
        assert name in text, name
    assert proxy.sample("phasewatch_request_generation_tokens_sum",
                        {"model": "scripted", "endpoint": "completions"}) == 2


def test_custom_slo_edges_reach_the_exposition(make_proxy: Any, scripted_url: str) -> None:
    proxy = make_proxy(scripted_url, slo_ttft_s=0.35, slo_itl_s=0.0125)
    httpx.post(proxy.url + "/v1/completions",
               json={"model": "scripted", "prompt": "x", "stream": True}, headers=SCRIPT).read()
    text = httpx.get(proxy.url + "/metrics").text
    assert 'le="0.35"' in text and 'le="0.0125"' in text


def test_in_flight_gauge_counts_open_streams(proxy: Proxy) -> None:
    slow = {"x-script": orjson.dumps({"tokens": [[0.6, "a", 1]]}).decode()}
    threads = [threading.Thread(target=lambda: httpx.post(
        proxy.url + "/v1/completions", json={"model": "scripted", "prompt": "x", "stream": True},
        headers=slow, timeout=10)) for _ in range(3)]
    for t in threads:
        t.start()
    wait_for(lambda: proxy.sample("phasewatch_requests_in_flight") == 3, says="3 in flight")
    for t in threads:
        t.join()
    deadline = time.monotonic() + 2  # the last byte can reach the client before `finally` runs
    while proxy.sample("phasewatch_requests_in_flight") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proxy.sample("phasewatch_requests_in_flight") == 0
    records = sorted(proxy.next_record().in_flight_at_arrival for _ in range(3))
    assert records == [0, 1, 2]


def test_fast_observe_leaves_what_observe_leaves() -> None:
    """Every histogram the relay observes through fast_observe, against prometheus_client's
    own `observe`, on every bucket edge, between edges, past the last, with and without
    exemplars (labels and value)."""
    metrics = [ProxyMetrics(CollectorRegistry(), slo_ttft_s=0.5, slo_itl_s=0.0125)
               for _ in range(2)]
    slow_m, fast_m = metrics
    bound, ended = fast_m.bind("m", "completions"), fast_m.ended("m", "completions", "ok")
    pairs: list[tuple[Any, Any, Any]] = [
        (slow_m.ttft.labels("m", "completions"), bound.observe_ttft, "ttft"),
        (slow_m.itl.labels("m", "completions"), bound.observe_itl, "itl"),
        (slow_m.tpot.labels("m", "completions"), bound.observe_tpot, "tpot"),
        (slow_m.prompt_tokens.labels("m", "completions"), bound.observe_prompt_tokens,
         "prompt_tokens"),
        (slow_m.output_tokens.labels("m", "completions"), bound.observe_output_tokens,
         "output_tokens"),
        (slow_m.e2e.labels("m", "completions", "ok"), ended.observe_e2e, "e2e"),
        (slow_m.proxy_queue, fast_m.observe_proxy_queue, "proxy_queue"),
    ]
    for slow, fast, name in pairs:
        bounds = [float(b) for b in slow._upper_bounds]
        values = [0.0, *bounds, *(b * 0.999 for b in bounds), *(b * 1.001 for b in bounds),
                  1e6, float("inf")]
        for i, value in enumerate(values):
            exemplar = {"request_id": f"r{i}"} if i % 7 == 0 else None
            slow.observe(value, exemplar)
            fast(value, exemplar)

        def exposed(m: ProxyMetrics, name: str = name) -> list[tuple[Any, ...]]:
            return [(s.name, s.labels, s.value, s.exemplar and s.exemplar.labels,
                     s.exemplar and s.exemplar.value)
                    for family in getattr(m, name).collect() for s in family.samples
                    if not s.name.endswith("_created")]

        assert exposed(fast_m) == exposed(slow_m), name
        assert any(value == len(values) for s_name, _, value, _, _ in exposed(fast_m)
                   if s_name.endswith("_count")), name
        assert any(s[3] for s in exposed(fast_m)), name  # exemplars were set


def test_loop_owned_values_render_what_prometheus_clients_own_render() -> None:
    """The relay's series hold `LoopValue`s (no lock), carrying over what the values held,
    and render exactly as prometheus_client's own after the same writes."""
    def made(owned: bool) -> list[Any]:
        registry = CollectorRegistry()
        counter = Counter("c", "c", ("outcome",), registry=registry)
        gauge = Gauge("g", "g", registry=registry)
        histogram = Histogram("h", "h", registry=registry, buckets=(0.1, 1.0))
        child = counter.labels("ok")
        child.inc(2)
        gauge.inc(5)
        histogram.observe(0.05)
        if owned:
            for metric in (child, gauge, histogram):
                loop_owned(metric)
            assert type(child._value) is type(gauge._value) is LoopValue
            assert type(histogram._sum) is LoopValue
            assert all(type(bucket) is LoopValue for bucket in histogram._buckets)
        child.inc(1)
        gauge.dec(2)
        gauge.inc()
        histogram.observe(0.5)
        histogram.observe(7.0)
        child.inc(1, {"request_id": "r1"})
        return [(s.name, s.labels, s.value, s.exemplar and (s.exemplar.labels, s.exemplar.value))
                for family in registry.collect() for s in family.samples
                if not s.name.endswith("_created")]

    assert made(owned=True) == made(owned=False)


def test_a_request_ending_is_counted_once_in_its_own_series() -> None:
    metrics = ProxyMetrics(CollectorRegistry(), slo_ttft_s=0.5, slo_itl_s=0.0125)
    assert metrics.ended("m", "completions", "ok") is metrics.ended("m", "completions", "ok")
    metrics.ended("m", "completions", "ok").count_request()
    metrics.ended("m", "completions", "cancelled").count_request()
    metrics.ended("m", "completions", "ok").count_request()
    counts = {s.labels["outcome"]: s.value for family in metrics.requests.collect()
              for s in family.samples if s.name.endswith("_total")}
    assert counts == {"ok": 2.0, "cancelled": 1.0}
