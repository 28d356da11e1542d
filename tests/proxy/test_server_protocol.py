"""phasewatch's server protocol (app/phasewatch/proxy/client_leg.py) and its one dependency on
uvicorn's internals: heads that never end are answered and closed; a connection's first request is
stamped from the kernel's receipt of its first byte (app/phasewatch/proxy/arrival.py); the adapter
runs only on the uvicorn it was tested with."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
import tomllib
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from time import perf_counter_ns

import httpx
import orjson
import pytest
from packaging.requirements import Requirement

from phasewatch.proxy.arrival import KernelArrivals
from phasewatch.proxy.client_leg import TESTED_UVICORN
from tests.conftest import Proxy
from tests.support.served import parse_metrics, total

HEAD_TIMEOUT_S = 0.4
BODY = orjson.dumps({"model": "m", "prompt": "x", "stream": True, "max_tokens": 3})


def _connect(proxy: Proxy) -> socket.socket:
    host, port = proxy.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _read_all(sock: socket.socket) -> bytes:
    got = b""
    while chunk := sock.recv(65536):
        got += chunk
    return got


def _request(body: bytes = BODY) -> bytes:
    return (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%b" % (len(body), body))


@pytest.fixture
def timed_proxy(make_proxy: Callable[..., Proxy], scripted_url: str) -> Proxy:
    return make_proxy(scripted_url, client_head_timeout_s=HEAD_TIMEOUT_S)


@pytest.mark.parametrize("sent", [b"", b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n",
                                  b"POST /v1/compl"],
                         ids=["nothing", "half-a-head", "half-a-request-line"])
def test_a_head_that_does_not_end_is_answered_408_and_closed(timed_proxy: Proxy,
                                                             sent: bytes) -> None:
    # A new connection's first head is timed from the connection's start, so from before the
    # connect call returns: the clock starts before it.
    started = time.monotonic()
    with _connect(timed_proxy) as sock:
        sock.sendall(sent)
        got = _read_all(sock)  # until the server closes it
        took = time.monotonic() - started
    assert got.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), got
    assert b"connection: close" in got
    error = orjson.loads(got.partition(b"\r\n\r\n")[2])["error"]
    assert error["type"] == "request_timeout" and error["code"] == 408
    assert HEAD_TIMEOUT_S <= took < HEAD_TIMEOUT_S + 5


@pytest.mark.parametrize("sent", [b"GET / HTTP/1.1\nhost: x\n\n",
                                  b"POST /v1/completions HTTP/1.1\r\ncontent-length: 1\r\n"
                                  b"transfer-encoding: chunked\r\n\r\n"],
                         ids=["bare-lf", "length-and-chunked"])
def test_a_head_llhttp_refuses_is_answered_400_at_once(timed_proxy: Proxy, sent: bytes) -> None:
    with _connect(timed_proxy) as sock:
        started = time.monotonic()
        sock.sendall(sent)
        got = _read_all(sock)
        took = time.monotonic() - started
    assert got.startswith(b"HTTP/1.1 400 Bad Request\r\n"), got
    error = orjson.loads(got.partition(b"\r\n\r\n")[2])["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == 400
    assert took < HEAD_TIMEOUT_S


def test_a_head_half_sent_after_an_answer_on_a_kept_connection_is_dropped(
        timed_proxy: Proxy) -> None:
    with _connect(timed_proxy) as sock:
        sock.sendall(_request())
        first = b""
        while not first.endswith(b"0\r\n\r\n"):
            first += sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200")
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nho")
        assert _read_all(sock).startswith(b"HTTP/1.1 408")


def test_a_head_that_ends_in_time_is_served_whatever_its_pace(timed_proxy: Proxy) -> None:
    """The timeout is the head's, from its first byte: one sent in pieces within it is served,
    and the connection then waits for its next request under the keep-alive timeout alone."""
    request = _request()
    with _connect(timed_proxy) as sock:
        for piece in (request[:10], request[10:40], request[40:]):
            sock.sendall(piece)
        got = b""
        while not got.endswith(b"0\r\n\r\n"):
            got += sock.recv(65536)
        assert got.startswith(b"HTTP/1.1 200")
        deadline = time.monotonic() + HEAD_TIMEOUT_S * 3
        sock.settimeout(0.05)
        while time.monotonic() < deadline:  # nothing comes: no 408 for an idle connection
            with pytest.raises(TimeoutError):
                sock.recv(1)
    assert timed_proxy.next_record().outcome == "ok"


def _stamping(arrivals: KernelArrivals) -> bool:
    """The kernel stamps received packets: it turns that on a moment after a socket asks
    (a deferred switch), so a loopback probe says when."""
    with socket.create_server(("127.0.0.1", 0)) as listener, \
            socket.create_connection(listener.getsockname()) as client:
        client.sendall(b"x")
        conn, _ = listener.accept()
        with conn:
            return arrivals.first_byte_ns(conn.fileno()) is not None


def _wait_for_stamps(arrivals: KernelArrivals) -> None:
    deadline = time.monotonic() + 5
    while not _stamping(arrivals):
        assert time.monotonic() < deadline, "the kernel never stamped a received packet"


def test_the_kernel_stamps_a_connections_first_byte_before_anything_reads_it() -> None:
    arrivals = KernelArrivals()
    if not arrivals.enabled:
        pytest.skip("no receive timestamps on this platform")
    _wait_for_stamps(arrivals)
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        client = socket.create_connection(listener.getsockname())
        sent_ns = perf_counter_ns()
        client.sendall(b"POST / HTTP/1.1\r\n")
        # The request waits in the accept queue while the server is busy for 20 ms.
        while perf_counter_ns() - sent_ns < 20_000_000:
            pass
        conn, _ = listener.accept()
        accepted_ns = perf_counter_ns()
        stamped = arrivals.first_byte_ns(conn.fileno())
        assert stamped is not None
        assert sent_ns - 1_000_000 <= stamped < sent_ns + 5_000_000
        assert accepted_ns - stamped >= 15_000_000  # the wait is inside the stamp
        assert conn.recv(100) == b"POST / HTTP/1.1\r\n"  # peeked: nothing was taken
        assert arrivals.first_byte_ns(conn.fileno()) is None  # nothing waits now
        client.close()
        conn.close()
    finally:
        listener.close()
        arrivals.close()


def test_a_first_requests_arrival_includes_its_wait_for_the_server(
        make_proxy: Callable[..., Proxy], scripted_url: str) -> None:
    """A connection accepted late (its request sent meanwhile) has that wait in its TTFT and
    its proxy-queue time: here the server's event loop is busy for 0.3 s when the client
    connects and sends."""
    proxy = make_proxy(scripted_url)
    arrivals = KernelArrivals()
    if not arrivals.enabled:
        pytest.skip("no receive timestamps on this platform")
    _wait_for_stamps(arrivals)  # (the proxy's own keeper asked for them as it started)
    arrivals.close()
    busy, sent = threading.Event(), threading.Event()

    async def hold_the_loop() -> None:
        busy.set()
        sent.wait(10)  # the loop is blocked on purpose: the request arrives meanwhile
        busy_until = time.monotonic() + 0.3
        while time.monotonic() < busy_until:
            pass

    assert proxy.server.loop is not None
    held = asyncio.run_coroutine_threadsafe(hold_the_loop(), proxy.server.loop)
    assert busy.wait(10)
    with _connect(proxy) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"
                     b"content-type: application/json\r\ncontent-length: "
                     + str(len(BODY)).encode() + b"\r\n\r\n" + BODY)
        sent.set()  # every byte is in the kernel: the 0.3 s the loop is held starts after
        sock.settimeout(10)
        received = b""
        while not received.endswith(b"0\r\n\r\n"):
            chunk = sock.recv(65536)
            assert chunk, received
            received += chunk
    held.result(10)
    assert received.startswith(b"HTTP/1.1 200 ")
    record = proxy.next_record()
    assert record.ttft_s is not None and record.ttft_s >= 0.3
    queued = total(parse_metrics(httpx.get(proxy.url + "/metrics").text),
                   "phasewatch_proxy_queue_seconds_sum")
    assert queued >= 0.3


def test_uvicorn_is_a_version_the_adapter_was_tested_with() -> None:
    """client_leg.py moves uvicorn's cycle as its `send` does (the one module that touches
    uvicorn's internals): pyproject pins uvicorn to the minor versions it was tested with, and
    this fails on any other installed."""
    installed = version("uvicorn")
    assert ".".join(installed.split(".")[:2]) in TESTED_UVICORN, installed
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    pins = [Requirement(d) for d in pyproject["project"]["dependencies"]]
    uvicorn = next(r for r in pins if r.name == "uvicorn")
    for minor in TESTED_UVICORN:
        assert uvicorn.specifier.contains(f"{minor}.0")
    assert not uvicorn.specifier.contains("0.99.0") and not uvicorn.specifier.contains("1.0.0")
