"""Exemplars: TTFT and ITL buckets name a request that landed in them, in OpenMetrics only.

A scrape that asks for OpenMetrics (as Prometheus does) gets the request id on the TTFT bucket
of each request's first token and on the ITL bucket of each gap that was its stream's largest
so far; the classic text format carries none. Counts never depend on exemplars: a request whose
id is too long for one is still observed.
"""

from __future__ import annotations

from typing import Any

import httpx
import orjson
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from tests.conftest import Proxy

OPENMETRICS = "application/openmetrics-text; version=1.0.0,text/plain;version=0.0.4;q=0.5"


def _stream(proxy: Proxy, request_id: str, tokens: list[list[Any]]) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    headers = {"x-request-id": request_id, "x-script": orjson.dumps({"tokens": tokens}).decode()}
    with httpx.stream("POST", proxy.url + "/v1/chat/completions", json=body, headers=headers,
                      timeout=30) as response:
        assert response.status_code == 200
        response.read()


def _exemplars(text: str, family_name: str) -> list[tuple[str, str, float]]:
    """(le, request_id, value) of each bucket's exemplar."""
    found = []
    for family in text_string_to_metric_families(text):
        if family.name != family_name:
            continue
        for sample in family.samples:
            if sample.name.endswith("_bucket") and sample.exemplar is not None:
                found.append((sample.labels["le"], sample.exemplar.labels["request_id"],
                              sample.exemplar.value))
    return found


def test_buckets_carry_request_ids_in_openmetrics_only(proxy: Proxy) -> None:
    # Gaps of 200, 50 and 400 ms: the first and the third are each the stream's largest so
    # far. The gaps are wide so that a late read (a busy machine, a sanitized build) cannot
    # reorder them.
    _stream(proxy, "ex-1", [[0.05, "a", 1], [0.25, "b", 1], [0.30, "c", 1], [0.70, "d", 1]])
    response = httpx.get(proxy.url + "/metrics", headers={"accept": OPENMETRICS})
    assert response.headers["content-type"].startswith("application/openmetrics-text")
    assert response.text.endswith("# EOF\n")
    record = proxy.next_record()
    # The exemplars' values are the request's own figures, as its record has them.
    ttft = _exemplars(response.text, "phasewatch_time_to_first_token_seconds")
    assert [(rid, value) for _, rid, value in ttft] == [("ex-1", record.ttft_s)]
    assert 0.05 <= record.ttft_s < 0.25  # the script's 50 ms, read before the second token
    itl = _exemplars(response.text, "phasewatch_inter_token_latency_seconds")
    assert [rid for _, rid, _ in itl] == ["ex-1", "ex-1"]
    first, third = sorted(value for _, _, value in itl)
    assert abs(first - 0.2) < 0.1 and abs(third - 0.4) < 0.1
    assert max(value for _, _, value in itl) == record.itl_max_s
    for le, _, value in ttft + itl:  # each on the bucket its value fell in
        assert value <= float(le)
    plain = httpx.get(proxy.url + "/metrics")
    assert plain.headers["content-type"].startswith("text/plain")
    assert "phasewatch_time_to_first_token_seconds_bucket" in plain.text
    assert " # {" not in plain.text


def test_an_id_too_long_for_an_exemplar_is_still_counted(proxy: Proxy) -> None:
    long_id = "x" * 100  # past OpenMetrics' 128 characters with the label names
    _stream(proxy, long_id, [[0.01, "a", 1], [0.02, "b", 1]])
    _stream(proxy, "short", [[0.01, "a", 1], [0.02, "b", 1]])
    text = httpx.get(proxy.url + "/metrics", headers={"accept": OPENMETRICS}).text
    ids = {rid for _, rid, _ in _exemplars(text, "phasewatch_time_to_first_token_seconds")}
    assert ids == {"short"}
    assert proxy.sample("phasewatch_time_to_first_token_seconds_count",
                        {"model": "other", "endpoint": "chat.completions"}) + proxy.sample(
        "phasewatch_time_to_first_token_seconds_count",
        {"model": "m", "endpoint": "chat.completions"}) == 2


def test_exemplars_can_be_switched_off(make_proxy: Any, scripted_url: str) -> None:
    proxy = make_proxy(scripted_url, exemplars=False)
    _stream(proxy, "ex-off", [[0.01, "a", 1], [0.02, "b", 1]])
    text = httpx.get(proxy.url + "/metrics", headers={"accept": OPENMETRICS}).text
    assert _exemplars(text, "phasewatch_time_to_first_token_seconds") == []
    assert _exemplars(text, "phasewatch_inter_token_latency_seconds") == []
