"""The native front (app/proxy/front.py, _native.c) changes nothing a client or a record sees.

A kept-alive connection's requests after the first go to two proxies under uvicorn, one with
the front and one without, from the raw upstream of test_native_relay.py: the bytes of every
response (its head too, the request id aside) and the records are the same, and the front
really took the plain requests (`phasewatch_native_front_requests`). Also through it: requests
the front leaves to Python on such a connection, an upstream's error status and error event
(the Python path takes the request over from the front), a client that leaves, an upstream
that closes an idle kept connection, a request in flight as a scrape sees it, and the idle
timeout.
"""

from __future__ import annotations

import re
import signal
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httptools
import httpx
import orjson
import pytest

from phasewatch.proxy import native
from tests.conftest import Proxy
from tests.proxy.test_native_relay import (
    ASK,
    ASK_USAGE,
    RawUpstream,
    _chunk,
    _ending,
    _event,
    _frame,
    _tokens,
    raw_upstream,  # noqa: F401 (a fixture)
)
from tests.support.served import parse_metrics, total, wait_for
from tests.support.servers import free_port, subprocess_server

pytest.importorskip("phasewatch.proxy._native", reason="the native relay is not built here")

STREAM = [_frame(_chunk(None, 0, role=True)), *_tokens(1, 30), *_ending(30)]
_RID = re.compile(rb"x-request-id: [0-9a-zA-Z-]+\r\n")
_DATE = re.compile(rb"date: [^\r]+\r\n")


def _request(body: dict[str, Any] | bytes, headers: bytes = b"",
             path: bytes = b"/v1/chat/completions") -> bytes:
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    return (b"POST %b HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n%b"
            b"content-length: %d\r\n\r\n%b" % (path, headers, len(data), data))


class _Connection:
    """One client connection; each response returned whole, as raw bytes."""

    def __init__(self, proxy: Proxy) -> None:
        host, port = proxy.url.removeprefix("http://").split(":")
        self.sock = socket.create_connection((host, int(port)), timeout=20)
        self._parser = httptools.HttpResponseParser(self)
        self._pending = b""
        self._complete = False

    def on_message_complete(self) -> None:
        self._complete = True

    def ask(self, request: bytes) -> bytes:
        self.sock.sendall(request)
        return self.response()

    def response(self) -> bytes:
        raw = bytearray()
        self._complete = False
        while True:
            data, self._pending = self._pending, b""
            if not data:
                data = self.sock.recv(65536)
                assert data, "the connection closed before the response ended"
            for i in range(len(data)):  # a byte at a time: the message's last byte is known
                self._parser.feed_data(data[i:i + 1])
                if self._complete:
                    raw += data[:i + 1]
                    self._pending = data[i + 1:]
                    return bytes(raw)
            raw += data

    def started(self) -> None:
        """Wait for the response's first bytes (kept for `response`)."""
        self._pending += self.sock.recv(65536)
        assert self._pending

    def closed(self) -> bool:
        """The proxy closed the connection (a read sees its end)."""
        self.sock.settimeout(10)
        try:
            return self.sock.recv(65536) == b""
        except ConnectionResetError:
            return True

    def close(self) -> None:
        self.sock.close()


def _kept(proxy: Proxy, upstream: RawUpstream,
          script: list[bytes | float | None] = STREAM) -> _Connection:
    """A connection whose first request (a whole stream) ended: the front holds it next."""
    upstream.script = script
    conn = _Connection(proxy)
    conn.ask(_request(ASK))
    return conn


@pytest.fixture
def two_proxies(make_proxy: Callable[..., Proxy],
                raw_upstream: RawUpstream) -> tuple[Proxy, Proxy]:  # noqa: F811
    return (make_proxy(raw_upstream.url, native_front=True),
            make_proxy(raw_upstream.url, native_front=False))


def _front(proxy: Proxy) -> float:
    return proxy.sample("phasewatch_native_front_requests_total")


def _same(front: bytes, python: bytes) -> None:
    """The same response but for the values of the request id and the date."""
    def masked(raw: bytes) -> bytes:
        return _DATE.sub(b"date: *\r\n", _RID.sub(b"x-request-id: *\r\n", raw))
    assert masked(front) == masked(python)


@pytest.mark.parametrize("body", [
    ASK, {**ASK, "n": 1, "max_tokens": 30},
    {**ASK, "messages": [{"role": "user", "content": "x" * 20000}]},  # past its first buffer
    ASK_USAGE,  # the client's own options, asking for usage on every chunk: kept in its stream
    # UTF-8 as it is (orjson writes no escapes; nor do clients that send `ensure_ascii=False`)
    {**ASK, "messages": [{"role": "user",
                          "content": "h\u00e9llo, \u65e5\u672c\u8a9e \U0001f642"}]},
], ids=["plain", "n-1", "long-prompt", "usage-asked", "utf-8"])
def test_a_kept_connection_s_next_requests_go_through_the_front_with_the_same_bytes(
        two_proxies: tuple[Proxy, Proxy], raw_upstream: RawUpstream,  # noqa: F811
        body: dict[str, Any]) -> None:
    raw_upstream.script = STREAM
    front, python = two_proxies
    answers, sent = {}, {}
    for proxy in (front, python):
        raw_upstream.bodies.clear()
        conn = _Connection(proxy)
        answers[proxy] = [conn.ask(_request(body)) for _ in range(4)]
        conn.close()
        sent[proxy] = list(raw_upstream.bodies)
    assert sent[front] == sent[python]  # what went upstream, byte for byte
    for mine, theirs in zip(answers[front], answers[python], strict=True):
        _same(mine, theirs)
        assert mine.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
        assert (b'"usage"' in mine) == (body is ASK_USAGE)
    ids = {re.search(rb"x-request-id: (\w+)", raw)[1].decode() for raw in answers[front]}
    records = [front.next_record() for _ in range(4)]
    assert _front(front) == 3 and _front(python) == 0  # the first request kept the connection
    assert {r.request_id for r in records} == ids
    for record in records:
        assert (record.outcome, record.http_status, record.output_tokens, record.prompt_tokens,
                record.itl_count, record.tokens_exact, record.model) == (
                    "ok", 200, 30, 7, 29, True, "m")
        assert record.endpoint == "chat.completions" and record.stream
        assert 0 < record.ttft_s < record.e2e_s
    itl = "phasewatch_inter_token_latency_seconds_count"
    labels = {"model": "m", "endpoint": "chat.completions"}
    assert front.sample(itl, labels) == python.sample(itl, labels) == 4 * 29
    ttft = "phasewatch_time_to_first_token_seconds_count"
    assert front.sample(ttft, labels) == 4


def test_a_client_s_own_request_id_is_the_record_s_and_goes_upstream(
        make_proxy: Callable[..., Proxy], raw_upstream: RawUpstream) -> None:  # noqa: F811
    proxy = make_proxy(raw_upstream.url, native_front=True)
    conn = _kept(proxy, raw_upstream)
    raw = conn.ask(_request(ASK, b"x-request-id: client-chosen-1\r\n"))
    conn.close()
    assert b"x-request-id: client-chosen-1\r\n" in raw
    ids = {proxy.next_record().request_id for _ in range(2)}
    assert "client-chosen-1" in ids
    assert _front(proxy) == 1  # (counted by the time its record is stored)


def test_requests_the_front_leaves_to_python_are_answered_on_the_same_connection(
        two_proxies: tuple[Proxy, Proxy], raw_upstream: RawUpstream) -> None:  # noqa: F811
    """Each request the front does not take goes to uvicorn with every byte: the client's own
    `stream_options` but for usage on every chunk, a run id, an escaped key, `connection:
    close`; between them the front takes the others (usage on every chunk, a completions
    request)."""
    raw_upstream.script = STREAM
    front, python = two_proxies
    sequence = [
        _request(ASK),
        _request({**ASK, "stream_options": {"include_usage": True}}),  # its own: Python's
        _request(ASK_USAGE),  # its own, usage on every chunk: the front's, as it came
        _request(ASK),  # the front's
        _request(ASK, b"x-phasewatch-run-id: r1\r\n"),  # a run id: Python's
        _request({"model": "m", "prompt": "hi", "stream": True},
                 path=b"/v1/completions"),  # the front's
        _request(b'{"model":"m","messages":[],"stre\\u0061m":true}'),  # escaped: Python's
        _request(ASK),  # the front's
        _request(ASK, b"connection: close\r\n"),  # Python's, and the connection closes after
    ]
    answers = {}
    for proxy in (front, python):
        conn = _Connection(proxy)
        answers[proxy] = [conn.ask(request) for request in sequence]
        assert conn.closed()
        conn.close()
    for mine, theirs in zip(answers[front], answers[python], strict=True):
        _same(mine, theirs)
        assert mine.startswith(b"HTTP/1.1 200 OK\r\n")
    outcomes = sorted(front.next_record().outcome for _ in sequence)
    assert outcomes == ["ok"] * len(sequence)
    assert _front(front) == 4


def _orjson_reads(body: bytes) -> bool:
    try:
        orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    return True


def test_the_front_reads_a_string_s_bytes_as_orjson_does() -> None:
    """Every two-byte sequence, and every three- and four-byte one from each lead byte past
    ASCII with every second byte (the byte whose range the strict rules narrow), inside a
    string of a plain body: the front plans the body exactly when orjson reads it."""
    from phasewatch.proxy._native import body_plan
    tails = (b"\x80", b"\xbf", b"\x7f", b"\xc0")
    cases = [bytes((a, b)) for a in range(256) for b in range(256)]
    cases += [bytes((a, b)) + t + u for a in range(0xe0, 0x100) for b in range(256)
              for t in tails for u in (b"", *tails) if a >= 0xf0 or not u]
    read = {True: 0, False: 0}
    for case in cases:
        body = b'{"model":"m","stream":true,"prompt":"%b"}' % case
        valid = _orjson_reads(body)
        planned, _ = body_plan(body)
        assert (planned == 1) == valid, case
        read[valid] += 1
    assert read[True] > 10000 and read[False] > 10000


@pytest.mark.parametrize("bad", [
    b"\xed\xa0\x80",  # a surrogate, encoded
    b"\xc0\xaf",  # an overlong form
    b"\xf4\x90\x80\x80",  # past U+10FFFF
    b"\xe6\x97",  # cut short
    b"\xff",
], ids=["surrogate", "overlong", "past-max", "cut-short", "never-utf-8"])
def test_a_body_that_is_not_utf_8_goes_to_python_as_it_came(
        two_proxies: tuple[Proxy, Proxy], raw_upstream: RawUpstream,  # noqa: F811
        bad: bytes) -> None:
    """orjson refuses it, so the Python path forwards it unplanned; the front leaves it to that
    path. A plain request after it on the same connection is answered the same way too."""
    raw_upstream.script = STREAM
    front, python = two_proxies
    body = b'{"model":"m","messages":[{"role":"user","content":"a%bz"}],"stream":true}' % bad
    answers, sent = {}, {}
    for proxy in (front, python):
        conn = _Connection(proxy)
        conn.ask(_request(ASK))  # its stream keeps the connection for the front
        raw_upstream.bodies.clear()
        answers[proxy] = [conn.ask(_request(body)), conn.ask(_request(ASK))]
        conn.close()
        sent[proxy] = list(raw_upstream.bodies)
    assert sent[front] == sent[python]
    assert sent[front][0] == body  # not planned: as it came
    for mine, theirs in zip(answers[front], answers[python], strict=True):
        _same(mine, theirs)
    assert _front(front) == 0


def test_clients_that_close_as_their_response_ends_leave_nothing_in_flight(
        raw_upstream: RawUpstream, tmp_path: Path) -> None:  # noqa: F811
    """A connection per request, closed by its client as soon as the response's end comes:
    the thread lets go the front it kept at once, often before the event loop took the stream
    that kept it. Python must hear of that stream first (`keeper_unseen`, _native.c): else
    the connections go back under a request still held, which is then never finished, and
    shutdown waits for it. Through `phasewatch serve` as users run it, under load."""
    raw_upstream.script = [_frame(_chunk(None, 0, role=True)), *_tokens(1, 3), *_ending(3)]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {"PHASEWATCH_DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path / 'phasewatch.db'}",
           "PHASEWATCH_LOG_LEVEL": "warning", "PHASEWATCH_ADMIN_OPEN": "true",
           "PHASEWATCH_METRICS_CACHE_S": "0", "PHASEWATCH_ENGINE_METRICS_ENABLED": "false"}
    args = ["-m", "phasewatch.cli", "serve", "--upstream", raw_upstream.url, "--port", str(port)]
    sent = 1500
    request = _request(ASK)

    def one(_: int) -> bool:
        with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
            sock.sendall(request)
            raw = b""
            while not raw.endswith(b"0\r\n\r\n"):
                data = sock.recv(65536)
                if not data:
                    return False
                raw += data
        return True  # closed here, as the response's end came

    with subprocess_server(args, url + "/api/health", env=env) as server:
        with ThreadPoolExecutor(16) as pool:
            assert all(pool.map(one, range(sent)))

        def settled() -> bool:
            samples = parse_metrics(httpx.get(url + "/metrics").text)
            return (total(samples, "phasewatch_requests_total") == sent
                    and total(samples, "phasewatch_requests_in_flight") == 0)

        wait_for(settled, timeout=15, says="every request finished, none in flight")
        server.terminate()
        assert server.wait(timeout=10) in (0, -signal.SIGTERM)  # nothing held shutdown


def test_an_upstream_error_status_on_a_front_request_reaches_the_client_unchanged(
        two_proxies: tuple[Proxy, Proxy], raw_upstream: RawUpstream) -> None:  # noqa: F811
    """The front sent the request; the upstream's 400 is not a head it takes: the Python path
    takes the request over and answers it as it answers any."""
    front, python = two_proxies
    error = orjson.dumps({"object": "error", "message": "max_tokens is too large",
                          "type": "BadRequestError", "param": None, "code": 400})
    answers = {}
    for proxy in (front, python):
        raw_upstream.head = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n")
        raw_upstream.script = STREAM
        conn = _Connection(proxy)
        first = conn.ask(_request(ASK))
        raw_upstream.head = (b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\n\r\n" % len(error))
        raw_upstream.script = [error]
        second = conn.ask(_request(ASK))
        raw_upstream.head = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n")
        raw_upstream.script = STREAM
        third = conn.ask(_request(ASK))
        conn.close()
        answers[proxy] = [first, second, third]
    for mine, theirs in zip(answers[front], answers[python], strict=True):
        _same(mine, theirs)
    assert answers[front][1].startswith(b"HTTP/1.1 400 ") and answers[front][1].endswith(error)
    records = sorted((r.http_status, r.outcome) for r in (front.next_record() for _ in range(3)))
    assert records == [(200, "ok"), (200, "ok"), (400, "http_error")]
    # The front sent the second; the Python path that took it over serves the third.
    assert _front(front) == 1


def test_a_stream_that_ended_quietly_is_taken_before_the_front_s_next_one(
        make_proxy: Callable[..., Proxy], raw_upstream: RawUpstream,  # noqa: F811
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A kept connection's first stream ends quietly (no wake-up, native.py); the front's
    next request comes back at once (an upstream 400) and wakes the event loop: both are then
    handed back together, and Python takes them in the order they ended (the connection
    given to the front, then taken over), so the connection is uvicorn's again: shutting
    down closes it at once, as an idle connection of its own (not one lent to the front)."""
    monkeypatch.setattr(native, "QUIET_MS", 60_000)
    proxy = make_proxy(raw_upstream.url, native_front=True)
    conn = _kept(proxy, raw_upstream)
    error = b'{"error": "bad"}'
    raw_upstream.head = (b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n" % len(error))
    raw_upstream.script = [error]
    assert conn.ask(_request(ASK)).endswith(error)
    records = sorted((r.http_status, r.outcome) for r in (proxy.next_record() for _ in range(2)))
    assert records == [(200, "ok"), (400, "http_error")]
    started = time.monotonic()
    proxy.server.server.should_exit = True  # shutting down (the fixture joins it)
    assert conn.closed()
    assert time.monotonic() - started < 3  # not the keep-alive timeout's 5 s
    conn.close()


def test_an_error_event_mid_stream_is_taken_over_where_the_front_left_it(
        two_proxies: tuple[Proxy, Proxy], raw_upstream: RawUpstream) -> None:  # noqa: F811
    error = _frame(_event({"error": {"object": "error", "message": "engine failed",
                                     "type": "InternalServerError", "code": 500}}))
    raw_upstream.script = STREAM
    front, python = two_proxies
    answers = {}
    for proxy in (front, python):
        raw_upstream.script = STREAM
        conn = _Connection(proxy)
        first = conn.ask(_request(ASK))
        raw_upstream.script = [_frame(_chunk(None, 0, role=True)), *_tokens(1, 10), error,
                               *_tokens(11, 20), *_ending(20)]
        second = conn.ask(_request(ASK))
        answers[proxy] = [first, second]
        conn.close()
    for mine, theirs in zip(answers[front], answers[python], strict=True):
        _same(mine, theirs)
    assert b"engine failed" in answers[front][1]
    records = [front.next_record(), front.next_record()]
    theirs = [python.next_record(), python.next_record()]
    key = sorted((r.outcome, r.output_tokens, r.itl_count) for r in records)
    assert key == sorted((r.outcome, r.output_tokens, r.itl_count) for r in theirs)
    assert _front(front) == 1


def test_a_client_that_leaves_a_front_request_cancels_it_and_its_upstream_request(
        make_proxy: Callable[..., Proxy], raw_upstream: RawUpstream) -> None:  # noqa: F811
    proxy = make_proxy(raw_upstream.url, native_front=True)
    conn = _kept(proxy, raw_upstream)
    assert proxy.next_record().outcome == "ok"
    raw_upstream.script = [_frame(_chunk(None, 0, role=True)), *_tokens(1, 5), 30.0,
                           *_tokens(6, 10), *_ending(10)]
    conn.sock.sendall(_request(ASK))
    conn.started()  # the head and the first tokens
    conn.close()  # while the upstream is silent: the thread hears the hang-up itself
    record = proxy.next_record(timeout=10)
    assert record.outcome == "cancelled"
    assert raw_upstream.closed_by_peer.wait(10)  # its upstream request was closed, not read on
    assert _front(proxy) == 1


def test_an_upstream_that_closes_an_idle_kept_connection_leaves_the_next_request_to_python(
        make_proxy: Callable[..., Proxy], raw_upstream: RawUpstream) -> None:  # noqa: F811
    raw_upstream.script = [*STREAM, 0.05, None]  # the upstream closes after each response
    proxy = make_proxy(raw_upstream.url, native_front=True)
    conn = _Connection(proxy)
    first = conn.ask(_request(ASK))
    pool = proxy.server.app.state.proxy.pool
    deadline = time.monotonic() + 10
    while pool.open_connections and time.monotonic() < deadline:  # the upstream's close came
        time.sleep(0.01)
    assert pool.open_connections == 0
    second = conn.ask(_request(ASK))
    conn.close()
    assert first.endswith(b"0\r\n\r\n") and second.endswith(b"0\r\n\r\n")
    assert _front(proxy) == 0
    assert [proxy.next_record().outcome for _ in range(2)] == ["ok", "ok"]


def test_a_front_request_in_flight_is_counted_and_timed_at_a_scrape(
        make_proxy: Callable[..., Proxy], raw_upstream: RawUpstream) -> None:  # noqa: F811
    proxy = make_proxy(raw_upstream.url, native_front=True)
    conn = _kept(proxy, raw_upstream)
    proxy.next_record()
    raw_upstream.script = [_frame(_chunk(None, 0, role=True)), *_tokens(1, 5), 2.0,
                           *_tokens(6, 10), *_ending(10)]
    conn.sock.sendall(_request(ASK))
    conn.started()  # its head and first tokens came; the upstream pauses
    metrics = parse_metrics(httpx.get(proxy.url + "/metrics", timeout=10).text)
    assert metrics[("phasewatch_requests_in_flight", ())] == 1
    labels = (("endpoint", "chat.completions"), ("model", "m"))
    assert metrics[("phasewatch_time_to_first_token_seconds_count", labels)] == 2
    assert metrics[("phasewatch_streams_decoding", (("model", "m"),))] == 1
    conn.response()
    conn.close()
    assert proxy.next_record().output_tokens == 10
    metrics = parse_metrics(httpx.get(proxy.url + "/metrics", timeout=10).text)
    assert metrics[("phasewatch_requests_in_flight", ())] == 0


def test_the_idle_timeout_ends_a_silent_front_request_as_it_ends_any(
        make_proxy: Callable[..., Proxy], raw_upstream: RawUpstream) -> None:  # noqa: F811
    front = make_proxy(raw_upstream.url, native_front=True, upstream_idle_timeout_s=0.4)
    python = make_proxy(raw_upstream.url, native_front=False, upstream_idle_timeout_s=0.4)
    answers = {}
    for proxy in (front, python):
        raw_upstream.script = STREAM
        conn = _Connection(proxy)
        conn.ask(_request(ASK))
        raw_upstream.script = [_frame(_chunk(None, 0, role=True)), *_tokens(1, 5), 5.0,
                               *_tokens(6, 10), *_ending(10)]
        answers[proxy] = conn.ask(_request(ASK))
        conn.close()
        records = sorted(proxy.next_record().outcome for _ in range(2))
        assert records == ["ok", "timeout"]
    _same(answers[front], answers[python])
    assert b"idle" in answers[front] and answers[front].endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
    assert _front(front) == 1


def test_a_connection_the_front_holds_idle_is_closed_at_the_keep_alive_timeout(
        make_proxy: Callable[..., Proxy], raw_upstream: RawUpstream) -> None:  # noqa: F811
    """As uvicorn closes its own idle connections (its `timeout_keep_alive`, 5 s here)."""
    proxy = make_proxy(raw_upstream.url, native_front=True)
    conn = _kept(proxy, raw_upstream)
    started = time.monotonic()
    assert conn.closed()
    assert 4 < time.monotonic() - started < 9
    conn.close()


def test_the_front_carries_more_streams_at_once_than_it_restocks_between_batches(
        make_proxy: Callable[..., Proxy], raw_upstream: RawUpstream) -> None:  # noqa: F811
    """Its stream objects are made up to the stock on every batch and pass, however many of
    its requests are open: 80 kept connections' next requests, all open at once, all the
    front's."""
    proxy = make_proxy(raw_upstream.url, native_front=True)
    short = [_frame(_chunk(None, 0, role=True)), *_tokens(1, 2), *_ending(2)]
    conns = [_kept(proxy, raw_upstream, short) for _ in range(80)]  # well within keep-alive
    for _ in conns:
        proxy.next_record()
    raw_upstream.script = [_frame(_chunk(None, 0, role=True)), *_tokens(1, 3), 1.0,
                           *_tokens(4, 6), *_ending(6)]
    for conn in conns:
        conn.sock.sendall(_request(ASK))
    for conn in conns:
        conn.started()
    metrics = parse_metrics(httpx.get(proxy.url + "/metrics", timeout=10).text)
    assert metrics[("phasewatch_requests_in_flight", ())] == 80  # all open, all the front's
    assert metrics[("phasewatch_native_front_requests_total", ())] == 80
    for conn in conns:
        assert conn.response().endswith(b"0\r\n\r\n")
        conn.close()
