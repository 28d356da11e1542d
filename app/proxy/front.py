"""The native front: a kept-alive client's next request, taken by the native thread.

A stream the native leg takes at its head (native.py) may also keep its connections: the
client's reads are paused in the event loop from then on, and when the stream ends cleanly
(its response's end written and taken by the client's socket) the thread keeps both the
client's connection and the upstream's (`_native.c`, "the front"). It reads the client's next
request itself. A plain one (a streamed `/v1/completions` or `/v1/chat/completions`, a
`Content-Length` body of JSON in valid UTF-8 with `"stream": true`, `n` absent, null or 1, no
`stream_options` or the client's own asking for usage on every chunk; no header the relay
reads but `x-request-id`) it plans as `plan_request` does (`stream_options` appended before
the closing brace, or the body as it came), sends upstream on the kept connection
with the headers the Python path forwards, and relays as a stream started at its head. So
such a request costs the event loop nothing until Python looks at it. Anything else goes back
to uvicorn with every byte the thread read (and the arrival time of the first), as does the
connection when the upstream closed it while idle, when phasewatch shuts down, or when the
thread has no stream object at hand (`Front.restock`).

Python looks at the front's streams in batches (`catch_up`): on each pass of the live
registry, before each render of `/metrics`, each snapshot and each shutdown step. Each becomes
a `FrontStream` then: its record and timing begun, its first token replayed, counted in flight
and watched like any held stream (timeouts, live gauges, snapshot, shutdown). A stream that
ends before any look is caught up at its end. A stream that comes back cleanly ended is
finished from what the thread logged. One that comes back early (an upstream's status other
than 200 or an unusual head, an error event, a broken socket, a timeout or shutdown asking for
it) is taken over by the Python path where the thread left it: the request's bytes go through
uvicorn again, flagged (`Adoption`), and the relay, instead of sending the request, takes the
kept upstream connection and the stream back as if its own native leg had held it
(`Exchange.native_returned`), so every byte the client gets and every figure are the Python
path's from there.

Off with `PHASEWATCH_NATIVE_FRONT=false`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import Enum
from time import perf_counter_ns
from typing import TYPE_CHECKING

import orjson

from phasewatch.core.admin import ADMIN_TOKEN_HEADER
from phasewatch.core.live import InFlight
from phasewatch.core.log_throttle import LogThrottle
from phasewatch.core.metrics import request_exemplar
from phasewatch.core.records import Outcome, RequestRecord
from phasewatch.proxy.finish import finish
from phasewatch.proxy.labels import model_name
from phasewatch.proxy.live import LiveView, in_flight_view
from phasewatch.proxy.native import Ending, replay
from phasewatch.proxy.timing import NS, StreamTiming

if TYPE_CHECKING:
    from phasewatch.proxy.client_leg import ClientLeg, PhasewatchHttpProtocol
    from phasewatch.proxy.context import ProxyContext
    from phasewatch.proxy.native import Stream
    from phasewatch.proxy.upstream_pool import UpstreamConnection

log = logging.getLogger(__name__)
_FAULTS = LogThrottle()

ENDPOINTS = ("completions", "chat.completions")
# Stream objects the thread has at hand for the front's requests, made up on every batch it
# hands back and every pass (each a few hundred bytes until the thread takes it). A request
# that finds none goes to Python.
STOCK = 256


class FrontConn:
    """A client connection and its upstream connection, kept by the thread between requests."""

    __slots__ = ("conn", "protocol")

    def __init__(self, protocol: PhasewatchHttpProtocol, conn: UpstreamConnection) -> None:
        self.protocol = protocol
        self.conn = conn

    def give_back(self, data: bytes = b"", arrival_ns: int = 0, broken: bool = False,
                  expired: bool = False) -> None:
        """Both connections back to the event loop: the upstream's to the pool (closed if
        `broken`: the upstream closed it, sent what nobody asked for, or took part of a
        request), the client's to uvicorn, with the bytes the thread read of its next request
        (`arrival_ns`: when the first came), or closed if `expired` (idle for the server's
        keep-alive timeout, as uvicorn closes its own)."""
        conn, protocol = self.conn, self.protocol
        if broken:
            conn.close()
        else:
            conn.resume_reading()
            conn.finish(reusable=True)
        protocol.from_front(data, arrival_ns, close=expired)


class Front:
    """The event loop's side of the front."""

    def __init__(self, ctx: ProxyContext) -> None:
        self._ctx = ctx
        self._configured = False
        self._keep_alive_ns = 0
        self.requests = FrontRequests(ctx)

    def keep(self, leg: ClientLeg, conn: UpstreamConnection) -> FrontConn | None:
        """For a stream going to the native leg at its head: its connections, to be kept at a
        clean end (the client's reads pause here: the thread reads it next); None where they
        are not to be (the connection is not kept alive, a request is queued behind, the
        front has stopped)."""
        native, cycle, protocol = self._ctx.native, leg.cycle, leg.protocol
        if (native is None or cycle is None or protocol is None or not cycle.keep_alive
                or leg.followed or protocol.transport.is_closing() or protocol.shutting_down):
            return None
        if not self._configured:
            self._configured = True
            pool, settings = self._ctx.pool, self._ctx.settings
            date = any(name == b"date" for name, _ in cycle.default_headers)
            rest = b"".join(b"%b: %b\r\n" % (name, value)
                            for name, value in cycle.default_headers if name != b"date")
            native.front_config(date, rest, pool.prefix, pool.host_header, ADMIN_TOKEN_HEADER,
                                settings.max_body_bytes)
            self._keep_alive_ns = int(protocol.timeout_keep_alive * NS)
            self.restock()
        protocol.lend()
        return FrontConn(protocol, conn)

    @staticmethod
    def not_kept(leg: ClientLeg) -> None:
        """The stream came back without its connections kept: the client's reads resume."""
        keep, leg.front = leg.front, None
        if keep is not None:
            keep.protocol.from_front(b"", 0)

    @staticmethod
    def kept(leg: ClientLeg) -> None:
        """A kept stream's clean end: the connections are the thread's. The server's cycle
        completes, its keep-alive timeout not armed: the thread watches the connection."""
        keep, leg.front = leg.front, None
        if keep is not None:
            leg.end_written(b"")
            keep.protocol.lent_idle()

    def restock(self) -> None:
        """`STOCK` stream objects at the thread's hand again."""
        native = self._ctx.native
        if native is not None and self._configured:
            native.stock(self.requests, STOCK)

    def expire(self, now_ns: int) -> None:
        """On each pass of the live registry: connections the thread has held idle for the
        server's keep-alive timeout go back to it, which closes them as it closes its own."""
        native = self._ctx.native
        if native is not None and self._configured:
            native.front_expire(now_ns - self._keep_alive_ns)

    def catch_up(self) -> None:
        """Look at the front's streams started since the last look."""
        native = self._ctx.native
        if native is None or not self._configured:
            return
        self.restock()
        for stream in native.front_started():
            try:
                FrontStream(self._ctx, stream).watch()
            except Exception:
                _FAULTS.exception(log, "could not take in a request of the native front")

    def stop(self) -> None:
        """Shutting down: the thread takes no more requests, and gives the connections back."""
        native = self._ctx.native
        if native is not None and self._configured:
            native.front_stop()


class FrontRequests:
    """The owner of the front's streams until Python looks at them (`catch_up`)."""

    def __init__(self, ctx: ProxyContext) -> None:
        self._ctx = ctx

    def native_returned(self, stream: Stream) -> None:
        """A stream that came back before Python looked at it."""
        FrontStream(self._ctx, stream).native_returned(stream)


class Where(Enum):
    """Where a front's request is (one value, moved by `FrontStream`)."""

    HELD = "held"  # the thread relays it
    WATCHED = "watched"  # held, and in the live registry
    ENDED = "ended"  # it came back cleanly ended, and is finished
    TAKEN_OVER = "taken_over"  # it came back early: the Python path goes on with it


@dataclass(slots=True)
class Adoption:
    """A front's request that the Python path takes over (relay.py): the stream as the thread
    left it, the kept upstream connection its request went out on, and the facts the thread
    took at its arrival."""

    stream: Stream
    conn: UpstreamConnection
    timing: StreamTiming  # what Python replayed of it so far
    request_id: str
    arrival_ns: int
    started_at: datetime
    sent_ns: int
    in_flight: int
    forced: str | None  # the live registry ended it while the thread held it: which ending


class FrontStream:
    """A front's request, as Python sees it once it looked (the live registry's `Watched`)."""

    __slots__ = ("_ctx", "_forced", "_replayed_ns", "_stream", "client_blocked_ns", "info",
                 "label", "last_read_ns", "record", "timing", "where")

    def __init__(self, ctx: ProxyContext, stream: Stream) -> None:
        info = stream.front
        assert info is not None
        self._ctx = ctx
        self._stream = stream
        self.info = info
        rid, arrival_ns, wall_ns, _, model_json, endpoint, in_flight = info
        model = model_name(orjson.loads(model_json)) if model_json is not None else None
        self.record = RequestRecord(
            request_id=rid.decode("latin-1"), started_at=datetime.fromtimestamp(wall_ns / NS, UTC),
            endpoint=ENDPOINTS[endpoint], model=model, upstream=ctx.upstream, stream=True,
            outcome=Outcome.OK, http_status=None, in_flight_at_arrival=in_flight, run_id=None)
        timing = self.timing = StreamTiming(arrival_ns)
        timing.single_choice = True
        self.label = ctx.labels.label(model, False)
        self.last_read_ns = arrival_ns
        self.client_blocked_ns = 0
        self._replayed_ns = 0
        self._forced: str | None = None
        self.where = Where.HELD
        stream.owner = self
        ctx.metrics.native_front.inc()

    def watch(self) -> None:
        """Counted in flight and watched, its head and first token (if come) replayed."""
        ctx = self._ctx
        ctx.in_flight += 1
        ctx.metrics.in_flight.inc()
        ctx.metrics.native_streams.inc()
        native = ctx.native
        if native is not None:
            native.in_flight = ctx.in_flight
        ctx.live.watch(self)
        ctx.live.hold(self)
        self.where = Where.WATCHED
        self._replay()

    def _unwatch(self) -> None:
        if self.where is Where.WATCHED:
            ctx = self._ctx
            ctx.live.forget(self)
            ctx.in_flight -= 1
            ctx.metrics.in_flight.dec()
            native = ctx.native
            if native is not None:
                native.in_flight = ctx.in_flight

    def _replay(self) -> None:
        stream, timing = self._stream, self.timing
        if self.record.http_status is None and stream.head is not None:
            # The thread took a 200 event stream's head: served, the model earns its label.
            ctx, record = self._ctx, self.record
            record.http_status = 200
            self.label = ctx.labels.label(record.model, True)
            bound = ctx.metrics.bind(self.label, record.endpoint)
            timing.observe_ttft, timing.observe_itl = bound.observe_ttft, bound.observe_itl
            timing.observe_itl_counts = bound.observe_itl_counts
            timing.itl_bounds = bound.itl_bounds
            if ctx.exemplars:
                timing.exemplar = request_exemplar(record.request_id, None)
        last_read_ns, blocked_ns = replay(stream, timing)
        if last_read_ns > self.last_read_ns:
            self.last_read_ns = last_read_ns
        self.client_blocked_ns = blocked_ns

    # -- Watched ----------------------------------------------------------------------------

    def refresh(self, now_ns: int, every_ns: int) -> None:
        if self.where is not Where.WATCHED:
            return
        if now_ns - self._replayed_ns >= every_ns or self.timing.first_output_ns is None:
            self._replayed_ns = now_ns
            self._replay()
            return
        last_read_ns, self.client_blocked_ns = self._stream.clocks()
        if last_read_ns > self.last_read_ns:
            self.last_read_ns = last_read_ns

    def idle_timeout(self) -> None:
        self._force("idle_timeout")

    def client_stalled(self) -> None:
        self._force("client_stalled")

    def shut_down(self) -> None:
        self._force("shut_down")

    def _force(self, ending: str) -> None:
        """Ended by the live registry: the thread gives the stream back, and the Python path,
        taking it over, ends it so (`Adoption.forced`)."""
        if self.where is Where.WATCHED and self._forced is None:
            self._forced = ending
            self._stream.stop()

    def live_view(self) -> LiveView | None:
        if self.where is not Where.WATCHED:
            return None
        return LiveView(self.label, self.timing.arrival_ns, self.timing.first_output_ns)

    def in_flight(self, now_ns: int, wall_now: float) -> InFlight:
        return in_flight_view(self.label, self.timing, self.last_read_ns,
                              self.record.in_flight_at_arrival or 0, now_ns, wall_now)

    # -- the stream's end -------------------------------------------------------------------

    def native_returned(self, stream: Stream) -> None:
        ctx = self._ctx
        if self.where is Where.HELD:  # ended before Python looked: relayed natively all the same
            ctx.metrics.native_streams.inc()
        self._unwatch()
        keep: FrontConn | None = stream.front_conn
        if (stream.ending == Ending.ENDED and stream.end_written and not stream.unsent
                and stream.done_ns and self._forced is None):
            self._replay()
            self.where = Where.ENDED
            timing = self.timing
            timing.end_ns = stream.done_ns
            _, arrival_ns, _, sent_ns, _, _, _ = self.info
            ctx.metrics.observe_proxy_queue((sent_ns - arrival_ns) / NS)
            finish(ctx, self.record, timing, None)
            if keep is not None:  # the front went with it (stopped): both connections back
                keep.give_back()
            return
        self.where = Where.TAKEN_OVER
        if keep is None:  # (a front always goes with a stream that did not end cleanly)
            log.error("a native front's stream came back without its connections")
            return
        rid, arrival_ns, wall_ns, sent_ns, _, _, in_flight = self.info
        request = stream.front_request or b""
        adoption = Adoption(stream, keep.conn, self.timing, rid.decode("latin-1"), arrival_ns,
                            datetime.fromtimestamp(wall_ns / NS, UTC), sent_ns, in_flight,
                            self._forced)
        if not keep.protocol.adopt(request, adoption):
            # The client's connection is gone: nobody to answer. The upstream connection is
            # closed (the engine aborts the request), and the record says so.
            keep.conn.close()
            self._replay()
            record, timing = self.record, self.timing
            record.outcome, record.error = Outcome.CANCELLED, "client disconnected"
            timing.end_ns = perf_counter_ns()
            finish(ctx, record, timing, None)


def front(ctx: ProxyContext, enabled: bool) -> Front | None:
    """The front, where it can run: on, the native relay built, running usage asked of the
    upstream (its plan adds it), OpenTelemetry off (its trace headers are the Python path's),
    no access log (uvicorn writes its lines), and no cap on upstream connections (an idle
    connection the front keeps would hold one of the capped slots)."""
    settings = ctx.settings
    if (not enabled or ctx.native is None or not settings.upstream_continuous_usage
            or ctx.otel is not None or settings.access_log
            or settings.upstream_max_connections > 0):
        return None
    made = Front(ctx)
    ctx.native.after_batch = made.restock
    return made

