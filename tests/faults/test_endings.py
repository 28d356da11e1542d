"""Every way a request can end, against real servers: each gets the right answer and record."""

from __future__ import annotations

import asyncio
import socket
import time
import uuid
from types import SimpleNamespace
from typing import Any

import httpx
import orjson
import pytest

from tests.conftest import Proxy
from tests.proxy.test_relay_timing import assert_ttft, proxy_upstream, stream, upstream_log
from tests.support.served import wait_for
from tests.support.servers import free_port


def headers(script: dict[str, Any], request_id: str | None = None) -> dict[str, str]:
    out = {"x-script": orjson.dumps(script).decode()}
    if request_id:
        out["x-request-id"] = request_id
    return out


def test_upstream_http_error_passes_through_unchanged(proxy: Proxy, scripted_url: str) -> None:
    body = {"model": "scripted", "prompt": "x", "stream": True}
    direct = httpx.post(scripted_url + "/v1/completions", json=body,
                        headers=headers({"status": 400}))
    proxied = httpx.post(proxy.url + "/v1/completions", json=body,
                         headers=headers({"status": 400}))
    assert proxied.status_code == direct.status_code == 400
    assert proxied.content == direct.content
    assert proxied.headers["content-type"] == "application/json"
    record = proxy.next_record()
    assert record.outcome == "http_error" and record.http_status == 400
    assert record.error == "HTTP 400: BadRequestError"
    assert "secret" not in repr(record)  # the upstream's message echoed the prompt: not kept
    assert proxy.sample("phasewatch_requests_total",
                        {"model": "other", "endpoint": "completions", "outcome": "http_error"}) == 1


def test_in_band_error_is_a_stream_error_not_a_success(proxy: Proxy) -> None:
    request_id, _, reads = stream(proxy, "/v1/completions",
                                  {"tokens": [[0.05, "a", 1], [0.1, "b", 1]], "error_at": 0.08})
    body = b"".join(data for _, data in reads)
    assert b'"error"' in body and body.endswith(b"data: [DONE]\n\n")
    record = proxy.next_record()
    assert record.outcome == "stream_error" and record.error == "in-band error from upstream"
    assert_ttft(record.ttft_s, upstream_log(proxy_upstream(proxy), request_id), 0)


def test_in_band_error_before_any_token_has_no_ttft(proxy: Proxy) -> None:
    stream(proxy, "/v1/completions", {"tokens": [[0.1, "a", 1]], "error_at": 0.0})
    record = proxy.next_record()
    assert record.outcome == "stream_error" and record.ttft_s is None
    assert proxy.sample("phasewatch_time_to_first_token_seconds_count",
                        {"model": "scripted", "endpoint": "completions"}) == 0


def test_upstream_dropping_mid_stream_ends_the_client_stream_with_an_error(proxy: Proxy) -> None:
    script = {"tokens": [[0.05, "a", 1], [0.1, "b", 1], [0.3, "c", 1]], "drop_at": 0.2}
    _, _, reads = stream(proxy, "/v1/completions", script)
    body = b"".join(data for _, data in reads)
    tail = body.split(b"\n\n")[-3]
    assert orjson.loads(tail[len(b"data: "):])["error"]["type"] == "upstream_error"
    assert body.endswith(b"data: [DONE]\n\n")
    record = proxy.next_record()
    assert record.outcome == "stream_error" and record.output_tokens == 2


def test_unreachable_upstream_gets_502_in_openai_format(make_proxy: Any) -> None:
    proxy = make_proxy(f"http://127.0.0.1:{free_port()}")
    for path in ("/v1/chat/completions", "/v1/models"):
        response = httpx.post(proxy.url + path, json={"model": "m", "stream": True})
        assert response.status_code == 502
        error = response.json()["error"]
        assert error["type"] == "upstream_unreachable" and error["code"] == 502
        assert set(error) == {"message", "type", "param", "code"}
    record = proxy.next_record()
    assert record.outcome == "unreachable" and record.http_status is None


def test_silent_upstream_times_out_with_504(make_proxy: Any, scripted_url: str) -> None:
    proxy = make_proxy(scripted_url, upstream_idle_timeout_s=0.3)
    started = time.monotonic()
    response = httpx.post(proxy.url + "/v1/completions", json={"model": "m", "prompt": "x"},
                          headers=headers({"status": 500, "delay": 2}), timeout=10)
    assert response.status_code == 504 and time.monotonic() - started < 1.5
    assert response.json()["error"]["type"] == "upstream_timeout"
    assert proxy.next_record().outcome == "timeout"


def test_stall_mid_stream_past_idle_timeout_ends_with_an_error(make_proxy: Any,
                                                               scripted_url: str) -> None:
    proxy = make_proxy(scripted_url, upstream_idle_timeout_s=0.3)
    _, _, reads = stream(proxy, "/v1/completions", {"tokens": [[0.05, "a", 1], [2.0, "b", 1]]})
    body = b"".join(data for _, data in reads)
    assert b"idle timeout" in body and body.endswith(b"data: [DONE]\n\n")
    assert reads[-1][0] - reads[0][0] < 1.0
    record = proxy.next_record()
    assert record.outcome == "timeout" and record.ttft_s is not None


async def test_client_disconnect_closes_the_upstream_stream(proxy: Proxy,
                                                            scripted_url: str) -> None:
    request_id = uuid.uuid4().hex
    script = {"tokens": [[0.05 + 0.05 * i, f"t{i}", 1] for i in range(60)]}  # three seconds
    async with httpx.AsyncClient(timeout=10) as client:
        async with client.stream("POST", proxy.url + "/v1/completions",
                                 json={"model": "scripted", "prompt": "x", "stream": True},
                                 headers=headers(script, request_id)) as response:
            async for data in response.aiter_raw():
                if b'"t2"' in data:
                    left = time.monotonic_ns()
                    break
    deadline = time.monotonic() + 2
    log: dict[str, Any] = {}
    while time.monotonic() < deadline and not log.get("disconnected"):
        await asyncio.sleep(0.02)
        log = upstream_log(scripted_url, request_id)
    assert log["disconnected"], "the upstream never saw the proxy's connection close"
    assert (log["disconnected_ns"] - left) / 1e9 < 0.2  # at once, not at the next chunk
    assert len(log["sent_ns"]) < 10
    record = await asyncio.to_thread(proxy.next_record)
    assert record.outcome == "cancelled" and record.ttft_s is not None


async def test_client_leaving_during_a_long_prefill_aborts_it(proxy: Proxy,
                                                              scripted_url: str) -> None:
    """Nothing arrives for 3 s (queue + prefill); the client gives up after 0.3 s."""
    request_id = uuid.uuid4().hex
    async with httpx.AsyncClient(timeout=10) as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.post(proxy.url + "/v1/completions",
                              json={"model": "scripted", "prompt": "x"},
                              headers=headers({"tokens": [[3.0, "a", 1]]}, request_id),
                              timeout=httpx.Timeout(10, read=0.3))
    await asyncio.to_thread(wait_for, lambda: upstream_log(scripted_url, request_id)[
        "disconnected"], 5.0, "the upstream request closed")
    record = await asyncio.to_thread(proxy.next_record)
    assert record.outcome == "cancelled" and not record.stream


def stop_reading_a_big_stream(proxy: Proxy, request_id: str) -> SimpleNamespace:
    """Open a 26 MB stream (more than any buffer) on a raw socket, read its first bytes, then
    nothing more; return the record the proxy stores for it."""
    script = {"tokens": [[0.01, "x", 1]] * 400, "pad": 65536}
    body = orjson.dumps({"model": "scripted", "prompt": "x", "stream": True})
    request = (
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        + b"x-request-id: " + request_id.encode() + b"\r\nx-script: " + orjson.dumps(script)
        + b"\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    port = int(proxy.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(request)
        sock.recv(1024)  # the response has started; now read nothing more
        return proxy.next_record(timeout=10)


def test_client_that_stops_reading_is_not_blamed_on_the_upstream(make_proxy: Any,
                                                                 scripted_url: str) -> None:
    """A client that keeps its connection open but stops reading blocks the relay in its send.

    The upstream goes quiet only because of that back-pressure; the idle timeout must end the
    exchange as the client's doing, and must not then block again sending an error tail.
    """
    proxy = make_proxy(scripted_url, upstream_idle_timeout_s=0.5)
    record = stop_reading_a_big_stream(proxy, "not-reading")
    assert record.outcome == "cancelled"
    assert record.error == "client stopped reading past the idle timeout"
    assert record.ttft_s is not None


def test_a_client_that_stops_reading_is_cut_off_at_the_client_stall_timeout(
    make_proxy: Any, scripted_url: str
) -> None:
    """The upstream idle timeout is long (600 s by default) and back-pressure keeps the
    upstream quiet: the client's own stall timeout ends the exchange and closes the upstream
    request, so the engine slot is freed."""
    proxy = make_proxy(scripted_url, client_stall_timeout_s=0.5)  # idle timeout: 600 s
    record = stop_reading_a_big_stream(proxy, "stalled")
    assert record.outcome == "cancelled"
    assert record.error == "client stopped reading past the client stall timeout"
    assert upstream_log(scripted_url, "stalled")["disconnected"]  # the engine was told


async def test_a_client_closing_right_after_done_leaves_an_ok_record(proxy: Proxy) -> None:
    """Clients (the openai SDK among them) close at [DONE], which can reach the proxy before the
    upstream ends its body: the exchange was complete, so it is `ok`, not `cancelled`."""
    script = {"tokens": [[0.02, "a", 1], [0.04, "b", 1]], "linger": 0.5}
    async with httpx.AsyncClient(timeout=10) as client:
        async with client.stream("POST", proxy.url + "/v1/completions",
                                 json={"model": "scripted", "prompt": "x", "stream": True},
                                 headers=headers(script)) as response:
            async for data in response.aiter_raw():
                if data.endswith(b"data: [DONE]\n\n"):
                    break
    record = await asyncio.to_thread(proxy.next_record)
    assert record.outcome == "ok" and record.output_tokens == 2
    assert record.e2e_s < 0.4  # the stream ended at [DONE], not when the upstream let go
