"""A fast fake vLLM for the overhead benchmark: streams OpenAI-format SSE as cheaply as it can.

It answers `POST /v1/completions` and `POST /v1/chat/completions` with `stream: true` the way
vLLM does (chunked `text/event-stream`, one `data:` event per token, `data: [DONE]` last) and
honours `stream_options` like vLLM: `include_usage` adds the closing `choices: []` usage chunk,
and `continuous_usage_stats` (with `include_usage`) puts running usage on every chunk. So a
proxy in front of it does the same work it does in front of vLLM.

Every chunk carries the `time.monotonic_ns()` read just before it was written to the socket,
as the last `-` field of its `id` (`cmpl-<request>-<ns>`). CLOCK_MONOTONIC is one clock for
every process on a Linux host, so the load generator's arrival time minus this stamp is the
chunk's lag from the upstream's write to the client's read.

Timing: the first chunk is written `--first-delay-ms` after the request (a stand-in for
prefill), then one chunk every `--interval-ms` (a decode), against absolute deadlines so the
pace does not drift. The request's `max_tokens` sets the number of content chunks.

It is a raw asyncio protocol on uvloop with httptools' parser (both come with
`uvicorn[standard]`), not an ASGI app, so its own cost per chunk stays small and known. It
must not be used for anything but benchmarks: no validation, no real model, one process.
GET on any path answers `{"status":"ok"}` (readiness probes).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import time
from typing import cast

import httptools
import orjson
import uvloop

_STREAM_HEADERS = (
    b"HTTP/1.1 200 OK\r\n"
    b"content-type: text/event-stream; charset=utf-8\r\n"
    b"transfer-encoding: chunked\r\n"
    b"\r\n"
)
_LAST_CHUNK = b"0\r\n\r\n"
_DONE = b"data: [DONE]\n\n"
_TOKEN = " tok"
_PROMPT_TOKENS = 16


class Config:
    __slots__ = ("default_tokens", "first_delay_s", "interval_s")

    def __init__(self, first_delay_s: float, interval_s: float, default_tokens: int) -> None:
        self.first_delay_s = first_delay_s
        self.interval_s = interval_s
        self.default_tokens = default_tokens


class _Request:
    __slots__ = ("body", "keep_alive", "method", "url")

    def __init__(self, method: bytes, url: bytes, body: bytes, keep_alive: bool) -> None:
        self.method = method
        self.url = url
        self.body = body
        self.keep_alive = keep_alive


def _frame(payload: bytes) -> bytes:
    """One HTTP/1.1 chunked-encoding frame."""
    return b"%x\r\n%b\r\n" % (len(payload), payload)


def _usage(completion: int) -> bytes:
    return b'{"prompt_tokens":%d,"total_tokens":%d,"completion_tokens":%d}' % (
        _PROMPT_TOKENS, _PROMPT_TOKENS + completion, completion,
    )


class _ChunkWriter:
    """Builds vLLM-shaped chunk payloads for one stream (completions or chat)."""

    def __init__(self, chat: bool, rid: int, model: bytes, continuous: bool) -> None:
        self.chat = chat
        self.continuous = continuous
        self.prefix = b"chatcmpl-%d-" % rid if chat else b"cmpl-%d-" % rid
        self.obj = b"chat.completion.chunk" if chat else b"text_completion"
        self.created = int(time.time())
        self.model = model

    def _head(self, stamp: int) -> bytes:
        return b'{"id":"%b%d","object":"%b","created":%d,"model":"%b",' % (
            self.prefix, stamp, self.obj, self.created, self.model,
        )

    def role(self, stamp: int) -> bytes:
        """The chat role chunk vLLM sends before the first token: not output."""
        usage = b',"usage":' + _usage(0) if self.continuous else b""
        return b'data: %b"choices":[{"index":0,"delta":{"role":"assistant","content":""},' \
            b'"logprobs":null,"finish_reason":null}]%b}\n\n' % (self._head(stamp), usage)

    def token(self, stamp: int, completion: int, last: bool) -> bytes:
        finish = b'"length"' if last else b"null"
        if self.chat:
            usage = b',"usage":' + _usage(completion) if self.continuous else b""
            choice = b'{"index":0,"delta":{"content":"%b"},"logprobs":null,"finish_reason":%b}' % (
                _TOKEN.encode(), finish,
            )
        else:
            # vLLM writes completion chunks with every field, so `"usage":null` when not asked.
            usage = b',"usage":' + (_usage(completion) if self.continuous else b"null")
            choice = (
                b'{"index":0,"text":"%b","logprobs":null,"finish_reason":%b,"stop_reason":null}'
                % (_TOKEN.encode(), finish)
            )
        return b'data: %b"choices":[%b]%b}\n\n' % (self._head(stamp), choice, usage)

    def final_usage(self, stamp: int, completion: int) -> bytes:
        return b'data: %b"choices":[],"usage":%b}\n\n' % (self._head(stamp), _usage(completion))


class UpstreamProtocol(asyncio.Protocol):
    """One client connection: parse requests with httptools, answer them one after another."""

    counter = 0  # request ids, process-wide
    chunks_written = 0

    def __init__(self, config: Config) -> None:
        self.config = config
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.can_write = asyncio.Event()
        self.can_write.set()
        self.pending: collections.deque[_Request] = collections.deque()
        self.runner: asyncio.Task[None] | None = None
        self._url = b""
        self._body: list[bytes] = []

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.can_write.set()
        if self.runner is not None:
            self.runner.cancel()  # like vLLM: the client left, abort the request

    def pause_writing(self) -> None:
        self.can_write.clear()

    def resume_writing(self) -> None:
        self.can_write.set()

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self._write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
            self._close()

    # httptools callbacks
    def on_message_begin(self) -> None:
        self._url = b""
        self._body = []

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        request = _Request(
            self.parser.get_method(), self._url, b"".join(self._body),
            self.parser.should_keep_alive(),
        )
        self.pending.append(request)
        if self.runner is None:
            self.runner = asyncio.get_running_loop().create_task(self._serve_pending())

    # serving
    def _write(self, data: bytes) -> None:
        if self.transport is not None and not self.closed:
            self.transport.write(data)

    def _close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()
        self.closed = True

    async def _serve_pending(self) -> None:
        try:
            while self.pending and not self.closed:
                request = self.pending.popleft()
                await self._serve(request)
                if not request.keep_alive:
                    self._close()
        finally:
            self.runner = None

    async def _serve(self, request: _Request) -> None:
        if request.method != b"POST":
            self._respond_json(200, b'{"status":"ok"}')
            return
        try:
            body = orjson.loads(request.body)
        except orjson.JSONDecodeError:
            self._respond_json(400, b'{"error":{"message":"bad json","type":"bad_request"}}')
            return
        chat = request.url.split(b"?", 1)[0].endswith(b"/chat/completions")
        tokens = body.get("max_tokens") or self.config.default_tokens
        model = str(body.get("model") or "bench").encode()
        UpstreamProtocol.counter += 1
        rid = UpstreamProtocol.counter
        if body.get("stream") is not True:
            text = _TOKEN * tokens
            choice = {"index": 0, "finish_reason": "length"}
            choice.update({"message": {"role": "assistant", "content": text}} if chat
                          else {"text": text})
            self._respond_json(200, orjson.dumps({
                "id": f"cmpl-{rid}", "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": model.decode(), "choices": [choice],
                "usage": orjson.loads(_usage(tokens)),
            }))
            return
        options = body.get("stream_options") or {}
        include_usage = options.get("include_usage") is True
        continuous = include_usage and options.get("continuous_usage_stats") is True
        # A benchmark may set the decode pace per request (`x_interval_ms`, not an OpenAI field),
        # so one upstream serves every shape of a run at an equal chunk rate.
        interval_ms = body.get("x_interval_ms")
        interval_s = interval_ms / 1000 if interval_ms else self.config.interval_s
        await self._stream(_ChunkWriter(chat, rid, model, continuous), tokens, include_usage,
                           interval_s)

    def _respond_json(self, status: int, payload: bytes) -> None:
        self._write(
            b"HTTP/1.1 %d %b\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%b"
            % (status, b"OK" if status == 200 else b"Error", len(payload), payload)
        )

    async def _stream(self, writer: _ChunkWriter, tokens: int, include_usage: bool,
                      interval_s: float) -> None:
        self._write(_STREAM_HEADERS)
        if writer.chat:
            self._write(_frame(writer.role(time.monotonic_ns())))
        stream = _Stream(self, writer, tokens, include_usage, interval_s)
        stream.schedule()
        await stream.finished


class _Stream:
    """One response's decode: a timer callback per chunk, no task or future per chunk.

    Callbacks rather than `asyncio.sleep` in a task keep the upstream's own CPU per chunk
    small, so more of the machine is left to the proxy being measured.
    """

    __slots__ = ("config", "finished", "i", "include_usage", "interval_s", "loop", "proto",
                 "start", "tokens", "writer")

    def __init__(self, proto: UpstreamProtocol, writer: _ChunkWriter, tokens: int,
                 include_usage: bool, interval_s: float) -> None:
        self.proto = proto
        self.writer = writer
        self.tokens = tokens
        self.include_usage = include_usage
        self.config = proto.config
        self.interval_s = interval_s
        self.loop = asyncio.get_running_loop()
        self.start = self.loop.time()
        self.i = 0
        self.finished: asyncio.Future[None] = self.loop.create_future()

    def schedule(self) -> None:
        # Absolute deadlines: the pace of a decode, without drift from late wake-ups.
        when = self.start + self.config.first_delay_s + self.i * self.interval_s
        self.loop.call_at(when, self.tick)

    def tick(self) -> None:
        proto = self.proto
        if proto.closed:
            self._finish()
            return
        if not proto.can_write.is_set():  # the reader is slow: wait for the buffer to drain
            self.loop.create_task(self._resume())
            return
        i = self.i
        last = i == self.tokens - 1
        # The stamp is read right before the write: the client's lag starts here.
        proto._write(_frame(self.writer.token(time.monotonic_ns(), i + 1, last)))
        UpstreamProtocol.chunks_written += 1
        self.i = i + 1
        if not last:
            self.schedule()
            return
        tail = b""
        if self.include_usage:
            tail = _frame(self.writer.final_usage(time.monotonic_ns(), self.tokens))
        proto._write(tail + _frame(_DONE) + _LAST_CHUNK)
        self._finish()

    async def _resume(self) -> None:
        await self.proto.can_write.wait()
        self.tick()

    def _finish(self) -> None:
        if not self.finished.done():
            self.finished.set_result(None)


async def serve(host: str, port: int, config: Config) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: UpstreamProtocol(config), host, port, backlog=4096, reuse_address=True
    )
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--first-delay-ms", type=float, default=0.0,
                        help="delay before the first token (a stand-in for prefill)")
    parser.add_argument("--interval-ms", type=float, default=20.0,
                        help="time between two chunks (a decode step)")
    parser.add_argument("--tokens", type=int, default=64,
                        help="content chunks per stream when the request has no max_tokens")
    args = parser.parse_args()
    config = Config(args.first_delay_ms / 1000, args.interval_ms / 1000, args.tokens)
    with contextlib.suppress(KeyboardInterrupt):
        uvloop.run(serve(args.host, args.port, config))


if __name__ == "__main__":
    main()
