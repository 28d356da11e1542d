"""phasewatch's HTTP server protocol: uvicorn's httptools protocol plus what the relay needs.

A connection beyond uvicorn's `limit_concurrency` (which `phasewatch serve` sets from the
open-file limit) is answered at once with a 503 in the OpenAI error format and closed, so
descriptors never run out under a flood of streams. And three additions, offered to the app
as the ASGI scope extension `phasewatch.client_leg`:
- the request's arrival, read with `perf_counter_ns()` when its first bytes come off the socket
  (before the headers are parsed, the app is called or its task is scheduled), so the time a
  request waits inside the proxy is inside its TTFT and visible in the queueing histogram;
- a disconnect callback, so the relay learns that its client left without a task per request
  waiting on ASGI's `receive` for it;
- a direct writer for a streamed response: the relay starts the response (its head, in the
  same write as the first chunk) and writes each read from the upstream onto the client's
  transport, framed as HTTP/1.1 chunks, from the upstream's read callback, instead of one ASGI
  message (and task wake-up) per chunk. The cycle's state moves as uvicorn's own `send` moves
  it, so keep-alive and pipelining stay uvicorn's. The writer tells the relay when the
  client's socket buffer fills and drains, so the relay stops and resumes reading from the
  upstream: back-pressure reaches the engine as it would through a plain TCP proxy.

When uvicorn starts shutting down it calls `shutdown()` on every connection; this protocol
passes that on to the app (its lifespan state offers a hook), so readiness fails and the grace
for open streams starts however the signal reached uvicorn (app/proxy/shutdown.py).

Everything else (parsing, keep-alive, pipelining, graceful shutdown, every other route) is
uvicorn's. Under another ASGI server the extension is absent and the relay falls back to ASGI
messages, with the same bytes and the same timing definitions (arrival is then when the app
is called).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from enum import Enum
from time import perf_counter_ns
from typing import Any

import orjson
from uvicorn.protocols.http.httptools_impl import (
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)
from uvicorn.protocols.utils import get_client_addr, get_path_with_query_string

from phasewatch.core.log_throttle import LogThrottle
from phasewatch.proxy.native import plain_fd

CLIENT_LEG = "phasewatch.client_leg"
# The lifespan state key under which the app offers its shutdown's `begin` (shutdown.py).
SHUTDOWN_HOOK = "phasewatch.shutdown"
# The lifespan state key under which the app offers the native leg's `take_ended` (native.py):
# each read of a client's bytes first takes back the streams that ended quietly, so that a
# request after a response's end finds that response complete and its record finished.
ENDED_HOOK = "phasewatch.native_ended"

log = logging.getLogger(__name__)


class Lending(Enum):
    """Where a client connection is with the native front (front.py)."""

    NO = "no"  # the event loop reads it
    STREAM = "stream"  # a stream that may keep it is in the native leg: reads paused
    IDLE = "idle"  # the native thread holds it between requests


class ClientLeg:
    """One request's view of its client connection, beyond ASGI."""

    __slots__ = ("_cycle", "adoption", "arrival_ns", "followed", "front", "on_disconnect",
                 "on_followed", "on_pause", "on_resume", "plain_fd", "protocol")

    def __init__(self, arrival_ns: int, plain_fd: int | None = None,
                 protocol: Any = None) -> None:
        self.arrival_ns = arrival_ns
        self.protocol = protocol  # the connection's (the native front's, front.py)
        self.front: Any = None  # the connections, kept at the stream's end (front.py)
        self.adoption: Any = None  # a front's request the relay takes over (front.py)
        self.plain_fd = plain_fd  # the connection's socket, for the native leg (native.py)
        self._cycle: RequestResponseCycle | None = None
        # Set by the relay while it writes directly: called as the client's buffer fills/drains.
        self.on_pause: Callable[[], None] | None = None
        self.on_resume: Callable[[], None] | None = None
        # Set by the relay for the whole exchange: called once if the client disconnects.
        self.on_disconnect: Callable[[], None] | None = None
        # A request is queued behind this one on its connection (pipelined): it starts when
        # this response's cycle completes. `on_followed` (set by the relay while the native
        # leg holds the stream) is called when that becomes true.
        self.followed = False
        self.on_followed: Callable[[], None] | None = None

    def release(self) -> None:
        """The app is done with the request (main.py): let go of the server's cycle and the
        relay's callbacks. The cycle's scope holds this leg, and the callbacks the relay's
        exchange, so each request would otherwise leave them all to the cyclic collector."""
        self._cycle = None
        self.on_pause = self.on_resume = self.on_disconnect = self.on_followed = None
        self.protocol = self.front = self.adoption = None

    def queued_behind(self) -> None:
        """The server queued a request behind this one (`PhasewatchHttpProtocol`)."""
        self.followed = True
        if self.on_followed is not None:
            self.on_followed()

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
        parts = self.head_parts(status)
        if parts is None or not self.start_chunked(status):
            return None
        prefix, end = parts
        head = [prefix]
        for name, value in headers:
            head += (name, b": ", value, b"\r\n")
        head.append(end)
        return b"".join(head)

    def head_parts(self, status: int = 200) -> tuple[bytes, bytes] | None:
        """What a chunked response's head holds around the upstream's headers: the status line
        and the server's own headers (`date`, `server`), and its end (`connection: close` when
        the connection is not kept alive, `transfer-encoding: chunked`, the blank line). The
        native leg writes a head from them (native.py). None when the response cannot start
        here (as `begin_chunked`)."""
        cycle = self._cycle
        if (cycle is None or cycle.disconnected or cycle.response_started
                or cycle.scope["method"] == "HEAD"):
            return None
        prefix = [STATUS_LINE[status]]
        for name, value in cycle.default_headers:
            prefix += (name, b": ", value, b"\r\n")
        end = (b"transfer-encoding: chunked\r\n\r\n" if cycle.keep_alive
               else b"connection: close\r\ntransfer-encoding: chunked\r\n\r\n")
        return b"".join(prefix), end

    def start_chunked(self, status: int) -> bool:
        """Move the cycle's state as uvicorn's `send` of `http.response.start` moves it for a
        chunked response (its access log line too), the head being written by the caller (or
        by the native leg); False when it cannot start here (as `begin_chunked`)."""
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
    _plain_fd: int | None = None
    _leg: ClientLeg | None = None
    _refusing = False  # this connection is over the limit: answered 503, being closed
    _take_ended: Callable[[], None] | None = None
    # Where the connection is with the native front (front.py): one value.
    lending = Lending.NO
    shutting_down = False  # uvicorn asked this connection to shut down
    _adoption: Any = None  # a front's request the next message is (front.py `Adoption`)
    # (Class-wide) the connections refused so far, logged at most every 10 s.
    _refusals = LogThrottle(_REFUSAL_LOG_INTERVAL_S)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._plain_fd = plain_fd(transport)
        self._take_ended = self.app_state.get(ENDED_HOOK)
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

    def data_received(self, data: bytes) -> None:
        if self._refusing:
            return  # answered 503 already; its request is not read
        self._read_ns = perf_counter_ns()
        if self._take_ended is not None:
            self._take_ended()
        super().data_received(data)

    # -- the native front (front.py) -----------------------------------------------------------

    def lend(self) -> None:
        """A stream going to the native leg may keep this connection at its end: reads pause
        (the thread reads the next request; a disconnect is heard on its writes)."""
        self.lending = Lending.STREAM
        self.transport.pause_reading()

    def lent_idle(self) -> None:
        """The thread holds the connection between requests: no keep-alive timeout here."""
        self.lending = Lending.IDLE
        task = self.timeout_keep_alive_task
        if task is not None:
            task.cancel()
            self.timeout_keep_alive_task = None

    def from_front(self, data: bytes, arrival_ns: int, close: bool = False) -> None:
        """The connection is the event loop's again, with the bytes the thread read of the next
        request (`arrival_ns`: when their first came); closed if `close` (it was idle for the
        keep-alive timeout)."""
        was, self.lending = self.lending, Lending.NO
        transport = self.transport
        if was is Lending.NO or transport.is_closing():
            return
        if close:
            transport.close()
            return
        transport.resume_reading()
        if data:
            self._take_front(data, arrival_ns)
        if self.shutting_down:  # as uvicorn's shutdown left it: closed if idle, else after
            super().shutdown()
        elif was is Lending.IDLE and not data and self.timeout_keep_alive_task is None:
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def adopt(self, request: bytes, adoption: Any) -> bool:
        """Take a front's request over: its bytes go through uvicorn again, and the relay,
        seeing `adoption`, goes on from where the thread left the stream. False when the
        client's connection is gone."""
        self.lending = Lending.NO
        transport = self.transport
        if transport.is_closing():
            return False
        self._adoption = adoption
        transport.resume_reading()
        self._take_front(request, adoption.arrival_ns)
        if self._adoption is not None:  # uvicorn did not make it a request: nobody takes it
            self._adoption = None
            return False
        if self.shutting_down:  # its connection closes after its answer
            super().shutdown()
        return True

    def _take_front(self, data: bytes, arrival_ns: int) -> None:
        if self._take_ended is not None:
            self._take_ended()
        self._read_ns = arrival_ns or perf_counter_ns()
        super().data_received(data)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        ahead, cycle = self._leg, self.cycle
        if ahead is not None and cycle is not None and not cycle.response_complete:
            # Pipelined: this request waits for the one ahead's cycle to complete (uvicorn
            # queues it), so that one's end must not wait for the event loop's next wake-up.
            ahead.queued_behind()
        leg = self._leg = ClientLeg(self._read_ns, self._plain_fd, self)
        if self._adoption is not None:
            leg.adoption, self._adoption = self._adoption, None
        # ASGI types extensions as dict[str, dict]; ours is an object the relay knows.
        self.scope["extensions"] = {CLIENT_LEG: self._leg}  # type: ignore[dict-item]

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        if self._leg is not None:
            self._leg._cycle = self.cycle

    def shutdown(self) -> None:
        """uvicorn is shutting down (it calls this on every connection): tell the app, so its
        readiness fails and the grace for open streams starts (app/proxy/shutdown.py)."""
        begin = self.app_state.get(SHUTDOWN_HOOK)
        if callable(begin):
            begin()
        self.shutting_down = True
        if self.lending is Lending.NO:  # (else when the native front gives it back)
            super().shutdown()

    def connection_lost(self, exc: Exception | None) -> None:
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
