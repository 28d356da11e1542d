"""vLLM's OpenAI-compatible surface, exercised with the official openai client and raw HTTP."""

from __future__ import annotations

import httpx
import orjson
import pytest
from openai import BadRequestError, NotFoundError, OpenAI

from phasewatch.sim import RunningSim
from phasewatch.sim.api import SYSTEM_FINGERPRINT
from phasewatch.sim.tokenizer import CHAT_GENERATION_PROMPT_TOKENS, CHAT_TOKENS_PER_MESSAGE

MODEL = "Qwen/Qwen2.5-0.5B-Instruct"


@pytest.fixture
def client(sim: RunningSim) -> OpenAI:
    return OpenAI(base_url=sim.url + "/v1", api_key="EMPTY", max_retries=0)


def raw_events(sim: RunningSim, path: str, body: dict[str, object]) -> list[bytes]:
    with httpx.stream("POST", sim.url + path, json=body, timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        data = response.read()
    return [e.removeprefix(b"data: ") for e in data.split(b"\n\n") if e]


def test_streaming_completion_with_the_openai_client(client: OpenAI) -> None:
    stream = client.completions.create(
        model=MODEL, prompt="word " * 64, max_tokens=8, stream=True, temperature=0.0
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks).count(" ") == 8
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)


def test_completion_chunks_have_vllms_shape_and_key_order(sim: RunningSim) -> None:
    events = raw_events(
        sim, "/v1/completions", {"prompt": "a b c", "max_tokens": 4, "stream": True}
    )
    assert events[-1] == b"[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    first, last = chunks[0], chunks[-1]
    # vLLM 0.32's exclude_unset: no `"usage":null` (0.10 wrote it); the fingerprint only on the
    # terminal chunk, and last. (On a loaded machine the simulator, like vLLM, may merge the
    # tokens of a lagging reader into one chunk: then the first chunk is the terminal one.)
    assert list(first)[:5] == ["id", "object", "created", "model", "choices"]
    if len(chunks) > 1:
        assert list(first) == ["id", "object", "created", "model", "choices"]
    assert first["object"] == "text_completion"
    assert list(first["choices"][0]) == [
        "index",
        "text",
        "logprobs",
        "finish_reason",
        "stop_reason",
    ]
    assert list(last) == ["id", "object", "created", "model", "choices", "system_fingerprint"]
    assert last["choices"][0]["finish_reason"] == "length"
    assert last["system_fingerprint"] == SYSTEM_FINGERPRINT
    assert b" " not in events[0].split(b'"text":')[0]  # compact JSON


def test_chat_stream_starts_role_only_and_ends_with_usage_then_done(sim: RunningSim) -> None:
    body = {
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events = raw_events(sim, "/v1/chat/completions", body)
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert events[-1] == b"[DONE]"
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "usage" not in chunks[0]  # exclude_unset: no usage key on ordinary chunks
    # With include_usage, vLLM 0.32 stamps the fingerprint on the usage chunk, not the terminal.
    assert [list(c)[-1] for c in chunks[-2:]] == ["choices", "system_fingerprint"]
    assert all(list(c["choices"][0]["delta"]) == ["content"] for c in chunks[1:-1])
    words = sum(len(c["choices"][0]["delta"]["content"].split()) for c in chunks[1:-1])
    assert words == 3  # one word per token (a lagging reader may get several in one chunk)
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == []
    prompt = 2 + CHAT_TOKENS_PER_MESSAGE + CHAT_GENERATION_PROMPT_TOKENS
    assert chunks[-1]["usage"] == {
        "prompt_tokens": prompt,
        "total_tokens": prompt + 3,
        "completion_tokens": 3,
    }


def test_continuous_usage_counts_every_chunk(client: OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "word " * 10}],
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
    )
    chunks = list(stream)
    assert all(c.usage is not None for c in chunks)
    running = [c.usage.completion_tokens for c in chunks if c.usage is not None]
    assert running[0] == 0  # the role chunk
    assert running[-2:] == [5, 5]  # the last token chunk, then the include_usage chunk
    # A lagging reader can get several tokens merged in one chunk (as from vLLM): the running
    # count then says exactly how many words the chunk carries.
    for before, after, chunk in zip(running[:-2], running[1:-1], chunks[1:-1], strict=True):
        assert after - before == len((chunk.choices[0].delta.content or "").split()) >= 1


def test_continuous_usage_needs_include_usage(sim: RunningSim) -> None:
    body = {
        "prompt": "a b",
        "max_tokens": 2,
        "stream": True,
        "stream_options": {"include_usage": False, "continuous_usage_stats": True},
    }
    chunks = [orjson.loads(e) for e in raw_events(sim, "/v1/completions", body)[:-1]]
    assert all("usage" not in c for c in chunks) and all(c["choices"] for c in chunks)


def test_non_streaming_completion_and_chat(client: OpenAI) -> None:
    completion = client.completions.create(model=MODEL, prompt="word " * 100, max_tokens=6)
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (100, 6)
    assert completion.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, seed=7
    )
    again = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, seed=7
    )
    assert chat.choices[0].message.content == again.choices[0].message.content  # deterministic
    assert chat.usage is not None and chat.usage.completion_tokens == 4


def test_ignore_eos_false_can_stop_early_only_when_eos_is_enabled(client: OpenAI) -> None:
    # The default server never draws EOS: max_tokens is always honoured.
    out = client.completions.create(
        model=MODEL, prompt="x", max_tokens=20, extra_body={"ignore_eos": False}
    )
    assert out.usage is not None and out.usage.completion_tokens == 20


def test_errors_have_vllms_shape_and_status(sim: RunningSim, client: OpenAI) -> None:
    with pytest.raises(BadRequestError) as too_long:
        client.completions.create(model=MODEL, prompt="word " * 8190, max_tokens=16)
    assert "maximum context length is 8192 tokens" in too_long.value.message
    with pytest.raises(NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    response = httpx.post(
        sim.url + "/v1/completions",
        json={"prompt": "x", "stream_options": {"include_usage": True}},
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert list(error) == ["message", "type", "param", "code"]
    assert error["type"] == "BadRequestError" and error["code"] == 400
    assert httpx.post(sim.url + "/v1/completions", content=b"{nope").status_code == 400
    assert httpx.post(sim.url + "/v1/completions", json={"prompt": "x", "n": 2}).status_code == 400


def test_models_tokenize_detokenize_health_version(sim: RunningSim) -> None:
    models = httpx.get(sim.url + "/v1/models").json()
    assert models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] == 8192
    tokens = httpx.post(sim.url + "/tokenize", json={"prompt": "word " * 64}).json()
    assert (tokens["count"], tokens["max_model_len"], len(tokens["tokens"])) == (64, 8192, 64)
    chat = httpx.post(
        sim.url + "/tokenize", json={"messages": [{"role": "user", "content": "one two"}]}
    ).json()
    assert chat["count"] == 2 + CHAT_TOKENS_PER_MESSAGE + CHAT_GENERATION_PROMPT_TOKENS
    out = httpx.post(
        sim.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3, "seed": 5}
    ).json()
    ids = [sim.state.tokenizer.output_id(5, i) for i in range(3)]
    detok = httpx.post(sim.url + "/detokenize", json={"tokens": ids}).json()
    assert detok["prompt"] == out["choices"][0]["text"]
    health = httpx.get(sim.url + "/health")
    assert health.status_code == 200 and health.headers["x-sim-time-scale"] == "0.1"
    version = httpx.get(sim.url + "/version").json()
    assert version["version"] and version["phasewatch_sim"]["time_scale"] == 0.1
