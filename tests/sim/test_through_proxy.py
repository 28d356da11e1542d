"""The simulator's streams reach a client through phasewatch as they would straight from it.

The proxy asks the simulator for usage on every stream and cuts what the client did not ask
for; the simulator, like vLLM 0.32, moves its `system_fingerprint` to the usage chunk when usage
is asked for, so the proxy must also put the fingerprint back on the terminal chunk. Ids and
`created` differ per request, and a lagging reader can get tokens merged into fewer chunks (on
a busy machine, all of them into the terminal chunk), so streams are compared by structure
(keys in order, value types) and text.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import httpx
import orjson
import pytest

from phasewatch.sim import RunningSim
from phasewatch.sim.api import SYSTEM_FINGERPRINT
from tests.conftest import Proxy


def shape(value: Any) -> Any:
    if isinstance(value, dict):
        return [(key, shape(item)) for key, item in value.items()]
    if isinstance(value, list):
        return [shape(item) for item in value]
    return type(value).__name__


def read(base: str, path: str, options: dict[str, bool] | None) -> list[Any]:
    body: dict[str, Any] = {"max_tokens": 5, "stream": True, "seed": 7}
    if "chat" in path:
        body["messages"] = [{"role": "user", "content": "hello there"}]
    else:
        body["prompt"] = "hello there"
    if options is not None:
        body["stream_options"] = options
    with httpx.stream("POST", base + path, json=body, timeout=30) as response:
        assert response.status_code == 200
        data = response.read()
    events = [e.removeprefix(b"data: ") for e in data.split(b"\n\n") if e]
    assert events[-1] == b"[DONE]"
    return [orjson.loads(e) for e in events[:-1]]


def text(chunks: list[Any]) -> str:
    return "".join(c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content")
                   or "" for c in chunks if c["choices"])


def structure(chunks: list[Any]) -> tuple[list[Any], list[Any]]:
    """The shapes of the chunks that are there whatever the merging (the chat role chunk, the
    terminal chunk, the usage chunk), and the distinct shapes of the token chunks between."""
    def between(chunk: Any) -> bool:
        choice = chunk["choices"][0] if chunk["choices"] else {}
        return bool(choice) and choice["finish_reason"] is None and "role" not in choice.get(
            "delta", {})

    fixed = [shape(c) for c in chunks if not between(c)]
    tokens = [shape(c) for c in chunks if between(c)]
    return fixed, [s for i, s in enumerate(tokens) if s not in tokens[:i]]


@pytest.mark.parametrize(("path", "options"), list(itertools.product(
    ["/v1/completions", "/v1/chat/completions"],
    [None, {"include_usage": True}, {"include_usage": True, "continuous_usage_stats": True}])),
    ids=lambda v: str(v).replace(" ", ""))
def test_streams_through_the_proxy_have_the_simulator_s_shape(
    sim: RunningSim, make_proxy: Callable[..., Proxy], path: str,
    options: dict[str, bool] | None,
) -> None:
    proxy = make_proxy(sim.url)
    direct = read(sim.url, path, options)
    proxied = read(proxy.url, path, options)
    (fixed, tokens), (direct_fixed, direct_tokens) = structure(proxied), structure(direct)
    assert fixed == direct_fixed
    assert tokens == direct_tokens or not tokens or not direct_tokens
    assert text(proxied) == text(direct)
    # The fingerprint is on the stream's last chunk, wherever the client's options put it.
    stamped = [c for c in proxied if "system_fingerprint" in c]
    assert stamped == [proxied[-1]] and proxied[-1]["system_fingerprint"] == SYSTEM_FINGERPRINT
    assert (proxied[-1]["choices"] == []) == (options is not None)
    record = proxy.next_record()
    assert record.outcome == "ok" and record.output_tokens == 5 and record.tokens_exact
