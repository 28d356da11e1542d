"""The hot path: relay one inference request and time its stream as the client sees it.

Bytes are forwarded as they arrive, one `perf_counter_ns()` per read. Each complete SSE event
is classified (one small JSON parse) for timing; nothing else is parsed, validated or copied.
When phasewatch asked the upstream for usage the client did not want, the stream is forwarded
event by event with that usage cut out; otherwise each read is forwarded as it came.

Cutting the closing usage chunk would lose vLLM's `system_fingerprint`, which vLLM puts there
when usage is asked for and on the terminal chunk (finish_reason set) when it is not. So while
that chunk is to be cut, a terminal chunk is held until the next event (vLLM writes the usage
chunk right after it) and forwarded with the fingerprint spliced in, byte for byte what vLLM
would have sent. Timing is unaffected: every event is timed when its read returns. (With n > 1
a terminal chunk followed by another choice's tokens goes out as it came: the fingerprint is
not known yet, and holding the chunk to the end would delay its choice.)

The record is finished in `finally` and handed to a bounded queue: the relay never waits for
storage, and nothing that goes wrong in metrics or records can break a client's stream.
A client that leaves cancels the relay, which closes the upstream response at once, so the
engine aborts the request instead of generating for nobody.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from datetime import UTC, datetime
from time import perf_counter_ns

import aiohttp
import orjson

from app.core.events import (
    EventInfo,
    Kind,
    add_fingerprint,
    classify,
    strip_usage,
    system_fingerprint,
)
from app.core.records import Outcome, RequestRecord
from app.core.sse import SSEDecoder, event_data
from app.proxy.asgi import (
    REQUEST_ID,
    RUN_ID,
    ClientGone,
    Receive,
    Scope,
    Send,
    client_response_headers,
    error_body,
    header,
    read_body,
    send_error,
    send_full,
    upstream_request_headers,
)
from app.proxy.context import ProxyContext
from app.proxy.exchange import Exchange
from app.proxy.finish import finish
from app.proxy.request_plan import RequestPlan, plan_request
from app.proxy.timing import StreamTiming

log = logging.getLogger(__name__)

ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat.completions"}
_DONE_EVENT = b"data: [DONE]\n\n"


async def relay(
    ctx: ProxyContext, endpoint: str, scope: Scope, receive: Receive, send: Send
) -> None:
    arrival_ns = perf_counter_ns()
    timing = StreamTiming(arrival_ns)
    request_id = (header(scope, REQUEST_ID) or b"").decode("latin-1") or uuid.uuid4().hex
    run_id = header(scope, RUN_ID)
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
    try:
        body = await read_body(receive)
        plan = plan_request(body, ctx.settings.upstream_continuous_usage)
        record.model, record.stream = plan.model, plan.stream
        await _exchange(ctx, scope, receive, send, plan, record, timing)
    except ClientGone:
        record.outcome = Outcome.CANCELLED
    finally:
        if timing.end_ns is None:
            timing.end_ns = perf_counter_ns()
        ctx.in_flight -= 1
        ctx.metrics.in_flight.dec()
        finish(ctx, record, timing)


async def _exchange(
    ctx: ProxyContext,
    scope: Scope,
    receive: Receive,
    send: Send,
    plan: RequestPlan,
    record: RequestRecord,
    timing: StreamTiming,
) -> None:
    task = asyncio.current_task()
    assert task is not None
    state = Exchange(task, timing.arrival_ns)
    ctx.watchdog.watch(state)

    async def watch_disconnect() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        if not (state.responded or state.answered):
            state.client_gone = True
            task.cancel()

    watcher = asyncio.create_task(watch_disconnect())
    url = ctx.upstream + scope["path"]
    if scope.get("query_string"):
        url += "?" + scope["query_string"].decode("latin-1")
    response: aiohttp.ClientResponse | None = None
    try:
        try:
            response = await ctx.session.post(
                url, data=plan.body, headers=upstream_request_headers(scope, record.request_id)
            )
        except (TimeoutError, asyncio.CancelledError) as exc:
            if isinstance(exc, asyncio.CancelledError):
                if not state.timed_out:
                    raise
                task.uncancel()
            record.outcome = Outcome.TIMEOUT
            record.error = "upstream timed out before answering"
            state.responded = True
            await send_error(send, 504, f"upstream {ctx.upstream} timed out", "upstream_timeout",
                             record.request_id)
            return
        except aiohttp.ClientError as exc:
            record.outcome = Outcome.UNREACHABLE
            record.error = f"upstream unreachable: {type(exc).__name__}"
            state.responded = True
            await send_error(send, 502, f"upstream {ctx.upstream} is unreachable: {exc}",
                             "upstream_unreachable", record.request_id)
            return
        record.http_status = response.status
        content_type = response.headers.get("Content-Type", "")
        if response.status == 200 and content_type.startswith("text/event-stream"):
            await _relay_stream(ctx, send, response, plan, record, timing, state)
        else:
            await _relay_whole(send, response, record, timing, state)
        response.release()
    except asyncio.CancelledError:
        if not state.client_gone:
            raise
        task.uncancel()
        record.outcome = Outcome.CANCELLED
    except OSError:  # the server reports a send to a client that has gone
        record.outcome = Outcome.CANCELLED
    finally:
        watcher.cancel()
        ctx.watchdog.forget(state)
        if response is not None and record.outcome in (Outcome.CANCELLED, Outcome.TIMEOUT):
            response.close()  # drop the upstream connection: the engine aborts the request


async def _relay_whole(
    send: Send,
    response: aiohttp.ClientResponse,
    record: RequestRecord,
    timing: StreamTiming,
    state: Exchange,
) -> None:
    """A non-streamed answer or an error status: read it whole, forward it unchanged."""
    body = await response.read()
    timing.end_ns = perf_counter_ns()
    if 200 <= response.status < 300:
        _read_usage(body, timing)
    else:
        record.outcome = Outcome.HTTP_ERROR
        record.error = _error_type(body, response.status)
    state.responded = True
    headers = client_response_headers(response.raw_headers, record.request_id, len(body))
    await send_full(send, response.status, headers, body)


async def _relay_stream(
    ctx: ProxyContext,
    send: Send,
    response: aiohttp.ClientResponse,
    plan: RequestPlan,
    record: RequestRecord,
    timing: StreamTiming,
    state: Exchange,
) -> None:
    headers = client_response_headers(response.raw_headers, record.request_id, None)
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    decoder = SSEDecoder()
    rewrite = plan.strip_final_usage or plan.strip_chunk_usage
    hold = plan.strip_final_usage  # the usage chunk, and the fingerprint on it, will be cut
    held: list[bytes] = []  # terminal chunks waiting for the event after them
    done = False
    # True while the relay waits in a send: a stall there is the client's (it stopped reading,
    # and back-pressure silenced the upstream), not the upstream's.
    sending = False
    try:
        async for data in response.content.iter_any():
            now = state.last_read_ns = perf_counter_ns()
            if not rewrite:
                for raw in decoder.decode(data):
                    done = _note(raw, now, record, timing).kind is Kind.DONE or done
                sending = True
                await send({"type": "http.response.body", "body": data, "more_body": True})
                sending = False
                if done and not state.answered:
                    _answered(state, timing, now)
                continue
            parts: list[bytes] = []
            for raw in decoder.decode(data):
                info = _note(raw, now, record, timing)
                kind = info.kind
                done = kind is Kind.DONE or done
                if kind is Kind.USAGE:
                    if held:
                        parts += _stamped(held, raw)
                        held = []
                    if plan.strip_final_usage:
                        continue
                else:
                    if plan.strip_chunk_usage and b'"usage":' in raw:
                        raw = strip_usage(raw)
                    if hold:
                        if info.finished:
                            held.append(raw)
                            continue
                        if held:  # no usage chunk came next: nothing to stamp them with
                            parts += held
                            held = []
                parts.append(raw)
            if parts:
                sending = True
                await send(
                    {"type": "http.response.body", "body": b"".join(parts), "more_body": True}
                )
                sending = False
            if done and not state.answered:
                _answered(state, timing, now)
    except asyncio.CancelledError:
        if not state.timed_out:
            raise
        state.task.uncancel()
        if sending:
            # Another send would block the same way: end the exchange without one (the server
            # closes the connection of a response left incomplete).
            record.outcome = Outcome.CANCELLED
            record.error = "client stopped reading past the idle timeout"
            timing.end_ns = perf_counter_ns()
            state.responded = True
            return
        if not done:  # after [DONE] the client has its whole answer: a lingering body is moot
            record.outcome = Outcome.TIMEOUT
            record.error = "upstream went silent past the idle timeout"
    except aiohttp.ClientPayloadError as exc:
        if not done:
            record.outcome = Outcome.STREAM_ERROR
            record.error = f"upstream stream broke: {type(exc).__name__}"
    end_ns = timing.end_ns if state.answered and timing.end_ns else perf_counter_ns()
    timing.end_ns = end_ns
    if held:  # the stream ended right after a terminal chunk: forward it as it came
        await send({"type": "http.response.body", "body": b"".join(held), "more_body": True})
    unterminated = decoder.flush()  # a last event without its blank line, or a broken one
    for raw in unterminated:
        done = _note(raw, end_ns, record, timing).kind is Kind.DONE or done
        if rewrite:
            await send({"type": "http.response.body", "body": raw, "more_body": True})
    tail = b""
    if not done and record.outcome is Outcome.OK:
        record.outcome = Outcome.STREAM_ERROR
        record.error = "upstream closed the stream before [DONE]"
    if record.outcome in (Outcome.TIMEOUT, Outcome.STREAM_ERROR) and not done:
        # Never leave the client hanging on a broken stream: say why, in-band, as vLLM does.
        message = f"phasewatch: {record.error}"
        error = error_body(message, "upstream_error", 502)
        # End a half-sent event first, so the error is an event of its own.
        tail = (b"\n\n" if unterminated else b"") + b"data: " + error + b"\n\n" + _DONE_EVENT
    state.responded = True
    await send({"type": "http.response.body", "body": tail, "more_body": False})


def _answered(state: Exchange, timing: StreamTiming, now: int) -> None:
    """[DONE] has been forwarded: the exchange is complete as the client sees it.

    The upstream may end its body a moment later, and a client may close at [DONE] (the openai
    SDK does) before then; neither makes the request cancelled or longer.
    """
    state.answered = True
    timing.end_ns = now


def _stamped(held: list[bytes], usage_event: bytes) -> list[bytes]:
    """Held terminal chunks with the usage chunk's fingerprint, where vLLM would have put it;
    unchanged when it has none (fingerprints off, or not a vLLM)."""
    fingerprint = system_fingerprint(usage_event)
    if fingerprint is None:
        return held
    return [add_fingerprint(raw, fingerprint) for raw in held]


_COMMENT = EventInfo(Kind.OTHER)


def _note(raw: bytes, now: int, record: RequestRecord, timing: StreamTiming) -> EventInfo:
    """Update timing from one raw event; return what it is (OTHER for a comment-only event)."""
    data = event_data(raw)
    if data is None:
        return _COMMENT
    info = classify(data)
    if info.has_usage:
        timing.completion_tokens = info.completion_tokens
        timing.prompt_tokens = info.prompt_tokens
    if info.kind is Kind.OUTPUT:
        timing.output(now, info.completion_tokens, info.chars)
    elif info.kind is Kind.ERROR and record.outcome is Outcome.OK:
        record.outcome = Outcome.STREAM_ERROR
        record.error = "in-band error from upstream"
    return info


def _read_usage(body: bytes, timing: StreamTiming) -> None:
    try:
        usage = orjson.loads(body).get("usage")
    except (orjson.JSONDecodeError, AttributeError):
        return
    if isinstance(usage, dict):
        timing.completion_tokens = usage.get("completion_tokens")
        timing.prompt_tokens = usage.get("prompt_tokens")


def _error_type(body: bytes, status: int) -> str:
    """The error's type and code, never its message: messages can echo the request."""
    try:
        error = orjson.loads(body).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        error = None
    if isinstance(error, dict):
        return f"HTTP {status}: {str(error.get('type'))[:80]}"
    return f"HTTP {status}"
