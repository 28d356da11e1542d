"""The client leg starts and ends a chunked response as uvicorn's own `send` does
(app/phasewatch/proxy/client_leg.py): the same bytes, and the same state of uvicorn's cycle after
(what keep-alive, pipelining and the end of the ASGI call read), with keep-alive on and off and the
access log on and off. Compared against uvicorn's `RequestResponseCycle` itself, each on a transport
that records its writes: two writers of the same bytes need no socket to be told apart, and the
end-to-end path is in test_native_relay.py."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from phasewatch.proxy.client_leg import ClientLeg


class Recording(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.written: list[bytes] = []
        self.closed = False

    def write(self, data: Any) -> None:
        self.written.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0


def _cycle(keep_alive: bool, access_log: bool) -> tuple[RequestResponseCycle, Recording,
                                                         list[int]]:
    transport = Recording()
    completed: list[int] = []
    scope: Any = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                  "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 50000),
                  "scheme": "http", "method": "POST", "root_path": "",
                  "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
                  "query_string": b"", "headers": []}
    cycle = RequestResponseCycle(
        scope, transport, FlowControl(transport), logging.getLogger("uvicorn.error"),
        logging.getLogger("uvicorn.access"), access_log,
        [(b"date", b"Thu, 03 Dec 2026 00:00:00 GMT"), (b"server", b"uvicorn")],
        asyncio.Event(), expect_100_continue=True, keep_alive=keep_alive,
        on_response=lambda: completed.append(1))
    return cycle, transport, completed


def _state(cycle: RequestResponseCycle) -> tuple[Any, ...]:
    return (cycle.response_started, cycle.response_complete, cycle.chunked_encoding,
            cycle.waiting_for_100_continue, cycle.message_event.is_set())


HEADERS = [(b"content-type", b"text/event-stream"), (b"x-request-id", b"abc123")]
EVENTS = [b'data: {"a": 1}\n\n', b'data: {"b": 2}\n\ndata: [DONE]\n\n']


@pytest.mark.parametrize("keep_alive", [True, False], ids=["keep-alive", "close"])
@pytest.mark.parametrize("access_log", [True, False], ids=["logged", "not-logged"])
async def test_the_client_leg_writes_what_uvicorns_send_writes(
        keep_alive: bool, access_log: bool, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="uvicorn.access")
    asgi, asgi_wire, asgi_done = _cycle(keep_alive, access_log)
    await asgi.send({"type": "http.response.start", "status": 200, "headers": HEADERS})
    for event in EVENTS:
        await asgi.send({"type": "http.response.body", "body": event, "more_body": True})
    await asgi.send({"type": "http.response.body", "body": b"", "more_body": False})
    asgi_log = [r.getMessage() for r in caplog.records]
    caplog.clear()

    direct, direct_wire, direct_done = _cycle(keep_alive, access_log)
    leg = ClientLeg(arrival_ns=0)
    leg._cycle = direct  # as the protocol sets it when the request's headers are parsed
    head = leg.begin_chunked(200, HEADERS)
    assert head is not None
    leg.write_chunks(EVENTS[:1], head)  # the head with the first token, in one write
    assert _state(direct)[:3] == (True, False, True)
    leg.write_chunks(EVENTS[1:], last=True)  # [DONE] with the body's end

    assert b"".join(direct_wire.written) == b"".join(asgi_wire.written)
    assert len(direct_wire.written) == 2
    assert _state(direct) == _state(asgi)
    assert (direct_wire.closed, direct_done) == (asgi_wire.closed, asgi_done) \
        == (not keep_alive, [1])
    assert [r.getMessage() for r in caplog.records] == asgi_log
    assert len(asgi_log) == (1 if access_log else 0)
    assert leg.response_started and leg.response_complete
    assert leg.begin_chunked(200, HEADERS) is None  # a response starts once


async def test_a_response_that_cannot_start_here_is_left_to_asgi() -> None:
    cycle, wire, _ = _cycle(keep_alive=True, access_log=False)
    leg = ClientLeg(arrival_ns=0)
    assert leg.begin_chunked(200, HEADERS) is None  # no request's cycle yet
    leg._cycle = cycle
    cycle.disconnected = True
    assert leg.begin_chunked(200, HEADERS) is None  # the client is gone
    cycle.disconnected = False
    cycle.scope["method"] = "HEAD"
    assert leg.begin_chunked(200, HEADERS) is None  # no body to frame
    assert wire.written == [] and not cycle.response_started
