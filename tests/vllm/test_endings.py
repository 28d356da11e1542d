"""How requests that do not end well through phasewatch end in a real vLLM, and how they are
recorded: a client that leaves mid-stream, an error before the stream, an error inside it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
import openai
import orjson
import pytest

from tests.conftest import Proxy
from tests.vllm.engine_metrics import Snapshot, delta
from tests.vllm.server import VLLMServer
from tests.vllm.streams import output_text, stream, token_prompt

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MAX_TOKENS = 4000
PROXY_CLOSES_WITHIN_S = 1.0  # the proxy's part: 1-20 ms when nothing stalls its thread
# vLLM aborts as soon as its HTTP connection closes: idle 0.1-0.7 s later as seen by a scrape.
# But while a request runs, its API server competes with its own busy-waiting engine processes,
# and with neighbours loading this 2-core box it was seen taking 5-16 s to answer a scrape.
VLLM_IDLE_WITHIN_S = 10.0


def scrape(server: VLLMServer) -> Snapshot:
    return Snapshot(server.metrics_text(), server.model)


def wait_for(server: VLLMServer, check: Callable[[Snapshot], bool], timeout: float) -> Snapshot:
    """Scrape until `check(snapshot)` holds (or `timeout` passes); return the last snapshot."""
    deadline = time.monotonic() + timeout
    while True:
        snapshot = scrape(server)
        if check(snapshot) or time.monotonic() > deadline:
            return snapshot
        time.sleep(0.02)


def test_a_client_leaving_mid_stream_stops_generation(
    vllm_server: VLLMServer, vllm_proxy: Proxy
) -> None:
    # 4000 tokens take vLLM 12 s or more here. The client reads 5 and leaves: the request was
    # running then, and if it ends short of 4000 tokens it was aborted, not finished.
    before = scrape(vllm_server)
    body = {"model": vllm_server.model, "prompt": token_prompt(64, 7), "max_tokens": MAX_TOKENS,
            "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.Client(timeout=60) as client:
        sent = time.perf_counter()
        with client.stream("POST", vllm_proxy.url + COMPLETIONS, json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            seen = 0
            while seen < 5:
                seen += bool(output_text_of(next(lines)))
        left = time.perf_counter()  # the connection is closed
    record = vllm_proxy.next_record()
    assert record.outcome == "cancelled" and record.ttft_s is not None
    # The proxy closed its connection to vLLM when it finished the record: at most this long
    # after the client left (an upper bound: the proxy's clock started after `sent`).
    assert sent + record.e2e_s - left <= PROXY_CLOSES_WITHIN_S
    after = wait_for(vllm_server, lambda s: s["vllm:num_requests_running"] == 0, 30)
    took = time.perf_counter() - left  # an upper bound: it includes the scrape that saw it
    generated = delta(before, after, "vllm:generation_tokens_total")
    print(f"proxy closed upstream {sent + record.e2e_s - left:.3f} s and vLLM was idle "
          f"{took:.3f} s after the client left; {generated:.0f} of {MAX_TOKENS} tokens generated")
    assert after["vllm:num_requests_running"] == 0
    assert 5 <= generated < MAX_TOKENS
    assert took <= VLLM_IDLE_WITHIN_S, f"vLLM still ran the request {took:.2f} s after"
    # And it generates nothing more. (vLLM 0.32 counts a request aborted this way in neither
    # `request_success_total{finished_reason="abort"}` nor the E2E histogram.)
    time.sleep(0.3)
    assert delta(before, scrape(vllm_server), "vllm:generation_tokens_total") == generated


def output_text_of(line: str) -> str:
    if not line.startswith("data: {"):
        return ""
    return output_text(orjson.loads(line[6:]))


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_a_prompt_over_max_model_len_is_an_http_error(
    vllm_server: VLLMServer, vllm_proxy: Proxy, path: str
) -> None:
    # This vLLM refuses it with a 400 before any stream starts (even with stream=true).
    body: dict[str, Any] = {"model": vllm_server.model, "max_tokens": 4, "stream": True}
    if path == CHAT:
        body["messages"] = [{"role": "user", "content": "tango " * vllm_server.max_model_len}]
    else:
        body["prompt"] = token_prompt(vllm_server.max_model_len + 1, 8)
    direct = httpx.post(vllm_server.url + path, json=body, timeout=60)
    proxied = httpx.post(vllm_proxy.url + path, json=body, timeout=60)
    assert direct.status_code == proxied.status_code == 400
    assert proxied.json() == direct.json()
    record = vllm_proxy.next_record()
    assert record.outcome == "http_error" and record.http_status == 400
    assert record.ttft_s is None and record.itl_count == 0
    assert record.error == "HTTP 400: BadRequestError"
    labels = {"model": vllm_server.model, "endpoint": record.endpoint}
    assert vllm_proxy.sample("phasewatch_time_to_first_token_seconds_count", labels) == 0


@pytest.mark.parametrize(("path", "invalid"), [
    (COMPLETIONS, {"prompt": [5, 99999]}),  # a token id outside the vocabulary
    (COMPLETIONS, {"prompt": "hi", "logprobs": 50}),  # more logprobs than vLLM allows (20)
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
            "top_logprobs": 50}),
], ids=["token-out-of-vocab", "completion-logprobs", "chat-logprobs"])
def test_an_error_inside_the_stream_is_recorded_as_an_error(
    vllm_server: VLLMServer, vllm_proxy: Proxy, path: str, invalid: dict[str, Any]
) -> None:
    # This vLLM answers 200, then one `data: {"error": ...}` event and `data: [DONE]`.
    body = {"model": vllm_server.model, "max_tokens": 4, **invalid}
    direct = stream(vllm_server.url, path, body)
    proxied = stream(vllm_proxy.url, path, body)
    assert direct.status == proxied.status == 200
    assert proxied.body == direct.body  # relayed byte for byte
    assert "error" in direct.chunks[0] and direct.events[-1].data == b"[DONE]"
    record = vllm_proxy.next_record()
    assert record.outcome == "stream_error" and record.http_status == 200
    assert record.ttft_s is None and record.itl_count == 0  # not a success with TTFT 0
    assert record.error == "in-band error from upstream"
    labels = {"model": vllm_server.model, "endpoint": record.endpoint}
    assert vllm_proxy.sample("phasewatch_requests_total",
                             {**labels, "outcome": "stream_error"}) == 1
    assert vllm_proxy.sample("phasewatch_time_to_first_token_seconds_count", labels) == 0


def test_the_openai_client_raises_on_an_in_band_error_through_the_proxy(
    vllm_server: VLLMServer, vllm_proxy: Proxy
) -> None:
    for url in (vllm_server.url, vllm_proxy.url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        chunks = client.completions.create(model=vllm_server.model, prompt=[5, 99999],
                                           max_tokens=4, stream=True)
        with pytest.raises(openai.APIError, match="out of vocabulary"):
            list(chunks)
