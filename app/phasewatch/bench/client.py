"""A streaming client that times one request as its caller sees it (aiohttp, one clock).

Clock: `time.monotonic_ns()` throughout (CLOCK_MONOTONIC: one clock for every process on a Linux
host, so a stamp written by a server on the same machine can be compared with it). `sent` is
taken just before the request is handed to aiohttp; every read from the response body gets one
stamp, and each SSE event completed by that read carries it. TTFT is sent -> the first event
carrying output (completion `text`, or a chat delta's content / reasoning / tool calls: the
role-only first chat chunk is not output).
ITL gaps are the intervals between consecutive output-carrying events: one per chunk, so a
chunk that carries several merged tokens gives one (longer) gap. Token counts come from the
server's `usage` (the request should set `stream_options.include_usage`). `output_ns` keeps the
read time of every output-carrying event, for timelines. `trace`, when given, is called with
(read time, event data) for every output event after its time is taken; benchmarks use it to
read a server's own stamps, and it costs nothing when absent.

Errors are counted, never timed: a non-2xx status, an in-band `data: {"error": ...}` event, a
stream that ends without `data: [DONE]`, or a connection failure makes `ok` false and sets
`error`. Nothing here aggregates; see `stats`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from time import monotonic_ns
from typing import Any

import aiohttp
import orjson

from phasewatch.core.events import Kind, classify
from phasewatch.core.sse import SSEDecoder, event_data


@dataclass(slots=True)
class RequestResult:
    """One request, timed on the client's clock (seconds)."""

    ok: bool = False
    status: int | None = None
    error: str | None = None
    request_id: str | None = None  # the response's x-request-id, else the one sent, if any
    sent_ns: int = 0
    ended_ns: int = 0
    ttft_s: float | None = None  # sent -> first output-carrying event
    gaps_s: list[float] = field(default_factory=list)  # between output-carrying events
    output_ns: list[int] = field(default_factory=list)  # read time of each output event
    output_events: int = 0
    prompt_tokens: int | None = None  # from usage
    output_tokens: int | None = None  # from usage

    @property
    def e2e_s(self) -> float:
        """sent -> the last read of the response."""
        return (self.ended_ns - self.sent_ns) / 1e9


async def stream_request(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
    trace: Callable[[int, bytes], None] | None = None,
) -> RequestResult:
    """POST a streaming request to `url` and time it. Never raises for server or network errors."""
    result = RequestResult()
    last_output_ns: int | None = None
    done = False
    output_ns = result.output_ns
    result.request_id = (headers or {}).get("x-request-id")
    result.sent_ns = monotonic_ns()
    try:
        async with session.post(url, data=orjson.dumps(body), headers={
            "content-type": "application/json", **(headers or {})
        }) as response:
            result.status = response.status
            result.request_id = response.headers.get("x-request-id", result.request_id)
            if response.status != 200:
                await response.read()
                result.error = f"http {response.status}"
                return result
            decoder = SSEDecoder()
            async for data in response.content.iter_any():
                now = monotonic_ns()
                for raw in decoder.decode(data):
                    payload = event_data(raw)
                    if payload is None:
                        continue
                    info = classify(payload)
                    if info.kind is Kind.DONE:
                        done = True
                        continue
                    if info.kind is Kind.ERROR:
                        result.error = "in-band error"
                        continue
                    if info.has_usage:
                        result.prompt_tokens = info.prompt_tokens
                        result.output_tokens = info.completion_tokens
                    if info.kind is not Kind.OUTPUT:
                        continue
                    result.output_events += 1
                    output_ns.append(now)
                    if trace is not None:
                        trace(now, payload)
                    if last_output_ns is None:
                        result.ttft_s = (now - result.sent_ns) / 1e9
                    else:
                        result.gaps_s.append((now - last_output_ns) / 1e9)
                    last_output_ns = now
    except (TimeoutError, aiohttp.ClientError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:200]
    finally:
        result.ended_ns = monotonic_ns()
    if result.error is None and not done:
        result.error = "stream ended without [DONE]"
    result.ok = result.error is None
    return result
