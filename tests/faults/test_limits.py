"""Bounded inputs: a request body over `PHASEWATCH_MAX_BODY_BYTES` is refused, never held whole.

Real proxy under uvicorn in front of the scripted upstream, whose request log shows what (if
anything) reached it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import httpx
import orjson
import pytest

from tests.conftest import Proxy

LIMIT = 64 * 1024


@pytest.fixture
def limited(make_proxy: Callable[..., Proxy], scripted_url: str) -> Proxy:
    return make_proxy(scripted_url, max_body_bytes=LIMIT)


def body_of(size: int) -> bytes:
    head = b'{"model": "scripted", "stream": true, "prompt": "'
    return head + b"x" * (size - len(head) - 2) + b'"}'


def reached_upstream(scripted_url: str, request_id: str) -> bool:
    return httpx.get(f"{scripted_url}/_log/{request_id}").status_code == 200


def assert_refused(response: httpx.Response) -> None:
    assert response.status_code == 413
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == 413
    assert str(LIMIT) in error["message"] and "PHASEWATCH_MAX_BODY_BYTES" in error["message"]


def test_a_body_over_the_limit_is_refused_and_recorded(limited: Proxy, scripted_url: str) -> None:
    response = httpx.post(limited.url + "/v1/completions", content=body_of(LIMIT + 1),
                          headers={"x-request-id": "too-big", "content-type": "application/json"})
    assert_refused(response)
    assert response.headers["x-request-id"] == "too-big"
    assert not reached_upstream(scripted_url, "too-big")
    record = limited.next_record()
    assert (record.request_id, record.outcome, record.http_status) == ("too-big", "rejected", 413)
    assert limited.sample("phasewatch_requests_total", {
        "model": "other", "endpoint": "completions", "outcome": "rejected"}) == 1


def test_a_chunked_body_is_cut_off_as_it_passes_the_limit(
    limited: Proxy, scripted_url: str
) -> None:
    def pieces() -> Iterator[bytes]:  # no Content-Length: the size shows only while reading
        for _ in range(64):
            yield b"x" * 16 * 1024

    try:
        response = httpx.post(limited.url + "/v1/chat/completions", content=pieces(),
                              headers={"x-request-id": "chunked"})
    except httpx.HTTPError:
        pass  # the proxy may close before the client has written everything
    else:
        assert_refused(response)
    assert not reached_upstream(scripted_url, "chunked")
    record = limited.next_record()
    assert (record.outcome, record.http_status) == ("rejected", 413)


def test_a_body_at_the_limit_passes(limited: Proxy) -> None:
    body = body_of(LIMIT)
    assert len(body) == LIMIT
    response = httpx.post(limited.url + "/v1/completions", content=body,
                          headers={"content-type": "application/json"})
    assert response.status_code == 200 and b"[DONE]" in response.content


def test_the_pass_through_refuses_a_body_over_the_limit(
    limited: Proxy, scripted_url: str
) -> None:
    response = httpx.post(limited.url + "/tokenize", content=orjson.dumps({"p": "x" * LIMIT}),
                          headers={"x-request-id": "tokenize-big"})
    assert_refused(response)
    assert not reached_upstream(scripted_url, "tokenize-big")


def test_a_hostile_model_name_is_kept_short_and_clean_everywhere(
    make_proxy: Callable[..., Proxy], scripted_url: str, database_url: str
) -> None:
    proxy = make_proxy(scripted_url, database_url=database_url)
    hostile = "m" * 10_000 + "\x00\n"
    response = httpx.post(proxy.url + "/v1/completions", headers={"x-request-id": "hostile"},
                          json={"model": hostile, "prompt": "x", "stream": True})
    assert response.status_code == 200
    sent = orjson.loads(httpx.get(f"{scripted_url}/_log/hostile").json()["body"])
    assert sent["model"] == hostile  # the request itself went upstream unchanged
    record = proxy.next_record()  # stored, on Postgres too (its column holds 255)
    assert len(record.model) == 128 and record.model.endswith("\u2026")
    exposition = httpx.get(proxy.url + "/metrics").text
    assert "\x00" not in exposition and len(exposition) < 100_000
    labels = {s.labels.get("model") for m in proxy.registry.collect() for s in m.samples
              if m.name == "phasewatch_requests"}
    assert labels == {record.model}  # the label is the stored name
