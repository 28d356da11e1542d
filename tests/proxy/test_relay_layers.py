"""The relay's own layers against real servers: the client leg, the ASGI fallback, the pool.

phasewatch's server protocol stamps a request's arrival when its first bytes are read and lets
the relay write each read straight to the client; under any other ASGI server the relay must
send the same bytes and keep the same figures. Upstream connections are pooled and reused,
and one that the upstream closed as it was being reused is retried once on a new connection.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any, TypeVar

import httpx
import orjson
import pytest

from tests.conftest import Proxy
from tests.proxy.test_relay_timing import LEG_TOLERANCE_S, stream, upstream_log
from tests.proxy.test_transparency import SCRIPT, raw_stream

BODY = {"model": "scripted", "prompt": "x", "stream": True}
T = TypeVar("T", bound="ClosingUpstream")


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_under_another_asgi_server_the_stream_and_figures_are_the_same(
    make_proxy: Any, scripted_url: str, http: str
) -> None:
    proxy = make_proxy(scripted_url, http=http)
    direct = raw_stream(scripted_url, "/v1/completions", BODY)
    assert raw_stream(proxy.url, "/v1/completions", BODY) == direct
    record = proxy.next_record()
    assert record.outcome == "ok" and record.output_tokens == 4 and record.itl_count == 3
    # A client that leaves is still noticed (through ASGI's receive), and aborts the upstream.
    request_id, _, _ = stream(proxy, "/v1/completions", {"tokens": [[0.02, "a", 1]]})
    assert proxy.next_record().request_id == request_id


def test_arrival_is_when_the_first_bytes_are_read(proxy: Proxy, scripted_url: str) -> None:
    """A request whose headers trickle in: the wait is inside its TTFT and its proxy queueing,
    as the client lived through it (an app-level clock would start after the headers)."""
    body = orjson.dumps({**BODY, "max_tokens": 1})
    head = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"x-request-id: trickle-1\r\nx-script: " + orjson.dumps(SCRIPT) + b"\r\n")
    port = int(proxy.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as sock:
        started = time.monotonic()
        sock.sendall(head)
        sent_head = time.monotonic()
        time.sleep(0.3)  # the client is slow: this is the wait being measured, not a sync
        resumed = time.monotonic()
        sock.sendall(b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        sent_all = time.monotonic()
        sock.settimeout(10)
        received = b""
        while not received.endswith(b"0\r\n\r\n"):
            received += sock.recv(65536)
    record = proxy.next_record()
    log = upstream_log(scripted_url, "trickle-1")
    # The wait, as the client made it; the proxy may read the first bytes a little after they
    # were sent (a loop turn), so the lower bound gives it 10 ms.
    least, most = resumed - sent_head - 0.01, sent_all - started
    assert record.ttft_s is not None and record.ttft_s >= least
    written = (log["sent_ns"][0] - log["arrived_ns"]) / 1e9  # the upstream's own part
    assert record.ttft_s <= most + written + LEG_TOLERANCE_S
    assert proxy.sample("phasewatch_proxy_queue_seconds_count") == 1
    assert proxy.sample("phasewatch_proxy_queue_seconds_sum") >= least


def test_upstream_connections_are_kept_alive_and_reused(proxy: Proxy) -> None:
    for _ in range(5):
        stream(proxy, "/v1/completions", {"tokens": [[0.01, "a", 1]]})
        proxy.next_record()
    pool = proxy.server.app.state.proxy.pool
    assert pool.open_connections == 1


class ClosingUpstream:
    """A transport double: answers each connection's first request, keeps the connection
    open as if kept alive, and closes it without a word when a second request arrives on it,
    the way an upstream's keep-alive timeout crosses a reused connection's request."""

    def __init__(self) -> None:
        self.connections = 0
        self.port = 0
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(
            asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self.ready.set()
        self.loop.run_forever()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        answered = 0
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):  # the proxy closed it
                writer.close()
                return
            _, _, rest = head.lower().partition(b"content-length: ")
            await reader.readexactly(int(rest.split(b"\r\n")[0] or 0))
            if answered:
                writer.close()
                return
            payload = b'{"choices":[{"text":"hi"}],"usage":{"completion_tokens":1}}'
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%b" % (len(payload), payload))
            answered += 1


def running(upstream: T) -> Iterator[T]:
    """Serve a double on its own thread and loop for the length of a fixture."""
    upstream.thread.start()
    upstream.ready.wait(5)
    yield upstream
    upstream.loop.call_soon_threadsafe(upstream.loop.stop)


@pytest.fixture
def closing_upstream() -> Iterator[ClosingUpstream]:
    yield from running(ClosingUpstream())


def test_a_reused_connection_closed_by_the_upstream_is_retried_once(
    closing_upstream: ClosingUpstream, make_proxy: Any
) -> None:
    proxy = make_proxy(f"http://127.0.0.1:{closing_upstream.port}",
                       engine_metrics_enabled=False, diagnosis_interval_s=0)
    for _ in range(3):
        response = httpx.post(proxy.url + "/v1/completions", json={"model": "m", "prompt": "x"})
        assert response.status_code == 200 and response.json()["choices"][0]["text"] == "hi"
    assert [proxy.next_record().outcome for _ in range(3)] == ["ok"] * 3
    assert closing_upstream.connections == 3  # each reuse failed, and was retried once


class CloseDelimitedUpstream(ClosingUpstream):
    """A transport double for an upstream that ends its body by closing the connection (no
    content-length, not chunked), as HTTP/1.0-style servers do."""

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        _, _, rest = head.lower().partition(b"content-length: ")
        body = orjson.loads(await reader.readexactly(int(rest.split(b"\r\n")[0] or 0)))
        if body.get("stream"):
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"connection: close\r\n\r\n")
            for i in range(3):
                usage = {"prompt_tokens": 1, "completion_tokens": i + 1}
                chunk = {"choices": [{"index": 0, "text": f"t{i}"}], "usage": usage}
                writer.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
                await writer.drain()
            writer.write(b"data: [DONE]\n\n")
        else:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                         b"connection: close\r\n\r\n"
                         b'{"choices":[{"text":"hi"}],"usage":{"completion_tokens":1}}')
        await writer.drain()
        writer.close()


@pytest.fixture
def close_delimited_upstream() -> Iterator[CloseDelimitedUpstream]:
    yield from running(CloseDelimitedUpstream())


def test_a_body_ended_by_closing_the_connection_is_relayed_whole(
    close_delimited_upstream: CloseDelimitedUpstream, make_proxy: Any
) -> None:
    proxy = make_proxy(f"http://127.0.0.1:{close_delimited_upstream.port}",
                       engine_metrics_enabled=False, diagnosis_interval_s=0)
    response = httpx.post(proxy.url + "/v1/completions", json={"model": "m", "prompt": "x"})
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == "hi"
    with httpx.stream("POST", proxy.url + "/v1/completions",
                      json={"model": "m", "prompt": "x", "stream": True}) as streamed:
        body = streamed.read()
    assert body.count(b'"text":"t') == 3 and body.endswith(b"data: [DONE]\n\n")
    assert b"usage" not in body  # asked for by phasewatch, cut for the client
    records = [proxy.next_record() for _ in range(2)]
    assert [r.outcome for r in records] == ["ok", "ok"]
    assert records[1].output_tokens == 3 and records[1].itl_count == 2
