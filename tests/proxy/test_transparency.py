"""A client that changes only its base URL sees exactly what the upstream would have sent it."""

from __future__ import annotations

import time
from typing import Any

import httpx
import openai
import orjson
import pytest

from tests.conftest import Proxy

SCRIPT = {"tokens": [[0.02, "Hello", 1], [0.04, " wor", 1], [0.06, "ld", 2]]}
HEADERS = {"x-script": orjson.dumps(SCRIPT).decode()}
# As vLLM 0.32 does: the fingerprint on the terminal chunk, or on the usage chunk when the
# client asked for usage (the proxy always asks, and must put it back where it belongs).
FINGERPRINTED = {**SCRIPT, "fingerprint": "vllm-0.32.0-1a2b3c4d"}


def raw_stream(base: str, path: str, body: dict[str, Any],
               script: dict[str, Any] = SCRIPT) -> bytes:
    headers = {"x-script": orjson.dumps(script).decode()}
    with httpx.stream("POST", base + path, json=body, headers=headers) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert "content-length" not in response.headers
        return response.read()


@pytest.mark.parametrize("script", [SCRIPT, FINGERPRINTED], ids=["plain", "fingerprint"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(
    "stream_options",
    [None, {"include_usage": False}, {"include_usage": True},
     {"include_usage": True, "continuous_usage_stats": True}],
)
def test_stream_bytes_equal_the_upstream_s(
    proxy: Proxy, scripted_url: str, path: str, stream_options: dict[str, bool] | None,
    script: dict[str, Any],
) -> None:
    body: dict[str, Any] = {"model": "scripted", "stream": True}
    body["messages" if "chat" in path else "prompt"] = (
        [{"role": "user", "content": "x"}] if "chat" in path else "x")
    if stream_options is not None:
        body["stream_options"] = stream_options
    direct = raw_stream(scripted_url, path, body, script)
    proxied = raw_stream(proxy.url, path, body, script)
    assert proxied == direct
    if script is FINGERPRINTED:  # the client got the fingerprint, exactly once
        assert proxied.count(b'"system_fingerprint":"vllm-0.32.0-1a2b3c4d"') == 1
    # ...while phasewatch still counted tokens exactly, from the usage it asked for itself.
    record = proxy.next_record()
    assert record.output_tokens == 4 and record.tokens_exact and record.itl_count == 3


def test_upstream_received_the_request_unchanged_but_for_stream_options(
    proxy: Proxy, scripted_url: str
) -> None:
    body = {"model": "scripted", "prompt": "x", "stream": True, "max_tokens": 5,
            "temperature": 0.25, "extra_vendor_field": {"nested": [1, 2]}}
    with httpx.stream("POST", proxy.url + "/v1/completions?trace=1", json=body,
                      headers={**HEADERS, "x-request-id": "client-id-1",
                               "authorization": "Bearer sk-test"}) as response:
        response.read()
        assert response.headers["x-request-id"] == "client-id-1"
    log = httpx.get(f"{scripted_url}/_log/client-id-1").json()
    sent = orjson.loads(log["body"])
    assert sent.pop("stream_options") == {"include_usage": True, "continuous_usage_stats": True}
    assert sent == body
    assert log["query"] == "trace=1"
    assert log["headers"]["authorization"] == "Bearer sk-test"
    assert log["headers"]["x-request-id"] == "client-id-1"
    record = proxy.next_record()
    assert record.request_id == "client-id-1"
    assert "sk-test" not in repr(record)


def test_upstream_received_the_clients_bytes_with_stream_options_appended(
    proxy: Proxy, scripted_url: str
) -> None:
    """Not only the same JSON value: the same text, spacing, escapes and numbers included."""
    body = (b'{"model": "scripted",\n "prompt": "caf\\u00e9 \\/ x", "stream": true,'
            b' "temperature": 1E-1, "max_tokens": 5}\n')
    with httpx.stream("POST", proxy.url + "/v1/completions", content=body,
                      headers={**HEADERS, "content-type": "application/json",
                               "x-request-id": "verbatim-1"}) as response:
        response.read()
    sent = httpx.get(f"{scripted_url}/_log/verbatim-1").json()["body"].encode()
    assert sent == (b'{"model": "scripted",\n "prompt": "caf\\u00e9 \\/ x", "stream": true,'
                    b' "temperature": 1E-1, "max_tokens": 5,"stream_options":'
                    b'{"include_usage":true,"continuous_usage_stats":true}}\n')
    assert proxy.next_record().request_id == "verbatim-1"


def test_request_id_is_minted_when_the_client_sends_none(proxy: Proxy) -> None:
    response = httpx.post(proxy.url + "/v1/completions", json={"model": "scripted", "prompt": "x"},
                          headers=HEADERS)
    minted = response.headers["x-request-id"]
    assert len(minted) == 32
    assert proxy.next_record().request_id == minted


@pytest.fixture
def client(proxy: Proxy) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-test", default_headers=HEADERS,
                         max_retries=0)


@pytest.mark.parametrize("include_usage", [False, True])
def test_openai_client_chat_streaming(client: openai.OpenAI, proxy: Proxy,
                                      include_usage: bool) -> None:
    options = {"include_usage": True} if include_usage else openai.omit
    chunks = list(client.chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "hi"}], stream=True,
        stream_options=options))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello world"
    usage_chunks = [c for c in chunks if c.usage is not None]
    if include_usage:
        assert len(usage_chunks) == 1 and usage_chunks[0].usage.completion_tokens == 4
        assert chunks[-1].choices == []
    else:
        assert usage_chunks == [] and all(c.choices for c in chunks)  # chunk.choices[0] is safe
    assert proxy.next_record().output_tokens == 4


@pytest.mark.parametrize("include_usage", [False, True])
def test_openai_client_completions_streaming(client: openai.OpenAI, proxy: Proxy,
                                             include_usage: bool) -> None:
    options = {"include_usage": True} if include_usage else openai.omit
    chunks = list(client.completions.create(model="scripted", prompt="hi", stream=True,
                                            stream_options=options))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "Hello world"
    assert sum(c.usage is not None for c in chunks) == (1 if include_usage else 0)
    assert proxy.next_record().outcome == "ok"


def test_openai_client_non_streaming(client: openai.OpenAI, proxy: Proxy) -> None:
    chat = client.chat.completions.create(model="scripted",
                                          messages=[{"role": "user", "content": "hi"}])
    assert chat.choices[0].message.content == "Hello world" and chat.usage.completion_tokens == 4
    completion = client.completions.create(model="scripted", prompt="hi")
    assert completion.choices[0].text == "Hello world"
    assert [proxy.next_record().endpoint for _ in range(2)] == ["chat.completions", "completions"]


def test_openai_client_sees_upstream_errors_as_api_errors(client: openai.OpenAI) -> None:
    failing = client.with_options(default_headers={"x-script": '{"status": 503}'})
    with pytest.raises(openai.InternalServerError) as info:
        failing.completions.create(model="scripted", prompt="hi")
    assert info.value.status_code == 503
    with pytest.raises(openai.APIError):
        list(client.with_options(default_headers={
            "x-script": orjson.dumps({**SCRIPT, "error_at": 0.03}).decode()
        }).completions.create(model="scripted", prompt="hi", stream=True))


def test_other_upstream_paths_pass_through(proxy: Proxy, scripted_url: str) -> None:
    direct = httpx.get(scripted_url + "/v1/models")
    proxied = httpx.get(proxy.url + "/v1/models")
    assert proxied.status_code == 200 and proxied.content == direct.content
    assert proxied.headers["x-upstream"] == "yes" and "x-request-id" in proxied.headers
    assert httpx.get(proxy.url + "/health").status_code == 200
    time.sleep(0.3)
    assert proxy.stored() == []  # only inference requests are timed and recorded
