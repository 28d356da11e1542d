"""What gets sent: the served model, request bodies, and bursts of concurrent streaming requests.

`exact_prompt` is the article's `"word " * n`, checked against the server's own `/tokenize`
(vLLM and the simulator both serve it) and corrected until the count is exact, so "256-token
prompt" means 256 prompt tokens on the server that answers; it refuses a server without
`/tokenize` (`phasewatch.bench.prompts` has the fallbacks the bench uses).
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from time import monotonic_ns
from typing import Any

import aiohttp
import orjson

from phasewatch.bench.client import RequestResult, stream_request
from phasewatch.bench.errors import WorkloadError
from phasewatch.bench.prompts import SERVER, PromptBuilder

RUN_ID_HEADER = "x-phasewatch-run-id"
REQUEST_ID_HEADER = "x-request-id"
ADMIN_TOKEN_VARIABLE = "PHASEWATCH_ADMIN_TOKEN"


def admin_headers() -> dict[str, str]:
    """phasewatch's admin token, from the variable the proxy itself reads: it opens `/api` and
    lets the run id be honoured. Empty when it is unset (a proxy opened to all needs none)."""
    token = os.environ.get(ADMIN_TOKEN_VARIABLE)
    return {"x-phasewatch-admin-token": token} if token else {}

__all__ = [
    "RUN_ID_HEADER",
    "Burst",
    "WorkloadError",
    "admin_headers",
    "burst",
    "client_session",
    "completion_body",
    "exact_prompt",
    "first_model",
]


async def first_model(session: aiohttp.ClientSession, base_url: str) -> str:
    async with session.get(base_url + "/v1/models") as response:
        if response.status != 200:
            raise WorkloadError(f"{base_url}/v1/models answered {response.status}")
        models = (await response.json(loads=orjson.loads))["data"]
    if not models:
        raise WorkloadError(f"{base_url} serves no models")
    return str(models[0]["id"])


async def exact_prompt(
    session: aiohttp.ClientSession, base_url: str, model: str, tokens: int
) -> str:
    """A prompt of exactly `tokens` tokens by the server's own tokenizer ("word " repeated)."""
    builder = PromptBuilder(session, base_url, model)
    if await builder.choose() != SERVER:
        raise WorkloadError(f"{base_url}/tokenize did not answer: prompt lengths cannot be exact")
    return (await builder.prompt(tokens)).text


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
    headers = {RUN_ID_HEADER: run_id, **admin_headers()} if run_id else {}
    url = base_url + "/v1/completions"
    start = monotonic_ns()
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
