"""The first token when its text is empty: a real vLLM holding back a partial UTF-8 character.

The test model's tokenizer is byte-level: byte 0xC3 alone is a token, and it is the first half
of a two-byte character. Restricted to that one token (`allowed_token_ids`), vLLM generates
0xC3 bytes; after the first it has no complete character to show, so its first chunk has empty
text while its running usage already counts one token (the case seen in 1 of 120 streams of
ordinary traffic). Here no later byte completes a character either, so the whole stream is
tokens without text: taken by its text, it had no first token and no gaps at all. vLLM's own
TTFT counts that chunk, and so must phasewatch: TTFT is taken at it, and an n-token stream has
exactly n - 1 ITL samples.
"""

from __future__ import annotations

import json

from tests.conftest import Proxy
from tests.vllm.server import VLLMServer
from tests.vllm.streams import output_text, stream, token_prompt

OUTPUT_TOKENS = 8
LEAD_BYTE = "\u00c3"  # byte 0xC3 as byte-level BPE writes it in the vocabulary


def test_an_empty_first_chunk_that_counts_a_token_is_the_first_token(
    vllm_server: VLLMServer, vllm_proxy: Proxy
) -> None:
    vocab = json.loads((vllm_server.model_dir / "tokenizer.json").read_text())["model"]["vocab"]
    body = {"model": vllm_server.model, "prompt": token_prompt(16, 7),
            "max_tokens": OUTPUT_TOKENS, "ignore_eos": True, "temperature": 0,
            "allowed_token_ids": [vocab[LEAD_BYTE]]}
    # The premise, read straight from vLLM: the first chunk has no text and one token.
    direct = stream(vllm_server.url, "/v1/completions",
                    {**body, "stream_options": {"include_usage": True,
                                                "continuous_usage_stats": True}})
    first = direct.chunks[0]
    assert output_text(first) == "" and first["usage"]["completion_tokens"] == 1, first

    through = stream(vllm_proxy.url, "/v1/completions", body)
    assert through.status == 200
    # The client (no usage asked) gets that chunk too: the first event of the stream.
    events = [e for e in through.events if e.data != b"[DONE]"]
    assert output_text(events[0].json()) == ""
    record = vllm_proxy.next_record()
    assert record.outcome == "ok" and record.tokens_exact
    assert record.output_tokens == OUTPUT_TOKENS
    assert record.itl_count == OUTPUT_TOKENS - 1  # not one gap too few
    # TTFT ends at that first (empty) chunk: no later than the client read it.
    assert record.ttft_s is not None
    assert record.ttft_s <= events[0].at - through.sent + 0.001
