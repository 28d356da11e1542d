"""The hot path: relay one inference request and time its stream as the client sees it.

The request is read through ASGI and sent upstream on a pooled connection
(`upstream_pool.py`). From then on the exchange is driven by the upstream connection's read
callbacks: each read is timed when it arrives (one `perf_counter_ns()`), classified event by
event for timing (`stream.py`) and, under phasewatch's own server, written straight onto the
client's transport (`client_leg.py`): no task wake-up and no ASGI message per chunk. The
response's head goes out from the read callback too, in the same write as the first token
that came with it; the relay's coroutine wakes only for the request and the exchange's end.
Under another ASGI server the same bytes go out as ASGI messages. A stream counted exactly
from its first token goes instead to the native leg as its request is sent (native.py): its
head, first token and the rest are relayed below Python, and Python reads the upstream's head
(`Head`) and the stream's timing when it next looks at it.

How an exchange ends is one value, `Phase`, moved in one place (`_move`): the upstream ended
its body, the upstream broke off, the client left, or the idle timeout found it silent. The
record is finished in `finally` and handed to a bounded queue: the relay never waits for
storage, and nothing that goes wrong in metrics or records can break a client's stream.
A client that leaves makes the relay close its upstream connection at once, so the engine
aborts the request instead of generating for nobody.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Coroutine
from datetime import UTC, datetime
from enum import Enum
from time import perf_counter_ns
from typing import TYPE_CHECKING, Any, TypeVar

import orjson

from phasewatch.core.events import token_count
from phasewatch.core.live import InFlight
from phasewatch.core.metrics import request_exemplar
from phasewatch.core.records import Outcome, RequestRecord
from phasewatch.proxy.asgi import (
    CONTENT_LENGTH,
    NOT_FORWARDED,
    REQUEST_ID,
    RUN_ID,
    BodyTooLarge,
    ClientGone,
    Receive,
    Scope,
    Send,
    client_response_headers,
    error_body,
    headers_named,
    new_request_id,
    read_body,
    refuse_body,
    send_error,
    send_full,
)
from phasewatch.proxy.client_leg import ClientLeg, client_leg
from phasewatch.proxy.context import ProxyContext
from phasewatch.proxy.finish import finish
from phasewatch.proxy.front import Adoption, Front
from phasewatch.proxy.live import LiveView, in_flight_view
from phasewatch.proxy.native import Ending, Stream, replay
from phasewatch.proxy.request_plan import RequestPlan, plan_request
from phasewatch.proxy.shutdown import Stage
from phasewatch.proxy.stream import StreamFeed
from phasewatch.proxy.timing import NS, Counting, StreamTiming
from phasewatch.proxy.upstream_pool import ConnState, UpstreamConnection

if TYPE_CHECKING:  # imported only when switched on: it needs the `otel` extra
    from phasewatch.otel.export import RequestTrace

log = logging.getLogger(__name__)

ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat.completions"}
_DONE_EVENT = b"data: [DONE]\n\n"
_LAST_CHUNK = b"0\r\n\r\n"  # a chunked body's end, as the native leg read it (`Ending.ENDED`)
# Streams cut before [DONE]: the in-band error's type and code.
_CUT = {Outcome.TIMEOUT: ("upstream_error", 502), Outcome.STREAM_ERROR: ("upstream_error", 502),
        Outcome.SHUTDOWN: ("service_unavailable", 503)}
# Output waiting for a blocked ASGI send (other servers only) past which the upstream is paused.
_PENDING_LIMIT = 1 << 16

T = TypeVar("T")


class Phase(Enum):
    """Where an exchange is. The last four are endings; only `_move` changes the phase."""

    CONNECTING = "connecting"  # no upstream connection yet
    WAITING = "waiting"  # the request is sent; no response head yet (queue, prefill)
    STREAMING = "streaming"  # a 200 event stream is being forwarded
    READING = "reading"  # a whole answer (not streamed, or an error status) is being read
    ENDED = "ended"  # the upstream ended its body
    BROKEN = "broken"  # the upstream connection closed or broke before the body ended
    CLIENT_GONE = "client_gone"  # the client disconnected before it had its answer
    IDLE_TIMEOUT = "idle_timeout"  # the upstream sent nothing for the idle timeout
    SHUT_DOWN = "shut_down"  # phasewatch is shutting down and the grace for streams is over
    CLIENT_STALLED = "client_stalled"  # the client stopped reading for the client stall timeout

    # Members are singletons: hashed by identity in C, not by name in Python (`Enum.__hash__`),
    # for the tests of `_ENDINGS` on every pass of the live registry.
    __hash__ = object.__hash__


class Head(Enum):
    """Who reads the upstream's head and writes the client's."""

    PYTHON = "python"  # the upstream connection's parser and `on_head`
    NATIVE = "native"  # the native leg, which took the exchange as its request went out
    TAKEN = "taken"  # the native leg wrote the client's head; Python has parsed the upstream's


_ENDINGS = frozenset({Phase.ENDED, Phase.BROKEN, Phase.CLIENT_GONE, Phase.IDLE_TIMEOUT,
                      Phase.SHUT_DOWN, Phase.CLIENT_STALLED})
# The request headers the relay reads.
_NAMED = frozenset({REQUEST_ID, RUN_ID, CONTENT_LENGTH})
# Endings that may find the task blocked in an ASGI send the client does not drain.
_FORCED = frozenset({Phase.IDLE_TIMEOUT, Phase.SHUT_DOWN, Phase.CLIENT_STALLED})
_FORCED_BY_NAME = {phase.value: phase for phase in _FORCED}


async def relay(
    ctx: ProxyContext, endpoint: str, scope: Scope, receive: Receive, send: Send
) -> None:
    leg = client_leg(scope)
    arrival_ns = leg.arrival_ns if leg is not None else perf_counter_ns()
    named = headers_named(scope, _NAMED)
    # A request the native front sent upstream and gave back to this path (front.py): its
    # timing goes on from what Python replayed of it.
    adoption: Adoption | None = leg.adoption if leg is not None else None
    if adoption is not None:
        request_id, timing = adoption.request_id, adoption.timing
    else:
        request_id = named.get(REQUEST_ID, b"").decode("latin-1") or new_request_id()
        timing = StreamTiming(arrival_ns)
    # Filing a request under a benchmark run changes that run's figures: only an admin may
    # (asked only of a request that names a run).
    run_id = named.get(RUN_ID)
    if run_id is not None and not ctx.admin.allows(scope["headers"], bearer=False):
        run_id = None
    native = ctx.native
    record = RequestRecord(
        request_id=request_id,
        started_at=datetime.now(UTC) if adoption is None else adoption.started_at,
        endpoint=endpoint,
        model=None,
        upstream=ctx.upstream,
        stream=False,
        outcome=Outcome.OK,
        http_status=None,
        in_flight_at_arrival=(ctx.in_flight + (native.front_unseen if native is not None else 0)
                              if adoption is None else adoption.in_flight),
        run_id=run_id.decode("latin-1") if run_id else None,
    )
    ctx.in_flight += 1
    ctx.metrics.in_flight.inc()
    if native is not None:
        native.in_flight = ctx.in_flight
    request_trace = None
    try:
        if ctx.shutdown.stage is Stage.ENDING and adoption is None:
            record.outcome, record.http_status = Outcome.SHUTDOWN, 503
            record.error = "arrived after phasewatch's shutdown grace"
            await send_error(send, 503, "phasewatch is shutting down: retry",
                             "service_unavailable", request_id, close=True)
            return
        body = await read_body(receive, named.get(CONTENT_LENGTH), ctx.settings.max_body_bytes)
        plan = plan_request(body, ctx.settings.upstream_continuous_usage)
        record.model, record.stream = plan.model, plan.stream
        timing.single_choice = plan.single_choice
        if ctx.otel is not None:
            request_trace = ctx.otel.begin(scope["headers"], endpoint, plan.model, plan.stream,
                                           arrival_ns)
        sent_ns = perf_counter_ns() if adoption is None else adoption.sent_ns
        ctx.metrics.observe_proxy_queue((sent_ns - arrival_ns) / NS)
        await Exchange(ctx, scope, plan, record, timing, leg, request_trace,
                       adoption).run(receive, send)
    except ClientGone:
        record.outcome = Outcome.CANCELLED
    except BodyTooLarge as exc:
        record.outcome, record.http_status, record.error = Outcome.REJECTED, 413, str(exc)
        await refuse_body(send, exc, request_id)
    finally:
        if timing.end_ns is None:
            timing.end_ns = perf_counter_ns()
        ctx.in_flight -= 1
        ctx.metrics.in_flight.dec()
        if native is not None:
            native.in_flight = ctx.in_flight
        finish(ctx, record, timing, request_trace)


class Exchange:
    """One request's exchange with the upstream; hears its connection's reads (UpstreamHandler)."""

    __slots__ = ("_adoption", "_blocked_in_send", "_body", "_conn", "_ctx", "_direct",
                 "_end_ns", "_feed", "_head", "_headers", "_leg", "_lost", "_native",
                 "_native_tried", "_pending", "_pending_size", "_plan", "_prefix", "_record",
                 "_replayed_ns", "_responded", "_scope", "_status", "_task", "_timing", "_trace",
                 "_unwritten", "_wake", "client_blocked_ns", "label", "last_read_ns", "phase")

    def __init__(self, ctx: ProxyContext, scope: Scope, plan: RequestPlan,
                 record: RequestRecord, timing: StreamTiming, leg: ClientLeg | None,
                 request_trace: RequestTrace | None = None,
                 adoption: Adoption | None = None) -> None:
        self._ctx = ctx
        self._adoption = adoption
        self._trace = request_trace  # its span's context replaces the client's upstream
        self._scope = scope
        self._plan = plan
        self._record = record
        self._timing = timing
        self._leg = leg
        self.phase = Phase.CONNECTING
        self.last_read_ns = timing.arrival_ns  # the last time the upstream sent anything
        # When the client stopped taking what is written to it (0: it takes it): its socket
        # buffer filled (direct writes), or an ASGI send has been waiting (other servers).
        self.client_blocked_ns = 0
        # The model's label: its own once the upstream has served it (labels.py), else `other`.
        self.label = ctx.labels.label(plan.model, False)
        self._wake: asyncio.Future[None] | None = None
        self._conn: UpstreamConnection | None = None
        self._task: asyncio.Task[Any] | None = None
        self._status = 0
        self._headers: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []
        self._feed: StreamFeed | None = None
        self._pending: list[bytes] = []  # output the client has not been sent yet
        self._pending_size = 0
        self._direct = False  # output goes straight onto the client's transport
        self._unwritten: list[bytes] = []  # (direct) this read's output, written as it ends
        # (direct) framed bytes that go out ahead of this read's output, in its write: the
        # response's head, or what the native leg relayed in the read that ended the body.
        self._prefix = b""
        self._blocked_in_send = False  # (other servers) waiting in an ASGI send
        self._responded = False  # the upstream sent a byte of its response
        self._end_ns = 0
        self._lost = ""
        self._native: Stream | None = None  # the native leg holds the stream (native.py)
        self._head = Head.PYTHON
        self._replayed_ns = 0  # when the live registry last replayed the native leg's log
        # The native leg may not take this stream (off, or it could not take it once).
        self._native_tried = ctx.native is None

    # -- moving the phase -------------------------------------------------------------------

    def _move(self, to: Phase) -> None:
        self.phase = to
        if to is not Phase.STREAMING or not self._direct:
            # A stream started from the read callbacks (`_start_direct`) runs on them: the
            # coroutine sleeps until its ending.
            self._wake_up()

    def _wake_up(self) -> None:
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    async def _next(self) -> None:
        """Sleep until the phase moves (or, on other servers, output is pending)."""
        self._wake = self._ctx.loop.create_future()
        try:
            await self._wake
        finally:
            self._wake = None

    def client_gone(self) -> None:
        """The client disconnected. After [DONE] it has its whole answer: that cancels nothing."""
        if self.phase not in _ENDINGS and not self._answered():
            self._move(Phase.CLIENT_GONE)

    def _answered(self) -> bool:
        """`[DONE]` has gone to the client, from here or from the native leg."""
        feed, native = self._feed, self._native
        return (feed is not None and feed.done) or (native is not None and native.done_ns > 0)

    def live_view(self) -> LiveView | None:
        """For the live gauges (live.py): a streamed request until it ends."""
        if not self._plan.stream or self.phase in _ENDINGS:
            return None
        return LiveView(self.label, self._timing.arrival_ns, self._timing.first_output_ns)

    def in_flight(self, now_ns: int, wall_now: float) -> InFlight:
        return in_flight_view(self.label, self._timing, self.last_read_ns,
                              self._record.in_flight_at_arrival or 0, now_ns, wall_now)

    def refresh(self, now_ns: int, every_ns: int) -> None:
        """Called by the live registry: the idle and stall clocks of a stream the native leg
        holds, brought up to date; and, when its last replay is `every_ns` or more before
        `now_ns`, what it relayed since goes into the timing (its ITL observations)."""
        stream = self._native
        if stream is None:
            return
        # A stream the native leg took from its head is replayed on each pass until its first
        # token: its head and TTFT reach the live gauges and the histogram a pass after them.
        if now_ns - self._replayed_ns >= every_ns or self._timing.first_output_ns is None:
            self._replayed_ns = now_ns
            self._replay(stream)
            return
        last_read_ns, self.client_blocked_ns = stream.clocks()
        if last_read_ns > self.last_read_ns:
            self.last_read_ns = last_read_ns

    def _replay(self, stream: Stream) -> None:
        if self._head is Head.NATIVE:
            self._take_head(stream)
        last_read_ns, blocked_ns = replay(stream, self._timing)
        if last_read_ns > self.last_read_ns:
            self.last_read_ns = last_read_ns
        self.client_blocked_ns = blocked_ns

    def idle_timeout(self) -> None:
        """Called by the live registry: nothing came from the upstream for the idle timeout."""
        self._force(Phase.IDLE_TIMEOUT)

    def client_stalled(self) -> None:
        """Called by the live registry: the client has not read for the client stall timeout."""
        self._force(Phase.CLIENT_STALLED)

    def shut_down(self) -> None:
        """Called at shutdown once the grace is over: end now, telling the client why."""
        self._force(Phase.SHUT_DOWN)

    def _force(self, ending: Phase) -> None:
        if self.phase in _ENDINGS:
            return
        self._move(ending)
        if self._blocked_in_send and self._task is not None:
            self._task.cancel()  # (other servers) a send the client will never drain

    # -- UpstreamHandler: called from the upstream connection's read callbacks ----------------

    def on_head(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        native_wrote_it = self._head is Head.TAKEN
        if self.phase is not Phase.WAITING and not native_wrote_it:
            return
        self.last_read_ns = perf_counter_ns()
        self._responded = True
        self._status, self._headers = status, headers
        if native_wrote_it or (status == 200
                               and _content_type(headers).startswith(b"text/event-stream")):
            ctx, timing = self._ctx, self._timing
            # Served: the model earns its label. TTFT and ITL are observed as they arrive.
            self.label = ctx.labels.label(self._plan.model, True)
            bound = ctx.metrics.bind(self.label, self._record.endpoint)
            timing.observe_ttft, timing.observe_itl = bound.observe_ttft, bound.observe_itl
            timing.observe_itl_counts = bound.observe_itl_counts
            timing.itl_bounds = bound.itl_bounds
            if ctx.exemplars:
                trace = self._trace
                timing.exemplar = request_exemplar(
                    self._record.request_id, trace.trace_id if trace is not None else None)
            self._feed = StreamFeed(self._plan, self._record, timing)
            self._start_direct()
            if self.phase is Phase.WAITING:  # (a forced ending may have come first: it stays)
                self._move(Phase.STREAMING)
        else:
            self._move(Phase.READING)

    def _start_direct(self) -> None:
        """Under phasewatch's own server, start the client's response from this read callback:
        its head goes out with this read's output (vLLM sends the first token with its head),
        in one write, with no wake-up of the coroutine before it. Elsewhere, or if the client
        leg cannot start it, the coroutine starts it over ASGI (`_stream`)."""
        leg = self._leg
        if leg is None:
            return
        if self._head is Head.TAKEN:  # the native leg wrote the head
            if leg.start_chunked(200):
                self._write_directly(leg)
            return
        headers = client_response_headers(self._headers, self._record.request_id, None)
        head = leg.begin_chunked(200, headers)
        if head is not None:
            self._prefix = head
            self._write_directly(leg)

    def _write_directly(self, leg: ClientLeg) -> None:
        """From here on, reads go straight to the client from the upstream's callback; the
        client's buffer filling and draining pauses and resumes the upstream."""
        leg.on_pause, leg.on_resume = self._client_blocked, self._client_reading
        if leg.paused:
            self.client_blocked_ns = perf_counter_ns()
        self._direct = True

    def on_body(self, data: bytes, now_ns: int) -> None:
        self.last_read_ns = now_ns
        feed = self._feed
        if self.phase is not Phase.STREAMING or feed is None:
            if self.phase is Phase.READING:
                self._body.append(data)
            return
        was_done = feed.done
        out = feed.feed(data, now_ns)
        if feed.done and not was_done:
            # [DONE] goes out with this read: the exchange is complete as the client sees it.
            # The upstream may end its body a moment later, and a client may close at [DONE]
            # (the openai SDK does) before then; neither makes the request cancelled or longer.
            self._timing.end_ns = now_ns
        if not out:
            return
        if self._direct:
            self._unwritten.append(out)
            return
        self._pending.append(out)
        self._pending_size += len(out)
        if self._pending_size > _PENDING_LIMIT and self._conn is not None:
            self._conn.pause_reading()
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    def on_read_end(self) -> None:
        """The read is parsed: what it produced goes out in one write (with the response's head
        in the read that brought it), and then the native leg may take the stream."""
        out, prefix, feed = self._unwritten, self._prefix, self._feed
        # The body ended cleanly in this read: the response's end goes out with what it
        # brought (if anything), and the coroutine has only the record left to finish.
        last = (self._direct and self.phase is Phase.ENDED and feed is not None
                and feed.ended_whole)
        if not out and not prefix and not last:
            return
        self._unwritten, self._prefix = [], b""
        assert self._leg is not None
        self._leg.write_chunks(out, prefix, last)
        if not last:
            self._offer_native()

    def _offer_native(self) -> None:
        """Hand the stream to the native leg if it counts exactly, nothing is held or half-read,
        and the upstream's parser stands between chunks."""
        feed, conn = self._feed, self._conn
        if (not self._native_tried and self._timing.counting is Counting.EXACT
                and feed is not None and feed.between_events and conn is not None
                and conn.between_chunks()):
            self._go_native()

    def _go_native(self) -> None:
        """Hand the stream to the native leg if nothing is waiting to be written to the
        client."""
        leg, conn, native = self._leg, self._conn, self._ctx.native
        if (self.phase is not Phase.STREAMING or leg is None or leg.paused or conn is None
                or conn.transport is None or native is None or self._native is not None):
            return
        if conn.plain_fd is None or leg.plain_fd is None:  # TLS on a side: it stays in Python
            self._native_tried = True
            return
        client = leg.transport
        if client is None or client.get_write_buffer_size():
            return
        conn.pause_reading()
        plan = self._plan
        stream = native.start(conn.plain_fd, leg.plain_fd, plan.strip_chunk_usage,
                              plan.strip_final_usage, self)
        if stream is None:
            self._native_tried = True
            conn.resume_reading()
            return
        self._held(stream, leg)

    def _start_native_at_head(self) -> None:
        """Hand the exchange to the native leg as its request goes out, when its stream can be
        counted exactly from the first token: the thread reads the upstream's head, writes the
        client's with the first token, and relays on (native.py). Python then wakes for the
        exchange's end alone, unless the thread gives it back."""
        leg, conn, native, plan = self._leg, self._conn, self._ctx.native, self._plan
        if (native is None or self._native_tried or leg is None or conn is None
                or conn.plain_fd is None or leg.plain_fd is None or leg.paused
                or not (plan.stream and plan.single_choice and plan.running_usage)):
            return
        parts = leg.head_parts()
        client = leg.transport
        if parts is None or client is None or client.get_write_buffer_size():
            return
        conn.pause_reading()
        prefix, end = parts
        request_id = b"x-request-id: %b\r\n" % self._record.request_id.encode("latin-1")
        front = self._ctx.front
        keep = leg.front = front.keep(leg, conn) if front is not None else None
        stream = native.start(conn.plain_fd, leg.plain_fd, plan.strip_chunk_usage,
                              plan.strip_final_usage, self, (prefix, request_id, end), keep)
        if stream is None and keep is not None:
            Front.not_kept(leg)
        if stream is None:
            self._native_tried = True
            conn.resume_reading()
            return
        self._head = Head.NATIVE
        self._held(stream, leg)

    def _held(self, stream: Stream, leg: ClientLeg) -> None:
        """The native leg holds the stream from here."""
        self._native = stream
        self._replayed_ns = perf_counter_ns()  # nothing to replay yet (live.py `REPLAY_S`)
        self._ctx.live.hold(self)
        self._ctx.metrics.native_streams.inc()
        leg.on_followed = self._followed
        if leg.followed:
            stream.urge()

    def _followed(self) -> None:
        """A request is queued behind this one on the client's connection: the native leg
        hands the stream's end back at once, not on the event loop's next wake-up, for that
        request to start (native.py)."""
        native = self._native
        if native is not None:
            native.urge()

    def _take_head(self, stream: Stream) -> None:
        """The native leg wrote the client's head (if `stream.head` is there): the upstream's
        goes through the connection's parser as a read, so that the parser stands at the body
        and `on_head` sets what it sets (it writes nothing). On a connection already closed
        `on_head` is told directly: the client has the head, so the exchange ends in-band."""
        head = stream.head
        if head is None:
            return
        self._head = Head.TAKEN
        conn = self._conn
        if conn is not None and conn.state is ConnState.BUSY:
            conn.take(head, stream.head_ns)
        if not self._status:
            self.on_head(200, [])

    def native_returned(self, stream: Stream) -> None:
        """The native leg handed the stream back: go on from the byte it stopped at."""
        self._native = None
        self._ctx.live.release(self)
        self._replay(stream)
        if self._head is Head.NATIVE:  # it gave the head back unread: Python reads it
            self._head = Head.PYTHON
        leg, conn, feed = self._leg, self._conn, self._feed
        done_ns = stream.done_ns
        if done_ns and feed is not None and not feed.done:
            # [DONE] went out from the native leg: the exchange is complete as the client sees
            # it from that read on (as `on_body` has it).
            feed.done = True
            self._timing.end_ns = done_ns
        ending = stream.ending
        if ending == Ending.ENDED and conn is not None:
            # The body ended cleanly in the native leg's last read. The thread wrote what that
            # read brought and the response's end (`end_written`): the response is complete,
            # but for what the client's socket did not take, which goes out first. (Without
            # the end, what that read brought goes out with it, in one write, below.) Then the
            # upstream's parser hears the end the native leg read for it (`on_end`, and
            # `on_read_end`, which has nothing left to write once the response is complete).
            lent = False
            if stream.kept and leg is not None:
                lent = True
                Front.kept(leg)
            else:
                if leg is not None and leg.front is not None:
                    Front.not_kept(leg)
                conn.resume_reading()  # for its next response: it goes back to the pool
                if stream.end_written and leg is not None:
                    leg.end_written(stream.unsent)
                else:
                    self._prefix = stream.unsent
            conn.take(_LAST_CHUNK, stream.leftover_ns)
            if lent:  # the upstream connection stays with the native thread (front.py)
                self._conn = None
                conn.lend()
            self._wake_up()
            return
        if leg is not None and leg.front is not None:
            Front.not_kept(leg)
        unsent, blocked_ns = stream.unsent, self.client_blocked_ns
        if unsent and leg is not None:
            leg.write_raw(unsent)  # may fill the client's buffer: `_client_blocked`
            if leg.paused and blocked_ns:
                self.client_blocked_ns = blocked_ns  # it stopped reading before this write
        if ending == Ending.CLIENT_ERROR:
            self.client_gone()
        if conn is not None:
            if ending == Ending.UPSTREAM_ERROR:
                conn.broke(OSError(stream.errno, os.strerror(stream.errno)))
            else:
                # Reading resumes before the leftover is parsed: parsing it may hand the stream
                # to the native leg again, which pauses reading again.
                if leg is None or not leg.paused:
                    conn.resume_reading()
                leftover = stream.leftover
                if leftover:
                    held = stream.held  # a terminal chunk held, read before the rest
                    if held:
                        conn.take(leftover[:held], stream.held_ns)
                        leftover = leftover[held:]
                    if leftover:
                        conn.take(leftover, stream.leftover_ns)
        self._wake_up()

    def on_end(self, now_ns: int) -> None:
        if self.phase in (Phase.STREAMING, Phase.READING):
            self._end_ns = now_ns
            self._move(Phase.ENDED)

    def on_lost(self, reason: str, responded: bool) -> None:
        if self.phase not in _ENDINGS:
            self._lost = reason
            self._responded = self._responded or responded
            self._move(Phase.BROKEN)

    # -- the coroutine ----------------------------------------------------------------------

    async def run(self, receive: Receive, send: Send) -> None:
        self._task = asyncio.current_task(self._ctx.loop)
        leg = self._leg
        watcher = None
        if leg is not None:
            leg.on_disconnect = self.client_gone
            if leg.gone:  # it left while the body was being read
                self.client_gone()
        else:  # other servers: ASGI's receive says when the client leaves
            watcher = asyncio.create_task(self._watch_disconnect(receive))
        ctx = self._ctx
        ctx.live.watch(self)
        try:
            if await self._send_request(send):
                if self._feed is not None:
                    await self._stream(send)
                else:
                    await self._answer(send)
        finally:
            if self._native is not None:  # cancelled while the native leg had the stream
                self._native.stop()
            if leg is not None:
                leg.on_disconnect = None
            if watcher is not None:
                watcher.cancel()
            ctx.live.forget(self)
            conn, self._conn = self._conn, None
            if conn is not None:
                # Only a connection whose response ended cleanly is reused; closing any other
                # is what tells the engine to abort the request.
                conn.finish(reusable=self.phase is Phase.ENDED)

    async def _watch_disconnect(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.client_gone()

    async def _send_request(self, send: Send) -> bool:
        """Connect (or reuse), send, wait for the head; False if the exchange ended without one
        (the client has been answered, or has gone)."""
        ctx, scope, record = self._ctx, self._scope, self._record
        target: bytes = scope.get("raw_path") or scope["path"].encode()
        if scope.get("query_string"):
            target += b"?" + scope["query_string"]
        trace = self._trace
        if trace is None:
            headers = [(k, v) for k, v in scope["headers"] if k not in NOT_FORWARDED]
        else:  # the engine's spans become children of phasewatch's
            replaced = trace.replaces
            headers = [(k, v) for k, v in scope["headers"]
                       if k not in NOT_FORWARDED and k not in replaced]
            headers.extend(trace.upstream_headers)
        headers.append((REQUEST_ID, record.request_id.encode("latin-1")))
        request = ctx.pool.request(b"POST", target, headers, self._plan.body)
        conn: UpstreamConnection | None
        for attempt in range(2):
            adoption, self._adoption = self._adoption, None
            if adoption is not None:
                # The native front sent this request on its kept connection and relayed what
                # it could: go on from where it left the stream, as from this exchange's own
                # native leg. An ending the live registry gave it comes next.
                conn = self._conn = adoption.conn
                self._move(Phase.WAITING)
                conn.adopt(self)
                self._native, self._head = adoption.stream, Head.NATIVE
                self.native_returned(adoption.stream)
                if adoption.forced is not None:
                    self._force(_FORCED_BY_NAME[adoption.forced])
            else:
                conn = ctx.pool.take_idle()
            if conn is None:
                try:
                    conn = await self._unless_ended(ctx.pool.connect())
                except TimeoutError:
                    return await self._refuse(send, Outcome.TIMEOUT, 504,
                                              "upstream timed out before answering")
                except OSError as exc:
                    return await self._refuse(send, Outcome.UNREACHABLE, 502,
                                              f"upstream unreachable: {type(exc).__name__}")
                if conn is None:
                    return await self._ended_before_head(send)
            if adoption is None:
                self._conn = conn
                self._move(Phase.WAITING)
                conn.send(self, request)
                self._start_native_at_head()
            while self.phase is Phase.WAITING:
                await self._next()
            while self._native is not None and self.phase in _ENDINGS:
                self._native.stop()  # ended while the native leg held it: take it back first
                await self._next()
            if self.phase is Phase.BROKEN and not self._responded and conn.reused and not attempt:
                # The upstream closed this kept-alive connection as we reused it: once more.
                self._conn = None
                conn.close()
                self._move(Phase.CONNECTING)
                continue
            break
        if self._status:  # the head arrived (the body may have ended with it already)
            return True
        return await self._ended_before_head(send)

    async def _unless_ended(self, coro: Coroutine[Any, Any, T]) -> T | None:
        """Await `coro` unless the exchange ends first (client gone, idle timeout)."""
        task = asyncio.ensure_future(coro)
        self._wake = self._ctx.loop.create_future()
        try:
            await asyncio.wait((task, self._wake), return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._wake = None
        if task.done():
            return task.result()
        task.cancel()
        task.add_done_callback(_close_unwanted)  # not awaited: this task may be cancelled too
        return None

    async def _ended_before_head(self, send: Send) -> bool:
        record = self._record
        if self.phase is Phase.CLIENT_GONE:
            record.outcome = Outcome.CANCELLED
            return False
        if self.phase is Phase.IDLE_TIMEOUT:
            return await self._refuse(send, Outcome.TIMEOUT, 504,
                                      "upstream timed out before answering")
        if self.phase is Phase.SHUT_DOWN:
            return await self._refuse(send, Outcome.SHUTDOWN, 503,
                                      "phasewatch shut down before the upstream answered")
        return await self._refuse(send, Outcome.UNREACHABLE, 502,
                                  f"upstream unreachable: {self._lost}")

    async def _refuse(self, send: Send, outcome: Outcome, status: int, error: str) -> bool:
        record = self._record
        record.outcome = outcome
        record.error = error
        upstream = self._ctx.upstream
        if status == 503:
            message, kind = "phasewatch is shutting down: retry", "service_unavailable"
        elif status == 504:
            message, kind = f"upstream {upstream} timed out", "upstream_timeout"
        else:
            message, kind = f"upstream {upstream} is unreachable: {error}", "upstream_unreachable"
        await send_error(send, status, message, kind, record.request_id)
        return False

    async def _answer(self, send: Send) -> None:
        """A non-streamed answer or an error status: read it whole, forward it unchanged."""
        while self.phase is Phase.READING:
            await self._next()
        record, timing = self._record, self._timing
        record.http_status = self._status
        if self.phase is Phase.CLIENT_GONE:
            record.outcome = Outcome.CANCELLED
            return
        if self.phase is Phase.IDLE_TIMEOUT:
            await self._refuse(send, Outcome.TIMEOUT, 504, "upstream went silent past the idle "
                               "timeout")
            return
        if self.phase is Phase.SHUT_DOWN:
            await self._refuse(send, Outcome.SHUTDOWN, 503,
                               "phasewatch shut down before the answer was read")
            return
        if self.phase is Phase.BROKEN:
            record.outcome = Outcome.STREAM_ERROR
            await send_error(send, 502, f"upstream {self._ctx.upstream} broke off its answer",
                             "upstream_error", record.request_id)
            record.error = f"upstream answer broke: {self._lost}"
            return
        body = b"".join(self._body)
        timing.end_ns = self._end_ns
        if 200 <= self._status < 300:
            _read_usage(body, timing)
        else:
            record.outcome = Outcome.HTTP_ERROR
            record.error = _error_type(body, self._status)
        headers = client_response_headers(self._headers, record.request_id, len(body))
        await send_full(send, self._status, headers, body)

    async def _stream(self, send: Send) -> None:
        record, timing, feed, leg = self._record, self._timing, self._feed, self._leg
        assert feed is not None
        record.http_status = 200
        if leg is None or not leg.response_started:  # else started from a read (_start_direct)
            headers = client_response_headers(self._headers, record.request_id, None)
            await send({"type": "http.response.start", "status": 200, "headers": headers})
        try:
            if leg is not None and self.phase is not Phase.CLIENT_GONE:
                if not self._direct:  # (else it was started from a read: `_start_direct`)
                    paused = self._pending_size > _PENDING_LIMIT
                    if self._pending:
                        leg.write_chunk(b"".join(self._pending))
                        self._pending, self._pending_size = [], 0
                    self._write_directly(leg)
                    if paused and not leg.paused and self._conn is not None:
                        self._conn.resume_reading()
                    # The reads so far may have ended with a whole token chunk: then the native
                    # leg takes the stream from the next.
                    self._offer_native()
                while self.phase is Phase.STREAMING:
                    await self._next()
            else:
                await self._stream_over_asgi(send)
            while self._native is not None:  # an ending came while the native leg had it
                self._native.stop()
                await self._next()
        except asyncio.CancelledError:
            if self.phase not in _FORCED or self._task is None:
                raise
            self._task.uncancel()  # a forced ending cut a send the client would never drain
        finally:
            if leg is not None:
                leg.on_pause = leg.on_resume = None
        # (A stream the native leg held was blocked in the thread, whose unsent bytes may have
        # fitted the transport's buffer since: the ending itself says the client stalled.)
        client_stalled = (self.phase is Phase.CLIENT_STALLED or self._blocked_in_send
                          or (leg is not None and leg.paused))
        if self.phase in _FORCED and client_stalled:
            # The client is not reading (at an idle timeout, that was the silence: back-pressure
            # from it). Another send would block the same way: end without one (the server
            # closes the connection of a response left incomplete).
            if self.phase is Phase.SHUT_DOWN:
                record.outcome = Outcome.SHUTDOWN
                record.error = "phasewatch shut down while the client was not reading"
            elif self.phase is Phase.CLIENT_STALLED:
                record.outcome = Outcome.CANCELLED
                record.error = "client stopped reading past the client stall timeout"
            else:
                record.outcome = Outcome.CANCELLED
                record.error = "client stopped reading past the idle timeout"
            timing.end_ns = perf_counter_ns()
            return
        if self.phase is Phase.CLIENT_GONE:
            record.outcome = Outcome.CANCELLED
            return
        if not feed.done:
            if self.phase is Phase.IDLE_TIMEOUT:
                record.outcome = Outcome.TIMEOUT
                record.error = "upstream went silent past the idle timeout"
            elif self.phase is Phase.BROKEN:
                record.outcome = Outcome.STREAM_ERROR
                record.error = f"upstream stream broke: {self._lost}"
            elif self.phase is Phase.SHUT_DOWN:
                record.outcome = Outcome.SHUTDOWN
                record.error = "phasewatch shut down before the stream ended"
        end_ns = timing.end_ns or (self._end_ns if self.phase is Phase.ENDED
                                   else perf_counter_ns())
        timing.end_ns = end_ns
        rest = feed.end(end_ns)
        tail = b""
        if not feed.done and record.outcome is Outcome.OK:
            record.outcome = Outcome.STREAM_ERROR
            record.error = "upstream closed the stream before [DONE]"
        if record.outcome in _CUT and not feed.done:
            # Never leave the client hanging on a broken stream: say why, in-band, as vLLM does.
            kind, code = _CUT[record.outcome]
            error = error_body(f"phasewatch: {record.error}", kind, code)
            # End a half-sent event first, so the error is an event of its own.
            tail = ((b"\n\n" if feed.unterminated else b"")
                    + b"data: " + error + b"\n\n" + _DONE_EVENT)
        if leg is not None and leg.response_complete:
            return  # ended with the last read (`on_read_end`): nothing held, nothing to add
        await send({"type": "http.response.body", "body": rest + tail, "more_body": False})

    def _client_blocked(self) -> None:
        """The client's socket buffer is full: stop reading from the upstream (back-pressure
        reaches the engine) and note since when, for the client stall timeout."""
        self.client_blocked_ns = perf_counter_ns()
        if self._conn is not None:
            self._conn.pause_reading()

    def _client_reading(self) -> None:
        self.client_blocked_ns = 0
        if self._conn is not None:
            self._conn.resume_reading()

    async def _stream_over_asgi(self, send: Send) -> None:
        """Under a server without the client leg: forward pending output as ASGI messages."""
        while True:
            if self._pending:
                data = b"".join(self._pending)
                self._pending = []
                self._pending_size = 0
                if self._conn is not None:
                    self._conn.resume_reading()
                self._blocked_in_send = True
                self.client_blocked_ns = perf_counter_ns()
                await send({"type": "http.response.body", "body": data, "more_body": True})
                self._blocked_in_send = False
                self.client_blocked_ns = 0
                continue
            if self.phase is not Phase.STREAMING:
                return
            await self._next()


def _close_unwanted(task: asyncio.Future[Any]) -> None:
    """A connection that was still being opened when its exchange ended: close it if it opened
    after all (and take the task's error, if any, so that nothing is logged for it)."""
    if task.cancelled() or task.exception() is not None:
        return
    result = task.result()
    if isinstance(result, UpstreamConnection):
        result.close()


def _content_type(headers: list[tuple[bytes, bytes]]) -> bytes:
    for name, value in headers:
        if name.lower() == b"content-type":
            return value.lower()
    return b""


def _read_usage(body: bytes, timing: StreamTiming) -> None:
    try:
        usage = orjson.loads(body).get("usage")
    except (orjson.JSONDecodeError, AttributeError):
        return
    if isinstance(usage, dict):
        timing.completion_tokens = token_count(usage.get("completion_tokens"))
        timing.prompt_tokens = token_count(usage.get("prompt_tokens"))


def _error_type(body: bytes, status: int) -> str:
    """The error's type and code, never its message: messages can echo the request."""
    try:
        error = orjson.loads(body).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        error = None
    if isinstance(error, dict):
        return f"HTTP {status}: {str(error.get('type'))[:80]}"
    return f"HTTP {status}"
