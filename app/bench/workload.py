"""What gets sent: exact-length prompts and bursts of concurrent streaming requests.

Prompts are the article's `"word " * n`, checked against the server's own `/tokenize` (vLLM and
the simulator both serve it) and corrected until the count is exact, so "256-token prompt"
means 256 prompt tokens on the server that answers, not an estimate.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from time import perf_counter_ns
from typing import Any

import aiohttp
import orjson

from app.bench.client import RequestResult, stream_request

RUN_ID_HEADER = "x-phasewatch-run-id"


class WorkloadError(RuntimeError):
    """The server could not be prepared for (its models, its tokenizer); the message says why."""


async def first_model(session: aiohttp.ClientSession, base_url: str) -> str:
    async with session.get(base_url + "/v1/models") as response:
        if response.status != 200:
            raise WorkloadError(f"{base_url}/v1/models answered {response.status}")
        models = (await response.json(loads=orjson.loads))["data"]
    if not models:
        raise WorkloadError(f"{base_url} serves no models")
    return str(models[0]["id"])


async def count_tokens(
    session: aiohttp.ClientSession, base_url: str, model: str, prompt: str
) -> int:
    async with session.post(
        base_url + "/tokenize", data=orjson.dumps({"model": model, "prompt": prompt}),
        headers={"content-type": "application/json"},
    ) as response:
        if response.status != 200:
            raise WorkloadError(f"{base_url}/tokenize answered {response.status}")
        return int((await response.json(loads=orjson.loads))["count"])


async def exact_prompt(
    session: aiohttp.ClientSession, base_url: str, model: str, tokens: int
) -> str:
    """A prompt of exactly `tokens` tokens by the server's tokenizer ("word " repeated)."""
    words = tokens
    for _ in range(8):
        prompt = "word " * words
        found = await count_tokens(session, base_url, model, prompt)
        if found == tokens:
            return prompt
        words = max(1, words + tokens - found)
    raise WorkloadError(f"could not build a prompt of exactly {tokens} tokens for {model}")


def completion_body(model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """A streamed completion that always generates `max_tokens` (vLLM's `ignore_eos`)."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


@dataclass(frozen=True, slots=True)
class Burst:
    """Requests sent together, and the wall-clock span from the first send to the last end."""

    results: list[RequestResult]
    elapsed_s: float


async def burst(
    session: aiohttp.ClientSession,
    base_url: str,
    body: dict[str, Any],
    concurrency: int,
    run_id: str | None = None,
) -> Burst:
    """Send `concurrency` copies of one completion request at once and wait for them all."""
    headers = {RUN_ID_HEADER: run_id} if run_id else {}
    url = base_url + "/v1/completions"
    start = perf_counter_ns()
    results = await asyncio.gather(
        *(stream_request(session, url, body, headers) for _ in range(concurrency))
    )
    end = max((r.ended_ns for r in results), default=start)
    return Burst(list(results), (end - start) / 1e9)


def client_session(concurrency: int) -> aiohttp.ClientSession:
    """A session with room for `concurrency` open streams and no total timeout."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=max(concurrency, 1) + 4),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=600),
    )
