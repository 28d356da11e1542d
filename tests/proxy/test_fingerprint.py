"""vLLM's `system_fingerprint` reaches the client where vLLM would have put it.

vLLM 0.32 stamps it on the terminal chunk (finish_reason set) when the client did not ask for
usage, and on the closing usage chunk when it did. The proxy always asks for usage and cuts
that chunk for a client that did not, so it holds each terminal chunk until the next event and
splices the fingerprint back in. The scripted upstream's `fingerprint` key behaves like vLLM.
"""

from __future__ import annotations

import itertools
from typing import Any

import httpx
import orjson
import pytest

from tests.conftest import Proxy
from tests.proxy.test_relay_timing import (
    GAP_TOLERANCE_S,
    LEG_TOLERANCE_S,
    assert_ttft,
    stream,
    upstream_log,
)

FINGERPRINT = "vllm-0.32.0-1a2b3c4d"
STAMP = b',"system_fingerprint":"' + FINGERPRINT.encode() + b'"'


def raw_stream(base: str, path: str, script: dict[str, Any],
               options: dict[str, bool] | None = None) -> bytes:
    body: dict[str, Any] = {"model": "scripted", "stream": True}
    body["messages" if "chat" in path else "prompt"] = (
        [{"role": "user", "content": "x"}] if "chat" in path else "x")
    if options is not None:
        body["stream_options"] = options
    with httpx.stream("POST", base + path, json=body, timeout=30,
                      headers={"x-script": orjson.dumps(script).decode()}) as response:
        assert response.status_code == 200
        return response.read()


def events(body: bytes) -> list[bytes]:
    return [e + b"\n\n" for e in body.split(b"\n\n") if e]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_choices_finishing_together_all_get_the_fingerprint(
    proxy: Proxy, scripted_url: str, path: str
) -> None:
    # n=2 finishing together, as vLLM writes them: two terminal chunks, then usage, then [DONE].
    script = {"n": 2, "fingerprint": FINGERPRINT,
              "tokens": [[0.02, "a", 1, 0], [0.02, "b", 1, 1], [0.04, "c", 1, 0]]}
    direct = raw_stream(scripted_url, path, script)
    proxied = raw_stream(proxy.url, path, script)
    assert proxied == direct
    terminal = [e for e in events(proxied) if b'"finish_reason":"length"' in e]
    assert len(terminal) == 2 and all(e.endswith(STAMP + b"}\n\n") for e in terminal)
    assert proxy.next_record().output_tokens == 3


def test_a_choice_that_finishes_early_is_not_held_back(proxy: Proxy, scripted_url: str) -> None:
    """Choice 0 stops while choice 1 goes on: its terminal chunk is held only until the next
    event, which here is not the usage chunk, so it goes out as it came, without the
    fingerprint (known only at the end); holding it longer would delay it. (vLLM 0.32
    interleaves n=2 this way even when both choices stop at max_tokens.)"""
    script = {"n": 2, "fingerprint": FINGERPRINT,
              "tokens": [[0.02, "a", 1, 0], [0.02, "b", 1, 1], [0.04, "c", 1, 0, "stop"],
                         [0.06, "d", 1, 1], [0.08, "e", 1, 1]]}
    direct = events(raw_stream(scripted_url, "/v1/completions", script))
    proxied = events(raw_stream(proxy.url, "/v1/completions", script))
    early = next(i for i, e in enumerate(direct) if b'"finish_reason":"stop"' in e)
    assert STAMP in direct[early]
    assert proxied[:early] == direct[:early]
    assert proxied[early] == direct[early].replace(STAMP, b"")  # the one difference
    assert proxied[early + 1:] == direct[early + 1:]  # the last terminal chunk is stamped
    assert STAMP in proxied[-2]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_holding_the_terminal_chunk_leaves_timing_as_it_was(
    proxy: Proxy, scripted_url: str, path: str
) -> None:
    # The last token rides on the terminal chunk (as in vLLM); the usage chunk comes 150 ms
    # after it instead of at once, so that the hold shows.
    script = {"fingerprint": FINGERPRINT, "usage_at": 0.26,
              "tokens": [[0.05, "Hello", 1], [0.08, " there", 1], [0.11, "!", 1, 0, "length"]]}
    request_id, _, reads = stream(proxy, path, script)
    record = proxy.next_record()
    log = upstream_log(scripted_url, request_id)
    first = 1 if "chat" in path else 0  # the role-only chunk is not a token
    terminal_write, usage_write, done_write = (ns / 1e9 for ns in log["sent_ns"][-3:])
    assert usage_write - terminal_write > 0.1

    # Timed when each read returned: the hold moved nothing.
    assert record.outcome == "ok" and (record.output_tokens, record.itl_count) == (3, 2)
    assert_ttft(record.ttft_s, log, first)
    token_writes = [ns / 1e9 for ns in log["sent_ns"][first:first + 3]]  # 30 ms apart
    gaps = [b - a for a, b in itertools.pairwise(token_writes)]
    assert record.itl_max_s == pytest.approx(max(gaps), abs=GAP_TOLERANCE_S)  # not ~180 ms
    written = done_write - log["arrived_ns"] / 1e9
    assert record.e2e_s is not None
    assert written - 0.001 <= record.e2e_s <= written + LEG_TOLERANCE_S
    # The client got the terminal chunk, stamped, once the event after it had arrived.
    terminal_read = next(t for t, data in reads if b'"finish_reason":"length"' in data)
    assert terminal_read >= usage_write
    body = b"".join(data for _, data in reads)
    assert body == raw_stream(scripted_url, path, script)
    assert body.count(STAMP + b"}\n\n") == 1 and b'"usage"' not in body


def test_nothing_is_held_when_the_client_asked_for_usage(proxy: Proxy, scripted_url: str) -> None:
    script = {"fingerprint": FINGERPRINT, "usage_at": 0.26,
              "tokens": [[0.05, "Hello", 1], [0.08, " there", 1], [0.11, "!", 1, 0, "length"]]}
    request_id, _, reads = stream(proxy, "/v1/completions", script,
                                  {"stream_options": {"include_usage": True}})
    usage_write = upstream_log(scripted_url, request_id)["sent_ns"][-2] / 1e9
    terminal_read = next(t for t, data in reads if b'"finish_reason":"length"' in data)
    assert terminal_read < usage_write - 0.05
    body = b"".join(data for _, data in reads)
    usage_chunk = events(body)[-2]
    assert b'"choices":[]' in usage_chunk and usage_chunk.endswith(STAMP + b"}\n\n")
    assert body.count(b'"system_fingerprint"') == 1
