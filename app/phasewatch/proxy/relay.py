"""The hot path: relay one inference request and time its stream as the client sees it.

`relay()` reads the request through ASGI, plans it (request_plan.py) and runs one `Exchange`,
which sends it upstream on a pooled connection (upstream_pool.py) and is driven from then on
by that connection's read callbacks. Each read is timed as it arrives (one `perf_counter_ns()`),
classified for timing (stream.py) and, under phasewatch's own server, written straight onto
the client's transport (client_leg.py): no task wake-up and no ASGI message per chunk; the
response's head goes out in the same write as the first event that came with it. Under
another ASGI server the same bytes go out as ASGI messages. Once the stream stands at a chunk
boundary of an exactly counted body, the native leg's thread may take it (native.py) and hand
it back at any byte; Python goes on from exactly there.

Who owns each socket, when (one owner at a time; each socket in one poll set at a time):

| socket | owner | from -> to |
|---|---|---|
| client, reads | uvicorn (`PhasewatchHttpProtocol`) | accept -> close, but while lent |
| client, the response's writes | this exchange (`ClientLeg`) | head -> end, but while lent |
| client, lent | the native thread (writes, hang-up, a request behind) | `lend` -> back |
| upstream, idle | `UpstreamPool` (the loop reads it: a close is seen) | put back -> taken |
| upstream, busy | this exchange (its read callbacks) | `send` -> `finish`, but while lent |
| upstream, lent | the native thread (reads) | `start` -> back |

Invariants:
- Where the exchange is, is one value (`Phase`), moved only by `_on` through the table of
  exchange_state.py; the first ending wins. Who relays its stream is another: the native
  leg's `Stream` while it holds the sockets (`_native`), else Python.
- While the native leg holds them, Python neither reads nor writes either socket: both are
  paused and out of the event loop's poll set (client_leg.py `lend`, upstream_pool.py
  `pause_reading`), and an ending Python decides (a timeout, shutdown) asks the thread to hand
  the stream back first.
- The record is finished in `relay`'s `finally` and handed to a bounded queue: the relay never
  waits for storage, and a fault in metrics or records never breaks a client's stream.
- A client that leaves makes the exchange close its upstream connection at once, so the
  engine aborts the request instead of generating for nobody.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Coroutine
from datetime import UTC, datetime
from time import perf_counter_ns
from typing import TYPE_CHECKING, Any, TypeVar

import orjson

from phasewatch.core.events import token_count
from phasewatch.core.live import InFlight
from phasewatch.core.metrics import request_exemplar
from phasewatch.core.records import Outcome, RequestRecord
from phasewatch.proxy._native import Stream
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
from phasewatch.proxy.exchange_state import ENDINGS, FORCED, Event, Phase, next_phase
from phasewatch.proxy.finish import finish
from phasewatch.proxy.live import LiveView, in_flight_view
from phasewatch.proxy.native import Ending, replay
from phasewatch.proxy.request_plan import RequestPlan, plan_request
from phasewatch.proxy.shutdown import Stage
from phasewatch.proxy.stream import StreamFeed
from phasewatch.proxy.timing import NS, Counting, StreamTiming
from phasewatch.proxy.upstream_pool import UpstreamConnection

if TYPE_CHECKING:  # imported only when switched on: it needs the `otel` extra
    from phasewatch.otel.export import RequestTrace

log = logging.getLogger(__name__)

ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat.completions"}
_DONE_EVENT = b"data: [DONE]\n\n"
_LAST_CHUNK = b"0\r\n\r\n"  # a chunked body's end, as the native leg read it (`Ending.ENDED`)
# Streams cut before [DONE]: the in-band error's type and code.
_CUT = {Outcome.TIMEOUT: ("upstream_error", 502), Outcome.STREAM_ERROR: ("upstream_error", 502),
        Outcome.SHUTDOWN: ("service_unavailable", 503),
        Outcome.INTERNAL_ERROR: ("server_error", 500)}
# Output waiting for a blocked ASGI send (other servers only) past which the upstream is paused.
_PENDING_LIMIT = 1 << 16
# The request headers the relay reads.
_NAMED = frozenset({REQUEST_ID, RUN_ID, CONTENT_LENGTH})

T = TypeVar("T")


async def relay(
    ctx: ProxyContext, endpoint: str, scope: Scope, receive: Receive, send: Send
) -> None:
    leg = client_leg(scope)
    arrival_ns = leg.arrival_ns if leg is not None else perf_counter_ns()
    named = headers_named(scope, _NAMED)
    request_id = named.get(REQUEST_ID, b"").decode("latin-1") or new_request_id()
    timing = StreamTiming(arrival_ns)
    # Filing a request under a benchmark run changes that run's figures: only an admin may
    # (asked only of a request that names a run).
    run_id = named.get(RUN_ID)
    if run_id is not None and not ctx.admin.allows(scope["headers"], bearer=False):
        run_id = None
    record = RequestRecord(
        request_id=request_id,
        started_at=datetime.now(UTC),
        endpoint=endpoint,
        model=None,
        upstream=ctx.upstream,
        stream=False,
        outcome=Outcome.OK,
        http_status=None,
        in_flight_at_arrival=ctx.in_flight,
        run_id=run_id.decode("latin-1") if run_id else None,
    )
    ctx.in_flight += 1
    ctx.metrics.in_flight.inc()
    request_trace = None
    try:
        if ctx.shutdown.stage is Stage.ENDING:
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
        ctx.metrics.observe_proxy_queue((perf_counter_ns() - arrival_ns) / NS)
        await Exchange(ctx, scope, plan, record, timing, leg, request_trace).run(receive, send)
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
        finish(ctx, record, timing, request_trace)


class Exchange:
    """One request's exchange with the upstream; hears its connection's reads (UpstreamHandler)
    and, while the native leg holds its stream, the thread's hand-back (native.py `Owner`)."""

    __slots__ = ("_blocked_in_send", "_body", "_conn", "_ctx", "_direct", "_end_ns", "_feed",
                 "_headers", "_leg", "_lost", "_native", "_native_refused",
                 "_pending", "_pending_size", "_plan", "_prefix", "_record", "_replayed_ns",
                 "_responded", "_scope", "_status", "_task", "_timing", "_trace", "_unwritten",
                 "_wake", "client_blocked_ns", "label", "last_read_ns", "phase")

    def __init__(self, ctx: ProxyContext, scope: Scope, plan: RequestPlan,
                 record: RequestRecord, timing: StreamTiming, leg: ClientLeg | None,
                 request_trace: RequestTrace | None = None) -> None:
        self._ctx = ctx
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
        self._pending: list[bytes] = []  # (other servers) output not sent yet
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
        # The native leg's stream while it holds both sockets (None: Python relays).
        self._native: Stream | None = None
        self._replayed_ns = 0  # when the live registry last replayed the native leg's log
        # The native leg could not take this stream once: it stays in Python.
        self._native_refused = ctx.native is None

    # -- moving the phase -------------------------------------------------------------------

    def _on(self, event: Event) -> None:
        """The one place the phase moves (exchange_state.py); wakes the coroutine for it. A
        stream started from the read callbacks (`_start_direct`) runs on them: the coroutine
        sleeps until its ending."""
        was = self.phase
        self.phase = to = next_phase(was, event)
        if to is not was and (to is not Phase.STREAMING or not self._direct):
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
        self._on(Event.CLIENT_LEFT_ANSWERED if self._answered() else Event.CLIENT_LEFT)

    def _answered(self) -> bool:
        """`[DONE]` has gone to the client, from here or from the native leg."""
        feed, native = self._feed, self._native
        return (feed is not None and feed.done) or (native is not None and native.done_ns > 0)

    # -- the live registry (live.py `Watched`) --------------------------------------------------

    def live_view(self) -> LiveView | None:
        """For the live gauges: a streamed request until it ends."""
        if not self._plan.stream or self.phase in ENDINGS:
            return None
        return LiveView(self.label, self._timing.arrival_ns, self._timing.first_output_ns)

    def in_flight(self, now_ns: int, wall_now: float) -> InFlight:
        return in_flight_view(self.label, self._timing, self.last_read_ns,
                              self._record.in_flight_at_arrival or 0, now_ns, wall_now)

    def refresh(self, now_ns: int, every_ns: int) -> None:
        """The idle and stall clocks of a stream the native leg holds, brought up to date; and,
        when its last replay is `every_ns` or more before `now_ns` (or it has no first token
        yet), what it relayed since goes into the timing."""
        stream = self._native
        if stream is None:
            return
        if now_ns - self._replayed_ns >= every_ns or self._timing.first_output_ns is None:
            self._replayed_ns = now_ns
            self._replay(stream)
            return
        last_read_ns, self.client_blocked_ns = stream.clocks()
        if last_read_ns > self.last_read_ns:
            self.last_read_ns = last_read_ns

    def _replay(self, stream: Stream) -> None:
        last_read_ns, blocked_ns = replay(stream, self._timing)
        if last_read_ns > self.last_read_ns:
            self.last_read_ns = last_read_ns
        self.client_blocked_ns = blocked_ns

    def idle_timeout(self) -> None:
        """Nothing came from the upstream for the idle timeout."""
        self._force(Event.IDLE)

    def client_stalled(self) -> None:
        """The client has not read for the client stall timeout."""
        self._force(Event.STALL)

    def shut_down(self) -> None:
        """The shutdown grace is over: end now, telling the client why."""
        self._force(Event.SHUTDOWN)

    def _force(self, event: Event) -> None:
        was = self.phase
        self._on(event)
        if self.phase is was:
            return
        native = self._native
        if native is not None:
            native.stop()  # the thread hands the stream back; the ending applies then
        if self._blocked_in_send and self._task is not None:
            self._task.cancel()  # (other servers) a send the client will never drain

    # -- UpstreamHandler: called from the upstream connection's read callbacks ----------------

    def on_head(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.last_read_ns = perf_counter_ns()
        self._responded = True
        streamed = status == 200 and _content_type(headers).startswith(b"text/event-stream")
        if self.phase is not Phase.WAITING:
            self._on(Event.HEAD_STREAM if streamed else Event.HEAD_WHOLE)  # ended: it stays
            return
        self._status, self._headers = status, headers
        if not streamed:
            self._on(Event.HEAD_WHOLE)
            return
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
        self._on(Event.HEAD_STREAM)

    def _start_direct(self) -> None:
        """Under phasewatch's own server, start the client's response from this read callback:
        its head goes out with this read's output (vLLM sends the first event with its head),
        in one write, with no wake-up of the coroutine before it. Elsewhere, or if the client
        leg cannot start it, the coroutine starts it over ASGI (`_stream`)."""
        leg = self._leg
        if leg is None:
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
        self._wake_up()

    def on_read_end(self) -> None:
        """The read is parsed: what it produced goes out in one write (with the response's head
        in the read that brought it); then the native leg may take the stream."""
        out, prefix, feed = self._unwritten, self._prefix, self._feed
        # The body ended cleanly in this read: the response's end goes out with what it
        # brought (if anything), and the coroutine has only the record left to finish.
        last = (self._direct and self.phase is Phase.ENDED and feed is not None
                and feed.ended_whole)
        if out or prefix or last:
            self._unwritten, self._prefix = [], b""
            assert self._leg is not None
            self._leg.write_chunks(out, prefix, last)
        if not last:
            self._offer_native()

    def on_end(self, now_ns: int) -> None:
        if self.phase in (Phase.STREAMING, Phase.READING):
            self._end_ns = now_ns
        self._on(Event.BODY_END)

    def on_lost(self, reason: str, responded: bool) -> None:
        if self.phase not in ENDINGS:
            self._lost = reason
            self._responded = self._responded or responded
        self._on(Event.LOST)

    # -- the native leg ---------------------------------------------------------------------

    def _offer_native(self) -> None:
        """Hand the stream to the native leg, if it can go on exactly where Python stands: the
        stream counts its tokens exactly (or will from its first, `pending`), nothing is held
        or half-read, the upstream's parser stands between chunks, and nothing waits to be
        written to the client."""
        native = self._ctx.native
        if (native is None or self._native_refused or self._native is not None
                or self.phase is not Phase.STREAMING):
            return
        plan, counting = self._plan, self._timing.counting
        pending = counting is Counting.PENDING
        if not (counting is Counting.EXACT
                or (pending and plan.running_usage and plan.single_choice)):
            return
        feed, conn, leg = self._feed, self._conn, self._leg
        if (feed is None or not feed.between_events or conn is None or leg is None
                or not conn.between_chunks()):
            return
        if conn.plain_fd is None or leg.plain_fd is None:  # TLS on a side: it stays in Python
            self._native_refused = True
            return
        if not leg.can_lend():
            return
        conn.pause_reading()
        leg.lend(self._ctx.pool.poll_set)
        stream = native.start(conn.plain_fd, leg.plain_fd, plan.strip_chunk_usage,
                              plan.strip_final_usage, pending, self)
        if stream is None:
            self._native_refused = True
            leg.reclaim()
            conn.resume_reading()
            return
        self._native = stream
        self._replayed_ns = perf_counter_ns()  # nothing to replay yet (live.py `REPLAY_S`)
        self._ctx.live.hold(self)
        self._ctx.metrics.native_streams.inc()

    def native_returned(self, stream: Stream) -> None:
        """The native leg handed the stream back: go on from the byte it stopped at."""
        self._native = None
        self._ctx.live.release(self)
        self._replay(stream)
        leg, conn, feed = self._leg, self._conn, self._feed
        done_ns = stream.done_ns
        if done_ns and feed is not None and not feed.done:
            # [DONE] went out from the native leg: the exchange is complete as the client sees
            # it from that read on (as `on_body` has it).
            feed.done = True
            self._timing.end_ns = done_ns
        if leg is not None:
            leg.reclaim()  # the server reads the client again (a hang-up, a next request)
        ending = stream.ending
        if ending == Ending.ENDED and conn is not None:
            # The body ended cleanly in the thread's last read, and it wrote that read's output
            # and the response's end (`end_written`): the response is complete but for what
            # the client's socket did not take (`unsent`), which goes out first. (Without the
            # end, that read's output goes out with it, in one write, below.) Then the
            # upstream's parser hears the end the thread read for it.
            conn.resume_reading()  # for its next response: it goes back to the pool
            if stream.end_written and leg is not None:
                leg.end_written(stream.unsent)
            else:
                self._prefix = stream.unsent
            conn.take(_LAST_CHUNK, stream.leftover_ns)
            self._wake_up()
            return
        unsent, blocked_ns = stream.unsent, self.client_blocked_ns
        if unsent and leg is not None:
            leg.write_raw(unsent)  # may fill the client's buffer: `_client_blocked`
            if leg.paused and blocked_ns:
                self.client_blocked_ns = blocked_ns  # it stopped reading before this write
        if ending == Ending.CLIENT_ERROR:
            if leg is not None:
                leg.hung_up()
            self.client_gone()
        if conn is not None:
            if ending != Ending.UPSTREAM_ERROR and (leg is None or not leg.paused):
                # Reading resumes before the leftover is parsed: parsing it may hand the stream
                # to the native leg again, which pauses reading again.
                conn.resume_reading()
            leftover, held = stream.leftover, stream.held
            if leftover and held:  # a terminal chunk held, read before the rest
                conn.take(leftover[:held], stream.held_ns)
                leftover = leftover[held:]
            if leftover:
                conn.take(leftover, stream.leftover_ns)
            if ending == Ending.UPSTREAM_ERROR:  # what it read before the fault went out first
                conn.broke(OSError(stream.errno, os.strerror(stream.errno)))
            elif ending == Ending.FAULT and (feed is None or not feed.done):
                # The thread failed: what it read went out above, and the stream ends there with
                # an in-band error (`_stream_tail`). Where the thread left the upstream
                # connection is not vouched for, so it is closed, not reused.
                self._record.outcome = Outcome.INTERNAL_ERROR
                self._record.error = (f"phasewatch's native relay failed "
                                      f"({os.strerror(stream.errno)})")
                conn.broke(OSError(stream.errno, os.strerror(stream.errno)))
        self._wake_up()

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
                conn.finish(reusable=self.phase is Phase.ENDED and self._native is None)

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
        for attempt in range(2):
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
            self._conn = conn
            self._on(Event.SENT)
            conn.send(self, request)
            while self.phase is Phase.WAITING:
                await self._next()
            while self._native is not None and self.phase in ENDINGS:
                self._native.stop()  # ended while the native leg had it: take it back first
                await self._next()
            if self.phase is Phase.BROKEN and not self._responded and conn.reused and not attempt:
                # The upstream closed this kept-alive connection as we reused it: once more.
                self._conn = None
                conn.close()
                self._on(Event.RETRY)
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
        record, feed, leg = self._record, self._feed, self._leg
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
            if self.phase not in FORCED or self._task is None:
                raise
            # (other servers) a forced ending cut a send the client would never drain
            self._task.uncancel()
        finally:
            if leg is not None:
                leg.on_pause = leg.on_resume = None
        if self._forced_while_stalled():
            return
        if self.phase is Phase.CLIENT_GONE:
            record.outcome = Outcome.CANCELLED
            return
        if not feed.done:
            if self.phase is Phase.IDLE_TIMEOUT:
                record.outcome = Outcome.TIMEOUT
                record.error = "upstream went silent past the idle timeout"
            elif self.phase is Phase.BROKEN and record.outcome is not Outcome.INTERNAL_ERROR:
                record.outcome = Outcome.STREAM_ERROR
                record.error = f"upstream stream broke: {self._lost}"
            elif self.phase is Phase.SHUT_DOWN:
                record.outcome = Outcome.SHUTDOWN
                record.error = "phasewatch shut down before the stream ended"
        tail = self._stream_tail()
        if leg is not None and leg.response_complete:
            return  # ended with the last read (`on_read_end`): nothing held, nothing to add
        await send({"type": "http.response.body", "body": tail, "more_body": False})

    def _forced_while_stalled(self) -> bool:
        """A forced ending found the client not reading (at an idle timeout, that silence was
        back-pressure from it): another send would block the same way, so the exchange ends
        without one (the server closes the connection of a response left incomplete)."""
        leg, record = self._leg, self._record
        client_stalled = (self.phase is Phase.CLIENT_STALLED or self._blocked_in_send
                          or (leg is not None and leg.paused))
        if self.phase not in FORCED or not client_stalled:
            return False
        if self.phase is Phase.SHUT_DOWN:
            record.outcome = Outcome.SHUTDOWN
            record.error = "phasewatch shut down while the client was not reading"
        elif self.phase is Phase.CLIENT_STALLED:
            record.outcome = Outcome.CANCELLED
            record.error = "client stopped reading past the client stall timeout"
        else:
            record.outcome = Outcome.CANCELLED
            record.error = "client stopped reading past the idle timeout"
        self._timing.end_ns = perf_counter_ns()
        return True

    def _stream_tail(self) -> bytes:
        """What the client is still owed once the stream ended: what the feed held, and, for a
        stream cut before [DONE], an in-band error and [DONE], as vLLM sends errors."""
        record, timing, feed = self._record, self._timing, self._feed
        assert feed is not None
        end_ns = timing.end_ns or (self._end_ns if self.phase is Phase.ENDED
                                   else perf_counter_ns())
        timing.end_ns = end_ns
        rest = feed.end(end_ns)
        if not feed.done and record.outcome is Outcome.OK:
            record.outcome = Outcome.STREAM_ERROR
            record.error = "upstream closed the stream before [DONE]"
        if record.outcome not in _CUT or feed.done:
            return rest
        kind, code = _CUT[record.outcome]
        error = error_body(f"phasewatch: {record.error}", kind, code)
        # End a half-sent event first, so the error is an event of its own.
        return (rest + (b"\n\n" if feed.unterminated else b"")
                + b"data: " + error + b"\n\n" + _DONE_EVENT)

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
