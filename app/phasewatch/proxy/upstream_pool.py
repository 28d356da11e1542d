"""The timed relay's upstream leg at protocol level: keep-alive connections, reads by callback.

Each upstream connection is an `asyncio.Protocol` that parses responses with httptools and
hands every read to the exchange using it, synchronously, in the event loop's own read
callback: no task wake-up, future or stream reader per chunk (aiohttp's per-read machinery
cost more CPU than the rest of the relay together; see the overhead benchmark). The time of a
read is taken once, when the bytes arrive, before they are parsed.

Connections are pooled per upstream, newest first, and reused while the upstream keeps them
alive. An idle connection the upstream closes leaves the pool at once. One that the upstream
closed while it was being reused (the close and the request crossing) fails before any
response byte; the exchange then retries once on a new connection. A connection whose
exchange was cut short is closed, never reused: closing it is how the engine learns to abort.

This module knows HTTP/1.1 and nothing of SSE, timing or records (`relay.py` does).
The pass-through of non-inference paths keeps using aiohttp: it is not on the hot path.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Iterable
from enum import Enum
from time import perf_counter_ns
from typing import Protocol
from urllib.parse import urlsplit

import httptools

from phasewatch.core.event_loop import PollSet
from phasewatch.proxy.native import plain_fd


class UpstreamHandler(Protocol):
    """What an exchange hears from its upstream connection; called from read callbacks."""

    def on_head(self, status: int, headers: list[tuple[bytes, bytes]]) -> None: ...
    def on_body(self, data: bytes, now_ns: int) -> None: ...
    def on_end(self, now_ns: int) -> None: ...
    def on_lost(self, reason: str, responded: bool) -> None: ...
    def on_read_end(self) -> None: ...


class ConnState(Enum):
    CONNECTING = "connecting"
    IDLE = "idle"  # in the pool
    BUSY = "busy"  # carrying an exchange's request or response
    CLOSED = "closed"


class UpstreamConnection(asyncio.Protocol):
    __slots__ = ("_body_until_close", "_chunked", "_handler", "_head_ended_read", "_headers",
                 "_last_piece", "_last_read",
                 "_parser", "_pool", "_read_ns", "_responded", "idle_since", "keep_alive",
                 "plain_fd", "reused", "state", "transport")

    def __init__(self, pool: UpstreamPool) -> None:
        self._pool = pool
        self._parser = httptools.HttpResponseParser(self)
        self._handler: UpstreamHandler | None = None
        self._headers: list[tuple[bytes, bytes]] = []
        self._read_ns = 0
        # The last read, and the last body piece parsed from it: where the parser stands.
        self._last_read = b""
        self._last_piece: bytes | None = None
        self._head_ended_read = False  # the last read completed the response's head
        self._chunked = False  # the response's body is chunked
        self._responded = False  # a byte of the current response has arrived
        self._body_until_close = False
        self.transport: asyncio.Transport | None = None
        self.plain_fd: int | None = None  # its socket, for the native leg (native.py)
        self.state = ConnState.CONNECTING
        self.keep_alive = False
        self.reused = False
        self.idle_since = 0

    # -- used by the exchange ---------------------------------------------------------------

    def send(self, handler: UpstreamHandler, request: bytes) -> None:
        """Write one request; its response is reported to `handler`."""
        assert self.transport is not None and self.state is not ConnState.CLOSED
        self._expect(handler)
        self.transport.write(request)

    def _expect(self, handler: UpstreamHandler) -> None:
        """A request went out: its response, from its first byte, is `handler`'s."""
        self._handler = handler
        self._headers = []
        self._last_read, self._last_piece = b"", None
        self._head_ended_read = self._chunked = False
        self._responded = False
        self._body_until_close = False
        self.keep_alive = False
        self.state = ConnState.BUSY

    def finish(self, reusable: bool) -> None:
        """The exchange is done with this connection: back to the pool, or closed. Not reused
        while part of its request is still unsent (an upstream that answered before reading a
        whole body would read the rest as the next request's start)."""
        self._handler = None
        transport = self.transport
        if (reusable and self.keep_alive and self.state is ConnState.BUSY
                and transport is not None and not transport.get_write_buffer_size()):
            self._pool.put_back(self)
        else:
            self.close()

    def close(self) -> None:
        self._handler = None
        if self.state is not ConnState.CLOSED:
            self.state = ConnState.CLOSED
            if self.transport is not None:
                self.transport.close()

    def pause_reading(self) -> None:
        transport = self.transport
        if transport is not None and self.state is ConnState.BUSY:
            transport.pause_reading()
            if self.plain_fd is not None and self._pool.poll_set is not None:
                self._pool.poll_set.forget(transport, self.plain_fd)

    def resume_reading(self) -> None:
        if self.transport is not None and self.state is ConnState.BUSY:
            self.transport.resume_reading()

    def between_chunks(self) -> bool:
        """The parser holds nothing and the next byte starts a chunk's size line of a chunked
        body (so the native leg may read from there, native.py): the last read ended exactly
        where a chunk ends whose data ends an SSE event (`\n\n`), or exactly where the
        response's head ends.

        Sound without the parser's help: a read that ended inside a chunk ends with the piece
        parsed from it, so it ends with `\n\n`, and cannot also end with that piece's
        framing, which ends with CRLF; a read that completed the head and brought no body
        piece ends with the head's blank line only if nothing of the body came with it (a
        size line alone ends with one CRLF, and any data byte would have been a piece)."""
        if self.state is not ConnState.BUSY or not self._chunked:
            return False
        piece = self._last_piece
        if piece is None:
            return self._head_ended_read and self._last_read.endswith(b"\r\n\r\n")
        return (piece.endswith(b"\n\n")
                and self._last_read.endswith(b"%x\r\n%b\r\n" % (len(piece), piece)))

    def take(self, data: bytes, now_ns: int) -> None:
        """Parse bytes the native relay read at `now_ns` and did not take, as a read."""
        if self.state is ConnState.BUSY:
            self._read(data, now_ns)

    def broke(self, exc: OSError) -> None:
        """The native relay's read of this connection failed: as `connection_lost` would."""
        handler = self._handler
        self.close()
        if handler is not None:
            handler.on_lost(f"connection closed: {type(exc).__name__}", True)

    # -- asyncio.Protocol -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.plain_fd = plain_fd(transport)

    def data_received(self, data: bytes) -> None:
        self._read(data, perf_counter_ns())

    def _read(self, data: bytes, now_ns: int) -> None:
        self._read_ns = now_ns
        self._responded = True
        self._last_read, self._last_piece = data, None
        self._head_ended_read = False
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            handler = self._handler
            self.close()
            if handler is not None:
                handler.on_read_end()  # what the read held before the fault still goes out
                handler.on_lost(f"invalid HTTP response: {exc}", True)
            return
        handler = self._handler
        if handler is not None:
            handler.on_read_end()

    def eof_received(self) -> bool | None:
        return None  # close the transport: a half-closed upstream connection is of no use

    def connection_lost(self, exc: Exception | None) -> None:
        was = self.state
        self.state = ConnState.CLOSED
        self._pool.forget(self)
        handler, self._handler = self._handler, None
        if handler is None or was is not ConnState.BUSY:
            return
        if self._body_until_close:  # a body without length or chunks ends when the peer closes
            handler.on_end(perf_counter_ns())
            return
        reason = f"connection closed: {type(exc).__name__}" if exc else "connection closed"
        handler.on_lost(reason, self._responded)

    # -- httptools callbacks ----------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        parser = self._parser
        # Read keep-alive now: once the message is complete httptools reports False.
        self.keep_alive = parser.should_keep_alive()
        status = parser.get_status_code()
        self._head_ended_read = status >= 200
        # llhttp takes `chunked` only as the last transfer coding: the body is chunked.
        self._chunked = any(name.lower() == b"transfer-encoding"
                            and value.lower().rstrip().endswith(b"chunked")
                            for name, value in self._headers)
        if status >= 200 and not any(
            name.lower() in (b"content-length", b"transfer-encoding") for name, _ in self._headers
        ) and status not in (204, 304):
            self._body_until_close = True
            self.keep_alive = False
        if status < 200:  # 1xx interim answers are not the response
            self._headers = []
            return
        handler = self._handler
        if handler is not None:
            handler.on_head(status, self._headers)

    def on_body(self, body: bytes) -> None:
        self._last_piece = body
        handler = self._handler
        if handler is not None:
            handler.on_body(body, self._read_ns)

    def on_message_complete(self) -> None:
        if self._parser.get_status_code() < 200:
            return
        handler = self._handler
        if handler is not None:
            handler.on_end(self._read_ns)


class UpstreamPool:
    """Keep-alive connections to one upstream, newest first; `max_connections` 0: no cap."""

    def __init__(self, base_url: str, connect_timeout_s: float, max_connections: int = 0,
                 keepalive_s: float = 30.0, poll_set: PollSet | None = None) -> None:
        parts = urlsplit(base_url)
        self.secure = parts.scheme == "https"
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or (443 if self.secure else 80)
        self.prefix = parts.path.rstrip("/").encode("latin-1")  # a base URL's own path
        self.host_header = (parts.netloc.rpartition("@")[2]).encode("idna")
        self.connect_timeout_s = connect_timeout_s
        self.keepalive_ns = int(keepalive_s * 1e9)
        self._idle: list[UpstreamConnection] = []
        self._open: set[UpstreamConnection] = set()
        self._slots = asyncio.Semaphore(max_connections) if max_connections > 0 else None
        self._ssl = ssl.create_default_context() if self.secure else None
        # The loop's poll set (event_loop.py): a paused connection's socket leaves it at once.
        self.poll_set = poll_set

    @property
    def open_connections(self) -> int:
        return len(self._open)

    def take_idle(self) -> UpstreamConnection | None:
        """A pooled connection still open and fresh enough to reuse, or None."""
        now = perf_counter_ns()
        while self._idle:
            conn = self._idle.pop()
            if conn.state is ConnState.IDLE and now - conn.idle_since < self.keepalive_ns:
                conn.reused = True
                conn.state = ConnState.BUSY
                return conn
            conn.close()
        return None

    async def connect(self) -> UpstreamConnection:
        """A new connection; raises OSError (refused, reset) or TimeoutError."""
        if self._slots is not None:
            await self._slots.acquire()
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: UpstreamConnection(self), self.host, self.port, ssl=self._ssl,
                    server_hostname=self.host if self.secure else None,
                )
        except BaseException:
            if self._slots is not None:
                self._slots.release()
            raise
        conn.state = ConnState.BUSY
        self._open.add(conn)
        return conn

    def put_back(self, conn: UpstreamConnection) -> None:
        conn.state = ConnState.IDLE
        conn.idle_since = perf_counter_ns()
        self._idle.append(conn)

    def forget(self, conn: UpstreamConnection) -> None:
        if conn in self._open:
            self._open.discard(conn)
            if self._slots is not None:
                self._slots.release()
        # A closed connection left in `_idle` is skipped by `take_idle`.

    def close(self) -> None:
        for conn in list(self._open):
            conn.close()
        self._idle.clear()
        if self.poll_set is not None:
            self.poll_set.close()
            self.poll_set = None

    def request(self, method: bytes, target: bytes, headers: Iterable[tuple[bytes, bytes]],
                body: bytes) -> bytes:
        """One HTTP/1.1 request's bytes: `target` is the path (and query) on the upstream."""
        lines = [method, b" ", self.prefix, target, b" HTTP/1.1\r\nhost: ", self.host_header,
                 b"\r\n"]
        for name, value in headers:
            lines += (name, b": ", value, b"\r\n")
        lines += (b"content-length: ", str(len(body)).encode(), b"\r\n\r\n", body)
        return b"".join(lines)
