"""The native relay (app/phasewatch/proxy/native.py, _native.c) changes nothing a client or a record
sees.

Each stream here goes through two proxies under uvicorn, one with the native relay and one
without, from a raw upstream that writes exactly the HTTP/1.1 chunks a test scripts (so a
chunk the native leg must give back can be put mid-stream): the bytes each client receives,
and the records, are the same; and the native leg really took the streams, more than once per
stream where one of its chunks had to go back to Python. Also through it: an upstream that
breaks off mid-stream, a client that leaves, a client that stops reading for a while.
"""

from __future__ import annotations

import asyncio
import gc
import os
import socket
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from importlib import import_module
from typing import Any

import httptools
import httpx
import orjson
import pytest

from tests.conftest import Proxy
from tests.support.served import parse_metrics, total

pytest.importorskip("phasewatch.proxy._native", reason="the native relay is not built here")

HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
        b"transfer-encoding: chunked\r\n\r\n")


def _frame(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


def _event(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _chunk(text: str | None, completion: int, finish: str | None = None,
           role: bool = False) -> bytes:
    delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {"content": text}
    return _event({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
                   "model": "m", "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                              "finish_reason": finish}],
                   "usage": {"prompt_tokens": 7, "total_tokens": 7 + completion,
                             "completion_tokens": completion}})


def _ending(completion: int) -> list[bytes]:
    """The terminal chunk, the usage chunk and [DONE], each in its own chunk, then the end."""
    return [_frame(_chunk("", completion, finish="length")),
            _frame(_event({"id": "chatcmpl-1", "choices": [], "system_fingerprint": "fp_1",
                           "usage": {"prompt_tokens": 7, "total_tokens": 7 + completion,
                                     "completion_tokens": completion}})),
            _frame(b"data: [DONE]\n\n"), b"0\r\n\r\n"]


def _tokens(first: int, last: int, pad: int = 1) -> list[bytes]:
    return [_frame(_chunk(f"t{i}" * pad, i)) for i in range(first, last + 1)]


class RawUpstream:
    """An upstream that answers every request with the writes of `script` (bytes, each sent
    on its own 2 ms after the last; a float: a pause of that many seconds; None: close the
    connection there)."""

    def __init__(self) -> None:
        self.script: list[bytes | float | None] = []
        self.head_delay = 0.0  # seconds before the head (a queue, a prefill)
        self.head = HEAD  # the response's head, written before the script
        self.streamed_on = 0  # connections that carried a streamed request
        self.bodies: list[bytes] = []  # every request's body, as it came
        self.closed_by_peer = threading.Event()  # a write failed: the proxy closed the stream
        self.blocked = threading.Event()  # a write did not fit the socket: back-pressure
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self.port = 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._ready.wait(10)
        self.url = f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(
            asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()
        server.close()
        tasks = asyncio.all_tasks(self._loop)
        for task in tasks:
            task.cancel()
        self._loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        self._loop.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        counted = False
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if not counted and head.startswith(b"POST /v1/"):
                    self.streamed_on += 1
                    counted = True
                length = 0
                for line in head.split(b"\r\n"):
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                self.bodies.append(await reader.readexactly(length))
                if self.head_delay:
                    await asyncio.sleep(self.head_delay)
                writer.write(self.head)
                for data in self.script:
                    if isinstance(data, float):
                        await asyncio.sleep(data)
                        continue
                    await asyncio.sleep(0.002)
                    if data is None:
                        writer.transport.abort()
                        return
                    writer.write(data)
                    if writer.transport.get_write_buffer_size():
                        self.blocked.set()
                    await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            self.closed_by_peer.set()
        finally:
            writer.transport.abort()

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


@pytest.fixture
def raw_upstream() -> Iterator[RawUpstream]:
    upstream = RawUpstream()
    yield upstream
    upstream.stop()


@pytest.fixture
def two_proxies(make_proxy: Callable[..., Proxy],
                raw_upstream: RawUpstream) -> tuple[Proxy, Proxy]:
    return (make_proxy(raw_upstream.url, native_relay=True),
            make_proxy(raw_upstream.url, native_relay=False))


def _stream(url: str, body: dict[str, Any]) -> bytes:
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        return b"".join(response.iter_raw())


def _sent(proxy: Proxy) -> socket.socket:
    """A raw connection to `proxy` on which a streamed chat request (ASK) has been sent."""
    host, port = proxy.url.removeprefix("http://").split(":")
    body = orjson.dumps(ASK)
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                 b"application/json\r\ncontent-length: %d\r\n\r\n%b" % (len(body), body))
    return sock


def _native_streams(proxy: Proxy) -> float:
    return proxy.sample("phasewatch_native_relay_streams_total")


ASK = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
ASK_USAGE = {**ASK, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
MIXED = [
    _frame(_chunk(None, 0, role=True)),
    *_tokens(1, 40),
    _frame(_chunk("s", 41)[:30]) + _frame(_chunk("s", 41)[30:]),  # one event in two chunks
    *_tokens(42, 60),
    _frame(_chunk("a", 61) + _chunk("b", 62)),  # two events in one chunk
    *_tokens(63, 70),
    _frame(b'data: {"id": "c", "choices": [{"index": 0, "delta": {"content": "s"}, '
           b'"finish_reason": null}], "usage": {"prompt_tokens": 7, "completion_tokens": 71}}'
           b"\n\n"),  # spaced JSON
    *_tokens(72, 80),
    _frame(_chunk("x", 81)[:-1]), _frame(b"\n"),  # the blank line in a chunk of its own
    *_tokens(82, 90),
    *_ending(90),
]


@pytest.mark.parametrize("body", [ASK, ASK_USAGE], ids=["usage-cut", "usage-asked"])
def test_the_client_gets_the_same_bytes_and_the_record_the_same_figures(
        two_proxies: tuple[Proxy, Proxy], raw_upstream: RawUpstream,
        body: dict[str, Any]) -> None:
    raw_upstream.script = MIXED
    native, python = two_proxies
    got = _stream(native.url, body)
    assert got == _stream(python.url, body)
    assert got.endswith(b"data: [DONE]\n\n")
    if body is ASK:
        assert b'"usage"' not in got and b'"system_fingerprint":"fp_1"' in got
    # Taken at the first token chunk and again after each chunk it gave back.
    assert _native_streams(native) >= 4
    assert _native_streams(python) == 0
    mine, theirs = native.next_record(), python.next_record()
    assert mine.outcome == theirs.outcome == "ok"
    assert mine.output_tokens == theirs.output_tokens == 90
    assert mine.prompt_tokens == theirs.prompt_tokens == 7
    assert mine.tokens_exact and theirs.tokens_exact
    assert mine.itl_count == theirs.itl_count == 89
    itl = "phasewatch_inter_token_latency_seconds_count"
    labels = {"model": "m", "endpoint": "chat.completions"}
    assert native.sample(itl, labels) == python.sample(itl, labels) == 89


def _count_as(event: bytes, count: bytes) -> bytes:
    """The chunk with its running completion count written as `count` (raw JSON)."""
    head, _, tail = event.rpartition(b'"completion_tokens":')
    return head + b'"completion_tokens":' + count + tail[tail.index(b"}"):]


@pytest.mark.parametrize("body", [ASK, ASK_USAGE], ids=["usage-cut", "usage-asked"])
def test_a_running_count_that_is_not_one_is_read_as_absent_alike(
        two_proxies: tuple[Proxy, Proxy], raw_upstream: RawUpstream,
        body: dict[str, Any]) -> None:
    """Chunks whose running count is past MAX_TOKEN_COUNT, negative, a string or a float (a
    broken upstream) carry their tokens into the next count, on both paths: the client gets
    every byte as the upstream sent it (what the client asked for), the record the right
    totals, and nothing is expanded into 2**40 token gaps."""
    broken = {11: b"1099511627776", 15: b"-3", 20: b'"20"', 25: b"25.0"}
    raw_upstream.script = [_frame(_chunk(None, 0, role=True)), *[
        _frame(_count_as(_chunk(f"t{i}", i), broken[i]) if i in broken else _chunk(f"t{i}", i))
        for i in range(1, 31)], *_ending(30)]
    native, python = two_proxies
    got = _stream(native.url, body)
    assert got == _stream(python.url, body)
    assert got.endswith(b"data: [DONE]\n\n")
    if body is ASK_USAGE:  # relayed as they came
        assert b'"completion_tokens":1099511627776' in got and b'"completion_tokens":"20"' in got
    for record in (native.next_record(), python.next_record()):
        assert (record.outcome, record.output_tokens, record.prompt_tokens) == ("ok", 30, 7)
        assert record.tokens_exact and record.itl_count == 29
    itl = "phasewatch_inter_token_latency_seconds_count"
    labels = {"model": "m", "endpoint": "chat.completions"}
    assert native.sample(itl, labels) == python.sample(itl, labels) == 29


def test_a_whole_answers_count_that_is_not_one_is_read_as_absent(
        make_proxy: Callable[..., Proxy], raw_upstream: RawUpstream) -> None:
    """A non-streamed answer whose usage holds no counts (2**40, a string): the client gets
    the body as it came, and the record holds no token counts rather than those."""
    body = (b'{"id":"c","object":"chat.completion","model":"m","choices":[{"index":0,'
            b'"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],'
            b'"usage":{"prompt_tokens":"7","completion_tokens":1099511627776}}')
    raw_upstream.head = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n" % len(body))
    raw_upstream.script = [body]
    proxy = make_proxy(raw_upstream.url)
    answer = httpx.post(proxy.url + "/v1/chat/completions", json={**ASK, "stream": False},
                        timeout=30)
    assert answer.status_code == 200 and answer.content == body
    record = proxy.next_record()
    assert (record.outcome, record.output_tokens, record.prompt_tokens) == ("ok", None, None)


def test_a_write_larger_than_the_native_legs_buffer_is_relayed_whole(
        two_proxies: tuple[Proxy, Proxy], raw_upstream: RawUpstream) -> None:
    # Once the thread holds the stream, ~220 KB arrive in one write with the stream's end in
    # it and nothing after: more than one read of its 64 KB buffer, and no later arrival to
    # say the rest is there. Every byte must still be read and relayed.
    burst = b"".join([*_tokens(4, 900, pad=8), *_ending(900)])
    assert len(burst) > 3 * 64 * 1024
    raw_upstream.script = [_frame(_chunk(None, 0, role=True)), *_tokens(1, 3), burst]
    native, python = two_proxies
    got = _stream(native.url, ASK)
    assert got == _stream(python.url, ASK)
    assert got.endswith(b"data: [DONE]\n\n")
    mine, theirs = native.next_record(), python.next_record()
    assert mine.outcome == theirs.outcome == "ok"
    assert mine.output_tokens == theirs.output_tokens == 900
    assert mine.itl_count == theirs.itl_count == 899
    assert _native_streams(native) >= 1


def test_a_held_terminal_chunk_keeps_its_own_read_time(
        two_proxies: tuple[Proxy, Proxy], raw_upstream: RawUpstream) -> None:
    # The last token comes in the terminal chunk; the usage chunk that releases it comes
    # 0.3 s later. The thread holds the terminal chunk as Python does (the client did not ask
    # for usage), and its token is timed at its own read, not at the usage chunk's.
    terminal, usage, done, end = _ending(11)
    terminal = _frame(_chunk("z", 11, finish="length"))
    raw_upstream.script = [_frame(_chunk(None, 0, role=True)), *_tokens(1, 10), terminal, 0.3,
                           usage, done, end]
    native, python = two_proxies
    got = _stream(native.url, ASK)
    assert got == _stream(python.url, ASK)
    assert b'"finish_reason":"length"}],"system_fingerprint":"fp_1"}' in got
    mine, theirs = native.next_record(), python.next_record()
    assert mine.outcome == theirs.outcome == "ok"
    assert mine.output_tokens == theirs.output_tokens == 11
    assert mine.itl_count == theirs.itl_count == 10
    assert mine.itl_max_s is not None and theirs.itl_max_s is not None
    assert mine.itl_max_s < 0.2 and theirs.itl_max_s < 0.2  # not the 0.3 s pause after it
    assert mine.e2e_s is not None and mine.e2e_s >= 0.3  # [DONE] came after the pause
    assert _native_streams(native) >= 1


def test_an_upstream_that_breaks_off_mid_stream_is_reported_alike(
        two_proxies: tuple[Proxy, Proxy], raw_upstream: RawUpstream) -> None:
    raw_upstream.script = [_frame(_chunk(None, 0, role=True)), *_tokens(1, 30), None]
    native, python = two_proxies
    got = _stream(native.url, ASK)
    assert got == _stream(python.url, ASK)
    assert b"upstream stream broke" in got and got.endswith(b"data: [DONE]\n\n")
    mine, theirs = native.next_record(), python.next_record()
    assert mine.outcome == theirs.outcome == "stream_error"
    assert mine.error == theirs.error
    assert mine.output_tokens == theirs.output_tokens == 30
    assert _native_streams(native) >= 1


def test_what_a_read_held_before_invalid_framing_still_reaches_the_client(
        two_proxies: tuple[Proxy, Proxy], raw_upstream: RawUpstream) -> None:
    # One write: a whole token chunk, then a chunk size line that is not one. Each read's
    # output goes out when the read is parsed; the parser's fault must not swallow what the
    # read held before it.
    raw_upstream.script = [_frame(_chunk(None, 0, role=True)), *_tokens(1, 5),
                           _frame(_chunk("t6", 6)) + b"zz\r\n"]
    native, python = two_proxies
    for proxy in (native, python):
        got = _stream(proxy.url, ASK)
        assert b'"content":"t6"' in got
        assert b"invalid HTTP response" in got and got.endswith(b"data: [DONE]\n\n")
        record = proxy.next_record()
        assert record.outcome == "stream_error" and record.output_tokens == 6


def test_a_client_that_leaves_mid_stream_closes_the_upstream(
        make_proxy: Callable[..., Proxy], raw_upstream: RawUpstream) -> None:
    raw_upstream.script = [_frame(_chunk(None, 0, role=True)), *_tokens(1, 5000),
                           *_ending(5000)]
    proxy = make_proxy(raw_upstream.url, native_relay=True)
    with _sent(proxy) as sock:
        seen = b""
        while seen.count(b"data: ") < 20:  # well into the native leg's part
            seen += sock.recv(65536)
    assert raw_upstream.closed_by_peer.wait(10)  # the engine learns the client left
    record = proxy.next_record()
    assert record.outcome == "cancelled"
    assert 19 <= record.output_tokens < 5000
    assert _native_streams(proxy) >= 1


def test_an_upstream_silent_before_its_head_times_out_alike(
        make_proxy: Callable[..., Proxy], raw_upstream: RawUpstream) -> None:
    # The idle timeout answers a request with no head yet alike on both paths (the native leg
    # takes a stream only from its body).
    raw_upstream.head_delay = 3.0
    raw_upstream.script = [_frame(_chunk(None, 0, role=True)), *_tokens(1, 3), *_ending(3)]
    native = make_proxy(raw_upstream.url, native_relay=True, upstream_idle_timeout_s=0.3)
    python = make_proxy(raw_upstream.url, native_relay=False, upstream_idle_timeout_s=0.3)
    answers = []
    for proxy in (native, python):
        response = httpx.post(proxy.url + "/v1/chat/completions", json=ASK, timeout=10)
        answers.append((response.status_code, response.json()["error"]["type"]))
    assert answers[0] == answers[1] == (504, "upstream_timeout")
    mine, theirs = native.next_record(), python.next_record()
    assert mine.outcome == theirs.outcome == "timeout"
    assert mine.http_status == theirs.http_status
    assert _native_streams(native) == _native_streams(python) == 0


def test_an_upstream_silent_mid_stream_times_out_while_the_native_leg_holds_it(
        make_proxy: Callable[..., Proxy], raw_upstream: RawUpstream) -> None:
    # A held stream's clocks are the thread's: the live registry reads them when the thread
    # names the stream as past a timeout (`NativeRelay.due`), not on every pass.
    raw_upstream.script = [_frame(_chunk(None, 0, role=True)), *_tokens(1, 10), 30.0,
                           *_ending(10)]
    proxy = make_proxy(raw_upstream.url, native_relay=True, upstream_idle_timeout_s=0.5)
    started = time.monotonic()
    got = _stream(proxy.url, ASK)
    took = time.monotonic() - started
    assert b'"content":"t10"' in got and b"went silent past the idle timeout" in got
    assert got.endswith(b"data: [DONE]\n\n")
    assert 0.5 <= took < 5.0  # the upstream's pause is 30 s: the timeout ended it
    record = proxy.next_record()
    assert record.outcome == "timeout" and record.output_tokens == 10
    assert _native_streams(proxy) == 1


def test_a_client_that_stops_reading_is_ended_while_the_native_leg_holds_it(
        make_proxy: Callable[..., Proxy], raw_upstream: RawUpstream) -> None:
    raw_upstream.script = [_frame(_chunk(None, 0, role=True)), *_tokens(1, 3000, pad=8000),
                           *_ending(3000)]
    proxy = make_proxy(raw_upstream.url, native_relay=True, client_stall_timeout_s=0.5)
    with _sent(proxy) as sock:
        seen = b""
        while b'"content":"t1' not in seen:  # into the tokens, then it stops reading
            seen += sock.recv(65536)
        assert raw_upstream.blocked.wait(20)  # every buffer between is full
        assert raw_upstream.closed_by_peer.wait(10)  # ended: the engine is told to stop
    record = proxy.next_record()
    assert record.outcome == "cancelled"
    assert record.error == "client stopped reading past the client stall timeout"
    assert 0 < record.output_tokens < 3000
    assert _native_streams(proxy) >= 1


def test_a_client_that_leaves_before_the_head_closes_the_upstream(
        make_proxy: Callable[..., Proxy], raw_upstream: RawUpstream) -> None:
    raw_upstream.head_delay = 0.5
    raw_upstream.script = [_frame(_chunk(None, 0, role=True)), *_tokens(1, 5000),
                           *_ending(5000)]
    proxy = make_proxy(raw_upstream.url, native_relay=True)
    with _sent(proxy):
        while not raw_upstream.bodies:  # the upstream has the request, not yet answered
            threading.Event().wait(0.01)
    assert raw_upstream.closed_by_peer.wait(10)  # the engine learns the client left
    record = proxy.next_record()
    assert record.outcome == "cancelled" and record.ttft_s is None


@pytest.mark.parametrize("lines", [
    [b"a:b"] * 1600,  # once written one byte too far per line by the native head reader
    [b"x-h%d:%d" % (i, i) for i in range(472)],  # once aborted the process
], ids=["1600-compact-lines", "472-compact-headers"])
def test_an_upstream_head_of_compact_header_lines_is_relayed_as_any(
        two_proxies: tuple[Proxy, Proxy], raw_upstream: RawUpstream,
        lines: list[bytes]) -> None:
    """The crash inputs of the native head reader, which is gone (llhttp reads every head):
    the stream and its headers reach the client as through the Python path."""
    raw_upstream.head = (b"HTTP/1.1 200 OK\r\ncontent-type:text/event-stream\r\n"
                         b"transfer-encoding:chunked\r\n" + b"\r\n".join(lines) + b"\r\n\r\n")
    raw_upstream.script = [_frame(_chunk(None, 0, role=True)), *_tokens(1, 5), *_ending(5)]
    native, python = two_proxies
    answers = []
    for proxy in (native, python):
        with httpx.stream("POST", proxy.url + "/v1/chat/completions", json=ASK,
                          timeout=30) as response:
            assert response.status_code == 200
            answers.append((sorted((k, v) for k, v in response.headers.multi_items()
                                   if k not in ("date", "x-request-id")),
                            b"".join(response.iter_raw())))
    assert answers[0] == answers[1]
    headers, body = answers[0]
    theirs = {"content-type", "transfer-encoding", "server"}  # the server's and the framing's
    assert len([k for k, _ in headers if k not in theirs]) == len(lines)
    assert body.endswith(b"data: [DONE]\n\n")
    assert native.next_record().output_tokens == python.next_record().output_tokens == 5


@pytest.mark.parametrize("body", [b'{"model":1e400,"stream":true}', b'{"stream":true,',
                                  b'[1,2]', b'{"model":"m","stream":true,"n":1e999}'],
                         ids=["overflowing-number", "cut-json", "not-an-object", "huge-n"])
def test_a_body_the_proxy_cannot_plan_goes_upstream_as_it_came_and_is_answered(
        two_proxies: tuple[Proxy, Proxy], raw_upstream: RawUpstream, body: bytes) -> None:
    """Every such request is answered (here by the upstream, which the body reaches byte for
    byte) and stored, on a kept connection as on a new one, on both paths."""
    raw_upstream.script = [_frame(_chunk(None, 0, role=True)), *_tokens(1, 3), *_ending(3)]
    for proxy in two_proxies:
        with httpx.Client(base_url=proxy.url, timeout=10) as client:
            for _ in range(2):  # the second on the kept connection
                response = client.post("/v1/chat/completions", content=body,
                                       headers={"content-type": "application/json"})
                assert response.status_code == 200
                assert response.text.endswith("data: [DONE]\n\n")
                record = proxy.next_record()
                assert record.outcome == "ok" and record.http_status == 200
    assert [b for b in raw_upstream.bodies if b] == [body] * 4  # (GETs of /metrics: no body)


def test_a_failed_relay_thread_ends_its_streams_in_band_and_relays_in_python_after(
        make_proxy: Callable[..., Proxy], raw_upstream: RawUpstream) -> None:
    """The thread's loop failing (its epoll_wait, made to fail here: `fault()`) strands
    nothing: every stream it held gets what was read for it, then an in-band error and [DONE],
    and is recorded `internal_error`; the failure is logged, counted and shown by
    /api/health, and later streams are relayed in Python to their end."""
    raw_upstream.script = [_frame(_chunk(None, 0, role=True)), *_tokens(1, 20), 0.5,
                           *_tokens(21, 40), *_ending(40)]
    proxy = make_proxy(raw_upstream.url, native_relay=True)
    expected = _stream(make_proxy(raw_upstream.url, native_relay=False).url, ASK)
    assert httpx.get(proxy.url + "/api/health").json()["native_relay"] == "running"
    with _sent(proxy) as sock:
        got = b""
        while b'"content":"t20"' not in got:  # the thread holds it, in the pause
            got += sock.recv(65536)
        assert _native_streams(proxy) >= 1
        native = proxy.server.call(_native_of(proxy))
        native._relay.fault()
        while not got.endswith(b"0\r\n\r\n"):
            data = sock.recv(65536)
            assert data, "the stream was cut without its end"
            got += data
    body = _unchunked(got.partition(b"\r\n\r\n")[2])
    events = body.split(b"\n\n")
    assert body.startswith(expected[:expected.index(b'"content":"t21"')].rpartition(
        b"\n\n")[0])  # every event up to the fault, as the client would have had them
    assert b'"content":"t21"' not in body
    error = orjson.loads(events[-3].removeprefix(b"data: "))["error"]
    assert (error["type"], error["code"]) == ("server_error", 500)
    assert "native relay failed" in error["message"]
    assert events[-2:] == [b"data: [DONE]", b""]
    record = proxy.next_record()
    assert (record.outcome, record.output_tokens) == ("internal_error", 20)
    assert record.error is not None and "native relay failed" in record.error
    assert proxy.sample("phasewatch_native_relay_failures_total") == 1
    assert httpx.get(proxy.url + "/api/health").json()["native_relay"] == "failed"
    handed = _native_streams(proxy)
    assert _stream(proxy.url, ASK) == expected  # and the next is relayed whole, in Python
    assert _native_streams(proxy) == handed
    assert proxy.next_record().outcome == "ok"


async def _native_of_app(app: Any) -> Any:
    return app.api.state.proxy.native


def _native_of(proxy: Proxy) -> Any:
    return _native_of_app(proxy.server.app)


def _unchunked(body: bytes) -> bytes:
    out, pos = b"", 0
    while True:
        line_end = body.index(b"\r\n", pos)
        size = int(body[pos:line_end], 16)
        if not size:
            return out
        out += body[line_end + 2:line_end + 2 + size]
        pos = line_end + 2 + size + 2


def test_a_scrape_counts_every_token_the_native_leg_relayed_before_it(
        make_proxy: Callable[..., Proxy], raw_upstream: RawUpstream) -> None:
    # 30 tokens, then the stream stays open. The live registry's passes replay a native stream's log
    # only every REPLAY_S (app/phasewatch/proxy/live.py), so within the first seconds only the
    # scrape's own refresh can bring these tokens into the ITL histogram.
    raw_upstream.script = [_frame(_chunk(None, 0, role=True)), *_tokens(1, 30), 30.0,
                           *_ending(30)]
    proxy = make_proxy(raw_upstream.url, native_relay=True)
    with _sent(proxy) as sock:
        seen = b""
        while b'"content":"t30"' not in seen:  # the client has every token
            seen += sock.recv(65536)
        scraped = parse_metrics(httpx.get(proxy.url + "/metrics", timeout=10).text)
        labels = {"model": "m", "endpoint": "chat.completions"}
        assert total(scraped, "phasewatch_inter_token_latency_seconds_count", **labels) == 29
        # The first token too, the thread having taken the stream before it.
        assert total(scraped, "phasewatch_time_to_first_token_seconds_count", **labels) == 1
        assert total(scraped, "phasewatch_native_relay_streams_total") >= 1
        assert not proxy.stored()  # the stream is still open


def test_a_client_that_stops_reading_holds_the_upstream_back_and_loses_nothing(
        two_proxies: tuple[Proxy, Proxy], raw_upstream: RawUpstream) -> None:
    raw_upstream.script = [_frame(_chunk(None, 0, role=True)), *_tokens(1, 300, pad=8000),
                           *_ending(300)]
    native, python = two_proxies
    received: list[bytes] = []
    with httpx.stream("POST", native.url + "/v1/chat/completions", json=ASK,
                      timeout=30) as response:
        parts = response.iter_raw()
        received.append(next(parts))
        # Not reading until the upstream's writes back up: every buffer between is full.
        assert raw_upstream.blocked.wait(20)
        received.extend(parts)
    got = b"".join(received)
    assert got == _stream(python.url, ASK)
    record = native.next_record()
    assert record.outcome == "ok" and record.output_tokens == 300
    assert _native_streams(native) >= 1


class _Responses:
    """The responses that come back on one client connection, in order (pipelined ones too),
    each as (headers, body without its chunk framing)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._parser = httptools.HttpResponseParser(self)
        self._headers: dict[bytes, bytes] = {}
        self._body: list[bytes] = []
        self._done: list[tuple[dict[bytes, bytes], bytes]] = []

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.lower()] = value

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._done.append((self._headers, b"".join(self._body)))
        self._headers, self._body = {}, []

    def next(self) -> tuple[dict[bytes, bytes], bytes]:
        while not self._done:
            data = self._sock.recv(65536)
            assert data, "the connection closed before the response ended"
            self._parser.feed_data(data)
        return self._done.pop(0)


@pytest.mark.parametrize("together", [False, True], ids=["end-apart", "end-with-done"])
def test_a_kept_alive_connection_carries_pipelined_streams_and_closes_when_asked(
        two_proxies: tuple[Proxy, Proxy], raw_upstream: RawUpstream, together: bool) -> None:
    """The response's end goes out from the read that brings it (with `[DONE]` when they come
    together, alone when it comes apart), and completes uvicorn's cycle as its own `send`
    would: the next pipelined request is answered on the same connection, and a request that
    asks for `connection: close` has its connection closed after its answer."""
    ending = _ending(30)
    if together:  # the usage chunk, [DONE] and the body's end in one write, as vLLM may
        ending = [ending[0], b"".join(ending[1:])]
    raw_upstream.script = [_frame(_chunk(None, 0, role=True)), *_tokens(1, 30), *ending]
    body = orjson.dumps(ASK)
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
               b"application/json\r\ncontent-length: %d\r\n%%b\r\n%b" % (len(body), body))
    for proxy in two_proxies:
        expected = _stream(proxy.url, ASK)
        host, port = proxy.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=20) as sock:
            responses = _Responses(sock)
            sock.sendall(request % b"" + request % b"")  # two at once: pipelined
            answers = [responses.next(), responses.next()]
            sock.sendall(request % b"connection: close\r\n")
            answers.append(responses.next())
            assert sock.recv(1) == b""  # closed after the answer, as asked
        for headers, got in answers:
            assert headers[b"content-type"].startswith(b"text/event-stream")
            assert headers[b"transfer-encoding"] == b"chunked"
            assert got == expected
        assert answers[2][0][b"connection"] == b"close"
        records = [proxy.next_record() for _ in range(4)]
        assert [(r.outcome, r.output_tokens) for r in records] == [("ok", 30)] * 4


def test_a_pipelined_request_is_answered_when_the_stream_ahead_comes_back(
        make_proxy: Callable[..., Proxy], raw_upstream: RawUpstream,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A request queued behind a natively relayed response on the same connection: the
    thread leaves its bytes in the socket, and the stream ahead comes back with a wake-up of
    the event loop, which then reads it. The live registry's pass (another wake-up) never runs
    here, so the second answer comes only that way."""
    from phasewatch.proxy import live

    async def no_pass(self: Any) -> None:
        await asyncio.Event().wait()

    monkeypatch.setattr(live.LiveStreams, "run", no_pass)
    raw_upstream.script = [_frame(_chunk(None, 0, role=True)), *_tokens(1, 30), *_ending(30)]
    proxy = make_proxy(raw_upstream.url, native_relay=True)
    expected = _stream(make_proxy(raw_upstream.url, native_relay=False).url, ASK)
    body = orjson.dumps(ASK)
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
               b"application/json\r\ncontent-length: %d\r\n\r\n%b" % (len(body), body))
    host, port = proxy.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=20) as sock:
        responses = _Responses(sock)
        sock.sendall(request * 2)  # the second queued behind the first
        answers = [responses.next(), responses.next()]
    assert [got for _, got in answers] == [expected] * 2
    assert _native_streams(proxy) == 2
    records = [proxy.next_record() for _ in range(2)]
    assert [(r.outcome, r.output_tokens) for r in records] == [("ok", 30)] * 2


def test_a_request_after_a_native_response_on_its_connection_is_read_at_once(
        make_proxy: Callable[..., Proxy], raw_upstream: RawUpstream) -> None:
    """A closed-loop client sends its next request on the same connection as soon as a
    response ends. Until the event loop takes the stream back from the native thread, no one
    reads that socket: the request would wait, its wait in the client's latency but not in the
    stored figures (which start when the server reads it). So the time the client sees, from
    sending a request to its response's end, is the stored end-to-end time and little more."""
    raw_upstream.script = [_frame(_chunk(None, 0, role=True)), *_tokens(1, 5), *_ending(5)]
    proxy = make_proxy(raw_upstream.url, native_relay=True)
    body = orjson.dumps(ASK)
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
               b"application/json\r\ncontent-length: %d\r\n\r\n%b" % (len(body), body))
    host, port = proxy.url.removeprefix("http://").split(":")
    seen_s = []
    with socket.create_connection((host, int(port)), timeout=20) as sock:
        responses = _Responses(sock)
        for _ in range(9):  # each sent as soon as the one before has ended, as a user would
            sent = time.perf_counter()
            sock.sendall(request)
            responses.next()
            seen_s.append(time.perf_counter() - sent)
    records = [proxy.next_record() for _ in seen_s]
    assert [r.outcome for r in records] == ["ok"] * 9
    assert _native_streams(proxy) == 9
    unseen_ms = [(seen - (r.e2e_s or 0.0)) * 1e3
                 for seen, r in zip(seen_s, records, strict=True)]
    # The first request is the connection's first (stamped from the kernel's receipt); each
    # of the others comes after a native stream's end.
    assert statistics.median(unseen_ms[1:]) < 8.0, unseen_ms


@pytest.mark.parametrize("native", [True, False], ids=["native-leg", "python-path"])
def test_a_relayed_request_leaves_nothing_to_the_cyclic_collector(
        make_proxy: Callable[..., Proxy], raw_upstream: RawUpstream, native: bool) -> None:
    """A request's objects (its exchange, timing, client leg, the server's cycle) are freed by
    reference counting as it ends, not left in cycles for the collector: under load, those
    would outlive the young generations and wait for a full collection."""
    raw_upstream.script = [_frame(_chunk(None, 0, role=True)), *_tokens(1, 10), *_ending(10)]
    proxy = make_proxy(raw_upstream.url, native_relay=native)

    def relayed(client: httpx.Client) -> None:
        with client.stream("POST", "/v1/chat/completions", json=ASK) as response:
            assert response.status_code == 200
            response.read()
        proxy.next_record()  # stored: the relay's last step has run

    # One kept-alive connection (a connection's own objects go when it closes).
    with httpx.Client(base_url=proxy.url, timeout=30) as client:
        relayed(client)
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            for _ in range(3):
                relayed(client)
            gc.collect()
            left = sorted({f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.garbage
                           if type(o).__module__.startswith(("phasewatch.", "uvicorn."))})
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
    assert left == [], left
    assert _native_streams(proxy) == (4 if native else 0)


def test_under_uvloop_the_native_leg_relays_alike_and_hands_the_connection_back(
        make_proxy: Callable[..., Proxy], raw_upstream: RawUpstream) -> None:
    """`serve` runs on uvloop where it is installed (the other tests here on asyncio's loop):
    its transports pause and resume reading around the handoff their own way (libuv). The
    streams are relayed alike, and the pooled upstream connection, read again by the loop
    when a stream comes back, carries the next one."""
    uvloop = pytest.importorskip("uvloop")
    raw_upstream.script = [_frame(_chunk(None, 0, role=True)), *_tokens(1, 30), *_ending(30)]
    expected = _stream(make_proxy(raw_upstream.url, native_relay=False).url, ASK)
    proxy = make_proxy(raw_upstream.url, native_relay=True, loop_factory=uvloop.new_event_loop)
    assert type(proxy.server.loop).__module__.startswith("uvloop")
    for _ in range(3):
        assert _stream(proxy.url, ASK) == expected
        record = proxy.next_record()
        assert (record.outcome, record.output_tokens, record.itl_count) == ("ok", 30, 29)
    assert _native_streams(proxy) == 3  # each taken before its first token, none given back
    assert raw_upstream.streamed_on == 2  # one per proxy: each stream's was kept alive


def test_the_relay_thread_is_named_for_the_tools_that_split_a_process_by_thread() -> None:
    """`top -H`, perf and benchmarks/proxy_overhead.py's CPU split find it by this name."""
    relay = import_module("phasewatch.proxy._native").Relay()
    try:
        names = set()
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/comm") as comm:
                    names.add(comm.read().strip())
            except FileNotFoundError:  # another test's thread ended since the listing
                continue
        assert "pw-native-relay" in names
    finally:
        relay.close()
