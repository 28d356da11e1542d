"""(Prototype, off by default) The native front: a kept-alive client's next request, taken by
the native thread with no Python until its end.

When a stream the native leg started at its head ends cleanly (its response's end written and
taken), its client connection and upstream connection stay with the thread (`_native.c`): the
event loop pauses its reads of the client and lends both to it. The thread reads the client's
next request; a plain one (a streamed completion or chat request, `Content-Length` body, no
`stream_options`, nothing the relay reads besides `x-request-id`) it plans and sends upstream
itself, and relays its stream as it does one started at its head. Python hears of it at its
end, in the batch of the thread's quiet endings, and files its record and figures from what
the thread logged (`FrontRequests`). Anything else goes back to uvicorn with every byte read.

What this prototype leaves out, and a production front needs: a front request's place in the
in-flight gauges and the live view while it runs, its idle and stall timeouts, shutdown's
grace for it, and, where its stream comes back early (an error, a broken upstream), the
Python path taking it over (here the connection is closed).
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import orjson

from phasewatch.core.admin import ADMIN_TOKEN_HEADER
from phasewatch.core.records import Outcome, RequestRecord
from phasewatch.proxy.finish import finish
from phasewatch.proxy.labels import model_name
from phasewatch.proxy.native import Ending, replay
from phasewatch.proxy.timing import NS, StreamTiming

if TYPE_CHECKING:
    from phasewatch.proxy.client_leg import ClientLeg
    from phasewatch.proxy.context import ProxyContext
    from phasewatch.proxy.native import Stream
    from phasewatch.proxy.upstream_pool import UpstreamConnection

log = logging.getLogger(__name__)

_ENDPOINTS = ("completions", "chat.completions")
FRONT_EOF, FRONT_PYTHON, FRONT_STREAM, FRONT_ASKED = 1, 2, 3, 4
_STOCK = 64  # streams the thread has at hand for the front's requests


class FrontConn:
    """A client connection (and its upstream connection) kept for the thread."""

    __slots__ = ("conn", "lent", "protocol")

    def __init__(self, protocol: Any, conn: UpstreamConnection) -> None:
        self.protocol = protocol
        self.conn = conn
        self.lent = False

    def let_go(self, why: int, data: bytes) -> None:
        """The thread let the connection go: closed, or a request for uvicorn (`data`)."""
        if not self.lent:
            return  # never lent: the relay went on with both connections
        protocol, conn = self.protocol, self.conn
        if why == FRONT_PYTHON:
            conn.resume_reading()
            conn.finish(reusable=True)
            transport = protocol.transport
            if not transport.is_closing():
                transport.resume_reading()
                protocol.data_received(data)
            return
        conn.close()
        protocol.transport.close()


class Front:
    """The event loop's side of the front: lending connections, filing its requests."""

    def __init__(self, ctx: ProxyContext) -> None:
        self._ctx = ctx
        self._configured = False
        self._stock = 0
        self.requests = FrontRequests(ctx)

    def keep(self, leg: ClientLeg, conn: UpstreamConnection) -> FrontConn | None:
        """The connection object for a stream started at its head whose connections may be
        kept at its end (the client's reads paused from here: the thread reads it next);
        None where they may not."""
        native = self._ctx.native
        cycle = leg._cycle
        protocol = leg.protocol
        if (native is None or cycle is None or not cycle.keep_alive or protocol is None
                or leg.followed or protocol.transport.is_closing()):
            return None
        if not self._configured:
            self._configured = True
            pool, settings = self._ctx.pool, self._ctx.settings
            rest = b"".join(b"%b: %b\r\n" % (name, value)
                            for name, value in cycle.default_headers if name != b"date")
            date = any(name == b"date" for name, _ in cycle.default_headers)
            native.front_config(date, rest, pool.prefix, pool.host_header,
                                ADMIN_TOKEN_HEADER, settings.max_body_bytes)
            self.restock()
        protocol.transport.pause_reading()
        return FrontConn(protocol, conn)

    @staticmethod
    def not_kept(leg: ClientLeg) -> None:
        """The stream came back without its connections kept: the client's reads resume."""
        keep, leg.front = leg.front, None
        if keep is not None:
            transport = keep.protocol.transport
            if not transport.is_closing():
                transport.resume_reading()

    def restock(self) -> None:
        native = self._ctx.native
        if native is not None and self._configured:
            self._stock = native.stock(self.requests, max(0, _STOCK - self._stock))

    @staticmethod
    def kept(leg: ClientLeg) -> None:
        """A kept stream's clean end: its connections are the thread's now. The server's
        cycle completes without arming its keep-alive timeout (the thread reads the client)."""
        keep, leg.front = leg.front, None
        assert keep is not None
        keep.lent = True
        protocol = keep.protocol
        leg.end_written(b"")
        task = protocol.timeout_keep_alive_task
        if task is not None:
            task.cancel()
            protocol.timeout_keep_alive_task = None


class FrontRequests:
    """The owner of the front's streams: each request's record and figures at its end."""

    def __init__(self, ctx: ProxyContext) -> None:
        self._ctx = ctx

    def native_returned(self, stream: Stream) -> None:
        info = stream.front
        if info is None:
            return
        ctx = self._ctx
        front = ctx.front
        if front is not None:
            front._stock -= 1
        rid, arrival_ns, wall_ns, sent_ns, model_json, endpoint = info
        model = model_name(orjson.loads(model_json)) if model_json is not None else None
        record = RequestRecord(
            request_id=rid.decode("latin-1"),
            started_at=datetime.fromtimestamp(wall_ns / NS, UTC),
            endpoint=_ENDPOINTS[endpoint],
            model=model,
            upstream=ctx.upstream,
            stream=True,
            outcome=Outcome.OK,
            http_status=200,
            in_flight_at_arrival=ctx.in_flight,
            run_id=None,
        )
        timing = StreamTiming(arrival_ns)
        timing.single_choice = True
        label = ctx.labels.label(model, True)
        bound = ctx.metrics.bind(label, record.endpoint)
        timing.observe_ttft, timing.observe_itl = bound.observe_ttft, bound.observe_itl
        timing.observe_itl_counts = bound.observe_itl_counts
        timing.itl_bounds = bound.itl_bounds
        ctx.metrics.observe_proxy_queue((sent_ns - arrival_ns) / NS)
        replay(stream, timing)
        done_ns = stream.done_ns
        clean = stream.ending == Ending.ENDED and stream.end_written and not stream.unsent
        if done_ns:
            timing.end_ns = done_ns
        if not clean:
            record.outcome = Outcome.STREAM_ERROR
            record.error = "the front's stream came back early (prototype: connection closed)"
        if timing.end_ns is None:
            timing.end_ns = stream.leftover_ns or arrival_ns
        finish(ctx, record, timing, None)
