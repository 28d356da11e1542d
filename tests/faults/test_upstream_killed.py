"""The upstream process killed (SIGKILL) mid-stream: every client stream ends at once with an
in-band error and `[DONE]`, never hangs, and every request is stored as a stream error with
the tokens it did get.

The upstream is phasewatch's simulator, a real server in its own process; the proxy runs under
uvicorn in a thread, and the clients read the raw event stream.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable

import httpx
import orjson

from tests.conftest import Proxy
from tests.support.served import wait_for
from tests.support.servers import free_port, subprocess_server

STREAMS = 8


async def read_until_killed(url: str, started: asyncio.Event, tokens_seen: list[int],
                            i: int) -> bytes:
    """One long stream; sets `started` once every stream has a token. Returns the body."""
    body = b""
    async with httpx.AsyncClient(timeout=30) as client:
        request = {"model": "sim", "prompt": "hello", "max_tokens": 4000,
                   "stream": True, "ignore_eos": True}
        async with client.stream("POST", url + "/v1/completions", json=request) as response:
            assert response.status_code == 200
            async for chunk in response.aiter_bytes():
                body += chunk
                if b'"text"' in chunk and not tokens_seen[i]:
                    tokens_seen[i] = 1
                    if all(tokens_seen):
                        started.set()
    return body


def test_a_killed_upstream_ends_every_stream_with_an_error_and_keeps_every_record(
    make_proxy: Callable[..., Proxy]
) -> None:
    port = free_port()
    sim = ["-m", "phasewatch.sim", "--port", str(port), "--served-model-name", "sim",
           "--log-level", "warning"]
    with subprocess_server(sim, f"http://127.0.0.1:{port}/health") as upstream:
        proxy = make_proxy(f"http://127.0.0.1:{port}")

        async def scenario() -> list[bytes]:
            started, seen = asyncio.Event(), [0] * STREAMS
            streams = [asyncio.create_task(read_until_killed(proxy.url, started, seen, i))
                       for i in range(STREAMS)]
            await asyncio.wait_for(started.wait(), 30)
            upstream.send_signal(signal.SIGKILL)
            # Ended by the upstream's sockets closing, not by any idle timeout (600 s).
            return await asyncio.wait_for(asyncio.gather(*streams), 20)

        bodies = asyncio.run(scenario())
    for body in bodies:
        events = [e for e in body.split(b"\n\n") if e]
        assert events[-1] == b"data: [DONE]"
        error = orjson.loads(events[-2][len(b"data: "):])["error"]
        assert error["type"] == "upstream_error", error
    records = wait_for(lambda: (r := proxy.stored()) and len(r) == STREAMS and r,
                       timeout=10, says=f"{STREAMS} records")
    assert {r["outcome"] for r in records} == {"stream_error"}
    assert all(r["output_tokens"] and r["ttft_s"] is not None for r in records), records
    assert proxy.sample("phasewatch_requests_total", {
        "model": "sim", "endpoint": "completions", "outcome": "stream_error"}) == STREAMS
