"""phasewatch's HTTP server protocol: uvicorn's httptools protocol plus what the relay needs.

This is the one module that touches uvicorn's internals (its protocol's hooks, its request
cycle's state, its flow control): pyproject.toml pins uvicorn to the minor versions it was
tested with (`TESTED_UVICORN`), and a test fails on any other. Parsing, keep-alive, pipelining,
graceful shutdown and every other route stay uvicorn's; heads are parsed by llhttp
(httptools). What it adds:
- the request's arrival: for a connection's first request the kernel's receive time of its
  first byte (arrival.py), for later ones `perf_counter_ns()` as their bytes come off the
  socket (before the headers are parsed, the app is called or its task is scheduled), so the
  time a request waits inside the proxy is inside its TTFT;
- bounds: a connection beyond uvicorn's `limit_concurrency` (which `phasewatch serve` sets from
  the open-file limit) is answered at once with a 503 in the OpenAI error format and closed;
  a head that does not arrive within the head timeout gets a 408 and the connection closes;
  a head llhttp refuses gets uvicorn's 400 with an OpenAI-format body;
- offered to the app as the ASGI scope extension `phasewatch.client_leg` (`ClientLeg`): a
  disconnect callback (no task per request waiting on ASGI's `receive`); a direct writer for a
  streamed response, which starts it (its head in the same write as the first chunk) and
  writes each read from the upstream as HTTP/1.1 chunks from the upstream's read callback,
  moving the cycle's state as uvicorn's own `send` does and telling the relay when the
  client's socket buffer fills and drains (back-pressure reaches the engine); and the lending
  of the client's socket to the native leg (`lend`/`reclaim`: reads paused and out of the
  poll set while the thread holds it).
When uvicorn starts shutting down it calls `shutdown()` on every connection; this protocol
passes that on to the app (its lifespan state offers a hook), so readiness fails and the grace
for open streams starts however the signal reached uvicorn (app/phasewatch/proxy/shutdown.py).

Under another ASGI server the extension is absent and the relay falls back to ASGI messages,
with the same bytes and the same timing definitions (arrival is then when the app is called).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from enum import Enum
from time import perf_counter_ns
from typing import Any

import orjson
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import (
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)
from uvicorn.protocols.utils import get_client_addr, get_path_with_query_string

from phasewatch.core.event_loop import PollSet
from phasewatch.core.log_throttle import LogThrottle
from phasewatch.proxy.arrival import KernelArrivals
from phasewatch.proxy.native import plain_fd

# The uvicorn minor versions this module was tested with: it moves uvicorn's request cycle as
# uvicorn's own `send` does, so pyproject.toml pins uvicorn to these (tests fail on another).
TESTED_UVICORN = ("0.55",)

CLIENT_LEG = "phasewatch.client_leg"
# The lifespan state key under which the app offers its shutdown's `begin` (shutdown.py).
SHUTDOWN_HOOK = "phasewatch.shutdown"
# The lifespan state keys of the head timeout (seconds) and of the kernel's arrival stamps.
HEAD_TIMEOUT = "phasewatch.head_timeout_s"
ARRIVALS = "phasewatch.arrivals"

log = logging.getLogger(__name__)


class Lending(Enum):
    """Whether the native leg holds this request's client socket (native.py)."""

    NO = "no"  # the server reads it
    PAUSED = "paused"  # lent: the server's reads were paused for it, and resume at its return
    WAS_PAUSED = "was_paused"  # lent while the server had paused its reads itself (pipelining)


class ClientLeg:
    """One request's view of its client connection, beyond ASGI."""

    __slots__ = ("_cycle", "_flow", "arrival_ns", "lending", "on_disconnect", "on_pause",
                 "on_resume", "plain_fd")

    def __init__(self, arrival_ns: int, plain_fd: int | None = None) -> None:
        self.arrival_ns = arrival_ns
        self.plain_fd = plain_fd  # the connection's socket, for the native leg (native.py)
        self._cycle: RequestResponseCycle | None = None
        self._flow: FlowControl | None = None  # the connection's read switch, while lent
        self.lending = Lending.NO
        # Set by the relay while it writes directly: called as the client's buffer fills/drains.
        self.on_pause: Callable[[], None] | None = None
        self.on_resume: Callable[[], None] | None = None
        # Set by the relay for the whole exchange: called once if the client disconnects.
        self.on_disconnect: Callable[[], None] | None = None

    def release(self) -> None:
        """The app is done with the request (main.py): let go of the server's cycle and the
        relay's callbacks. The cycle's scope holds this leg, and the callbacks the relay's
        exchange, so each request would otherwise leave them all to the cyclic collector.
        A socket still lent is reclaimed when the native leg hands its stream back."""
        self._cycle = None
        self.on_pause = self.on_resume = self.on_disconnect = None

    # -- the native leg (native.py) -----------------------------------------------------------

    def can_lend(self) -> bool:
        """The client's socket can go to the native leg now: the response has started here,
        nothing waits to be written to it, and it takes what is written."""
        cycle = self._cycle
        if (cycle is None or cycle.disconnected or cycle.response_complete
                or not cycle.response_started or cycle.flow.write_paused):
            return False
        transport = cycle.transport
        return not transport.is_closing() and not transport.get_write_buffer_size()

    def lend(self, poll_set: PollSet | None) -> None:
        """The native leg takes the client's socket (after `can_lend`): the server stops
        reading it and it leaves the event loop's poll set, so that the thread alone watches
        it (for its hang-up, and a request sent behind this one) and writes to it."""
        cycle = self._cycle
        assert cycle is not None and self.lending is Lending.NO
        flow = self._flow = cycle.flow
        self.lending = Lending.WAS_PAUSED if flow.read_paused else Lending.PAUSED
        flow.pause_reading()
        if poll_set is not None and self.plain_fd is not None:
            poll_set.forget(cycle.transport, self.plain_fd)

    def hung_up(self) -> None:
        """The native leg saw the client hang up (or its socket fail): the cycle is marked
        disconnected now, as the server's `connection_lost` will mark it, so that the app's end
        that follows is not taken for a response left incomplete; the connection is closed."""
        cycle = self._cycle
        if cycle is None:
            return  # (the app is done with it: the server hears the hang-up as reads resume)
        if not cycle.response_complete:
            cycle.disconnected = True
            cycle.message_event.set()
        cycle.transport.close()

    def reclaim(self) -> None:
        """The native leg handed the socket back: the server reads it again (unless it had
        paused its reads itself, which it undoes when the response completes)."""
        lending, self.lending = self.lending, Lending.NO
        flow, self._flow = self._flow, None
        if lending is Lending.PAUSED and flow is not None:
            flow.resume_reading()

    @property
    def cycle(self) -> RequestResponseCycle | None:
        return self._cycle

    @property
    def gone(self) -> bool:
        """The client has disconnected."""
        return self._cycle is not None and self._cycle.disconnected

    @property
    def paused(self) -> bool:
        """The client's socket buffer is full: it is not reading as fast as we write."""
        cycle = self._cycle
        return cycle is not None and cycle.flow.write_paused and not cycle.disconnected

    @property
    def transport(self) -> asyncio.Transport | None:
        """The client's transport while the response can still be written."""
        cycle = self._cycle
        if cycle is None or cycle.disconnected or cycle.response_complete:
            return None
        transport: asyncio.Transport = cycle.transport
        return None if transport.is_closing() else transport

    @property
    def response_started(self) -> bool:
        cycle = self._cycle
        return cycle is not None and cycle.response_started

    @property
    def response_complete(self) -> bool:
        """The response's end has been written (`write_chunks(..., last=True)`)."""
        cycle = self._cycle
        return cycle is not None and cycle.response_complete

    def begin_chunked(self, status: int, headers: list[tuple[bytes, bytes]]) -> bytes | None:
        """Start a chunked response without an ASGI message (`start_chunked`) and return its
        head, to go out in the same write as the first chunks. None when it cannot start here
        (the client is gone, the response has started, a HEAD request): ASGI then starts it.
        The headers are `client_response_headers`' (lower-case, no hop-by-hop); their values
        come from parsed requests and responses, so they hold no CR or LF."""
        cycle = self._cycle
        if cycle is None or not self.start_chunked(status):
            return None
        # The status line and the server's own headers (`date`, `server`), the upstream's, and
        # the end: `connection: close` when the connection is not kept alive.
        head = [STATUS_LINE[status]]
        for name, value in (*cycle.default_headers, *headers):
            head += (name, b": ", value, b"\r\n")
        head.append(b"transfer-encoding: chunked\r\n\r\n" if cycle.keep_alive
                    else b"connection: close\r\ntransfer-encoding: chunked\r\n\r\n")
        return b"".join(head)

    def start_chunked(self, status: int) -> bool:
        """Move the cycle's state as uvicorn's `send` of `http.response.start` moves it for a
        chunked response (its access log line too), the head being written by the caller;
        False when it cannot start here (as `begin_chunked`)."""
        cycle = self._cycle
        if (cycle is None or cycle.disconnected or cycle.response_started
                or cycle.scope["method"] == "HEAD"):
            return False
        cycle.response_started = True
        cycle.waiting_for_100_continue = False
        cycle.chunked_encoding = True
        if cycle.access_log:
            cycle.access_logger.info('%s - "%s %s HTTP/%s" %d', get_client_addr(cycle.scope),
                                     cycle.scope["method"],
                                     get_path_with_query_string(cycle.scope),
                                     cycle.scope["http_version"], status)
        return True

    def write_raw(self, data: bytes) -> None:
        """Write bytes of the body already framed as HTTP/1.1 chunks (by the native leg)."""
        transport = self.transport
        if transport is not None:
            transport.write(data)

    def write_chunk(self, data: bytes) -> None:
        """Write one HTTP/1.1 chunk of the response body that ASGI started (chunked)."""
        transport = self.transport
        if transport is not None:
            transport.write(b"%x\r\n%b\r\n" % (len(data), data))

    def write_chunks(self, pieces: list[bytes], head: bytes = b"", last: bool = False) -> None:
        """Write each piece as one HTTP/1.1 chunk, all in one write: after `head` (the
        response's head from `begin_chunked`) when it goes out with them, and with the body's
        end when they are its `last` (the response is then complete, as uvicorn's `send` of the
        last body message leaves it: keep-alive and pipelining go on from there)."""
        transport = self.transport
        if transport is None:
            return
        data = head + b"".join([b"%x\r\n%b\r\n" % (len(p), p) for p in pieces])
        cycle = self._cycle
        if not last or cycle is None or not cycle.chunked_encoding:
            transport.write(data)
            return
        transport.write(data + b"0\r\n\r\n")
        self._complete(cycle, transport)

    def end_written(self, unsent: bytes) -> None:
        """The native leg wrote the response's end, all but `unsent` (framed bytes its last
        send left, written here): the response is complete, as `write_chunks` with `last`
        leaves it, and nothing more is written to it."""
        transport, cycle = self.transport, self._cycle
        if transport is not None and cycle is not None:
            if unsent:
                transport.write(unsent)
            self._complete(cycle, transport)

    @staticmethod
    def _complete(cycle: RequestResponseCycle, transport: asyncio.Transport) -> None:
        cycle.response_complete = True
        cycle.message_event.set()
        if not cycle.keep_alive:
            transport.close()
        cycle.on_response()


# The answer to a request whose head did not arrive within the head timeout.
def _timed_out_answer(timeout_s: float) -> bytes:
    body = orjson.dumps({"error": {
        "message": f"the request's head did not arrive within {timeout_s:g} s "
                   "(PHASEWATCH_CLIENT_HEAD_TIMEOUT_S)",
        "type": "request_timeout", "param": None, "code": 408}})
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%b" % (len(body), body))


# The answer to a connection over the limit, written as soon as it is accepted.
_OVER_CAPACITY_BODY = orjson.dumps({"error": {
    "message": "phasewatch is at its connection capacity (the open-file limit): retry shortly",
    "type": "service_unavailable", "param": None, "code": 503}})
OVER_CAPACITY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\nretry-after: 1\r\nconnection: close\r\n\r\n%b"
                 % (len(_OVER_CAPACITY_BODY), _OVER_CAPACITY_BODY))
_REFUSAL_LOG_INTERVAL_S = 10.0


class PhasewatchHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, stamping arrivals and offering the direct writer; past
    uvicorn's `limit_concurrency` it refuses a new connection at once with a JSON 503 (which
    uvicorn would answer in plain text, and only after reading a request)."""

    _read_ns = 0
    _first_ns: int | None = None  # the kernel's receive time of the first byte (arrival.py)
    _plain_fd: int | None = None
    _leg: ClientLeg | None = None
    _refusing = False  # this connection is over the limit: answered 503, being closed
    # A request's head is being read: from its first byte (or the connection's start) to its
    # end, and `_head_timer` ends the connection if that takes longer than the head timeout.
    _in_head = True
    _head_timer: asyncio.TimerHandle | None = None
    # (Class-wide) the connections refused so far, logged at most every 10 s.
    _refusals = LogThrottle(_REFUSAL_LOG_INTERVAL_S)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        fd = self._plain_fd = plain_fd(transport)
        limit = self.limit_concurrency
        if limit is not None and len(self.connections) >= limit:
            # Out of the count at once (not when the close completes), so that uvicorn's own
            # check never sees the refused and answers an admitted request in plain text.
            self.connections.discard(self)
            self._refusing = True
            transport.write(OVER_CAPACITY)
            transport.close()
            refusals = PhasewatchHttpProtocol._refusals
            if refusals.occurred() is not None:
                log.warning("connection limit %d reached: %d connection(s) refused with 503 so "
                            "far (raise the open-file limit, or add workers/replicas)", limit,
                            refusals.count)
            return
        arrivals: KernelArrivals | None = self.app_state.get(ARRIVALS)
        if arrivals is not None and fd is not None:
            self._first_ns = arrivals.first_byte_ns(fd)
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        if self._refusing:
            return  # answered 503 already; its request is not read
        now_ns = perf_counter_ns()
        first_ns, self._first_ns = self._first_ns, None
        self._read_ns = now_ns if first_ns is None or first_ns > now_ns else first_ns
        super().data_received(data)
        if self._in_head:
            if self._head_timer is None:
                self._arm_head_timer()
        elif self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def send_400_response(self, msg: str) -> None:
        """A request llhttp refuses (malformed, bare LF, smuggling attempts): uvicorn's 400 and
        close, its body in the OpenAI error format as every other refusal here."""
        body = orjson.dumps({"error": {"message": f"invalid HTTP request: {msg}",
                                       "type": "invalid_request_error", "param": None,
                                       "code": 400}})
        self.transport.write(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\nconnection: close\r\n\r\n%b"
                             % (len(body), body))
        self.transport.close()

    # -- the head timeout -----------------------------------------------------------------------

    def _arm_head_timer(self) -> None:
        timeout_s = self.app_state.get(HEAD_TIMEOUT)
        if timeout_s and not self.transport.is_closing():
            self._head_timer = self.loop.call_later(timeout_s, self._head_timed_out, timeout_s)

    def _head_timed_out(self, timeout_s: float) -> None:
        """A head begun (or awaited on a new connection) for the head timeout: a 408 in the
        OpenAI error format, and the connection closed. Behind a response still under way it
        closes after that response instead."""
        self._head_timer = None
        transport = self.transport
        if transport.is_closing() or not self._in_head:
            return
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.keep_alive = False
            self.flow.pause_reading()
            return
        transport.write(_timed_out_answer(timeout_s))
        transport.close()

    def on_message_begin(self) -> None:
        self._in_head = True
        super().on_message_begin()
        self._leg = ClientLeg(self._read_ns, self._plain_fd)
        # ASGI types extensions as dict[str, dict]; ours is an object the relay knows.
        self.scope["extensions"] = {CLIENT_LEG: self._leg}  # type: ignore[dict-item]

    def on_headers_complete(self) -> None:
        self._in_head = False
        super().on_headers_complete()
        if self._leg is not None:
            self._leg._cycle = self.cycle

    def shutdown(self) -> None:
        """uvicorn is shutting down (it calls this on every connection): tell the app, so its
        readiness fails and the grace for open streams starts (app/phasewatch/proxy/shutdown.py)."""
        begin = self.app_state.get(SHUTDOWN_HOOK)
        if callable(begin):
            begin()
        super().shutdown()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().connection_lost(exc)
        leg = self._writing_leg()
        if leg is not None and leg.on_disconnect is not None:
            leg.on_disconnect()

    def pause_writing(self) -> None:
        super().pause_writing()
        leg = self._writing_leg()
        if leg is not None and leg.on_pause is not None:
            leg.on_pause()

    def resume_writing(self) -> None:
        super().resume_writing()
        leg = self._writing_leg()
        if leg is not None and leg.on_resume is not None:
            leg.on_resume()

    def _writing_leg(self) -> ClientLeg | None:
        cycle = self.cycle
        if cycle is None:
            return None
        leg: Any = cycle.scope.get("extensions", {}).get(CLIENT_LEG)
        return leg if isinstance(leg, ClientLeg) else None


def client_leg(scope: Any) -> ClientLeg | None:
    leg = scope.get("extensions", {}).get(CLIENT_LEG)
    return leg if isinstance(leg, ClientLeg) else None
