"""The official `openai` client through phasewatch gets what it gets from vLLM directly.

Greedy decoding (temperature 0, a seed) on a vLLM without prefix caching makes a repeated
request compute the same tokens, so each request is sent twice, straight to vLLM and through
the proxy, and the two answers must agree: text, finish reason, usage, and the usage chunk only
when the client asked for it (the proxy asks vLLM for usage on every stream and must hide it).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import openai
import orjson
import pytest

from tests.conftest import Proxy
from tests.vllm.server import VLLMServer
from tests.vllm.streams import stream

MAX_TOKENS = 12


@dataclass(frozen=True)
class Answer:
    text: str
    finish_reason: str | None
    usage: dict[str, Any] | None  # the response's usage, or the usage chunk's
    usage_chunks: int  # streamed chunks carrying usage
    usage_chunk_last_and_empty: bool  # the usage chunk is the last and has `choices: []`


def ask(base_url: str, model: str, endpoint: str, stream_mode: str, seed: int) -> Answer:
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0,
                           timeout=120)
    kwargs: dict[str, Any] = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0,
                              "seed": seed, "extra_body": {"ignore_eos": True}}
    if stream_mode != "none":
        kwargs["stream"] = True
    if stream_mode == "stream+usage":
        kwargs["stream_options"] = {"include_usage": True}
    if endpoint == "chat":
        response: Any = client.chat.completions.create(
            messages=[{"role": "user", "content": f"Tell me about number {seed}."}], **kwargs)
    else:
        response = client.completions.create(prompt=f"Number {seed} is", **kwargs)
    if stream_mode == "none":
        choice = response.choices[0]
        text = choice.message.content if endpoint == "chat" else choice.text
        return Answer(text, choice.finish_reason, response.usage.model_dump(exclude_none=True),
                      0, False)
    chunks = list(response)
    text, finish = "", None
    for chunk in chunks:
        for choice in chunk.choices:
            text += (choice.delta.content if endpoint == "chat" else choice.text) or ""
            finish = choice.finish_reason or finish
    with_usage = [c for c in chunks if c.usage is not None]
    usage = with_usage[-1].usage.model_dump(exclude_none=True) if with_usage else None
    last_empty = bool(with_usage) and with_usage[-1] is chunks[-1] and chunks[-1].choices == []
    return Answer(text, finish, usage, len(with_usage), last_empty)


@pytest.mark.parametrize(("endpoint", "stream_mode"), list(itertools.product(
    ["chat", "completions"], ["none", "stream", "stream+usage"])))
def test_openai_client_gets_the_same_answer_through_the_proxy(
    vllm_server: VLLMServer, vllm_proxy: Proxy, endpoint: str, stream_mode: str
) -> None:
    seed = 11 + len(endpoint) + len(stream_mode)
    direct = ask(vllm_server.url, vllm_server.model, endpoint, stream_mode, seed)
    proxied = ask(vllm_proxy.url, vllm_server.model, endpoint, stream_mode, seed)

    assert proxied == direct
    assert direct.text and direct.finish_reason == "length"
    if stream_mode == "stream":
        assert direct.usage_chunks == 0  # vLLM sends none, and the proxy hid the ones it asked for
    else:
        assert direct.usage is not None and direct.usage["completion_tokens"] == MAX_TOKENS
    if stream_mode == "stream+usage":
        assert direct.usage_chunks == 1 and direct.usage_chunk_last_and_empty

    record = vllm_proxy.next_record()
    assert record.outcome == "ok" and record.stream == (stream_mode != "none")
    assert record.output_tokens == MAX_TOKENS and record.tokens_exact
    if direct.usage is not None:
        assert record.prompt_tokens == direct.usage["prompt_tokens"]


def shapes(body: bytes) -> list[Any]:
    """Each event's JSON structure (keys in order, value types), consecutive repeats collapsed:
    chunks that carry one token or several look alike."""
    def shape(value: Any) -> Any:
        if isinstance(value, dict):
            return [(key, shape(item)) for key, item in value.items()]
        if isinstance(value, list):
            return [shape(item) for item in value]
        return type(value).__name__

    events = [line[6:] for line in body.split(b"\n") if line.startswith(b"data: ")]
    out = [shape(orjson.loads(e)) if e != b"[DONE]" else "[DONE]" for e in events]
    return [s for i, s in enumerate(out) if i == 0 or s != out[i - 1]]


@pytest.mark.parametrize(("path", "options"), list(itertools.product(
    ["/v1/chat/completions", "/v1/completions"],
    [None, {"include_usage": True}, {"include_usage": True, "continuous_usage_stats": True}])),
    ids=lambda v: str(v).replace(" ", ""))
def test_streamed_events_have_exactly_the_keys_vllm_sends(
    vllm_server: VLLMServer, vllm_proxy: Proxy, path: str, options: dict[str, Any] | None
) -> None:
    """The client's stream through the proxy has the structure vLLM gives it directly.

    The proxy asks vLLM for running usage on every stream and cuts out what the client did not
    ask for; what is left must be what vLLM would have sent: no key added, none lost.
    """
    body: dict[str, Any] = {"model": vllm_server.model, "max_tokens": 5, "temperature": 0,
                            "seed": 5, "ignore_eos": True}
    if "chat" in path:
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    if options is not None:
        body["stream_options"] = options
    direct = stream(vllm_server.url, path, body)
    proxied = stream(vllm_proxy.url, path, body)
    assert direct.status == proxied.status == 200
    assert proxied.text() == direct.text()
    assert shapes(proxied.body) == shapes(direct.body)


def test_a_stream_read_to_done_is_ok_even_if_the_client_closes_at_once(
    vllm_server: VLLMServer, vllm_proxy: Proxy
) -> None:
    """The `openai` client stops at `data: [DONE]` and closes the connection at once, which can
    reach the proxy before vLLM has ended its response body. The request was complete: it must
    be recorded `ok`, not `cancelled`. (A race: about one stream in five lost it here.)"""
    client = openai.OpenAI(base_url=vllm_proxy.url + "/v1", api_key="unused", max_retries=0,
                           timeout=60)
    for i in range(20):
        chunks = list(client.completions.create(
            model=vllm_server.model, prompt=f"Count {i}", max_tokens=3, temperature=0,
            stream=True, extra_body={"ignore_eos": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices)
    outcomes = [vllm_proxy.next_record().outcome for _ in range(20)]
    assert outcomes == ["ok"] * 20
