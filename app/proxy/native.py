"""The native leg: where the middle of a stream is relayed below Python, and how it comes back.

A stream whose tokens are counted exactly (timing.py) spends nearly all its reads as running
token chunks. Once one has been relayed and Python's reading of the stream is at a chunk
boundary with nothing held, the relay hands both sockets to the native thread (`_native.c`):
it relays and stamps those chunks with no Python per read, and the stream's tail too (the
terminal chunk, the closing usage chunk, `[DONE]`, the body's last chunk) and writes the
response's end, so that a stream usually comes back once, ended (`Ending.ENDED`,
`end_written`), the client having its whole response: Python then completes the server's cycle
and finishes the record. The thread does not wake the event loop for such an ending: the loop
takes it on its next wake-up for anything else (`take_ended`: each read of a client's bytes,
before anything else is done with them, and each pass of the live registry, before a render of
`/metrics` or a snapshot), or the thread wakes it `QUIET_NS` (20 ms) later at most. So a
request or a scrape that follows a response's end finds its record and figures. A pipelined
request (one the server queued behind the response, client_leg.py) has the stream `urge`d: its
end then comes back with a wake-up at once. It comes back earlier at the first
chunk it does not take plainly (the role chunk, an error, anything after `[DONE]`), at a body
that ends before `[DONE]`, at a broken socket, or when the relay asks (the client left, an
idle or stall timeout, shutdown); Python then goes on from that exact byte
(`Exchange.native_returned`).

What a client receives and every timing definition are those of the Python path: the thread
applies `StreamFeed`'s own tests and cuts, and the relay replays each logged (read time,
completion tokens, prompt tokens) into the stream's `StreamTiming`, and the time of the read
that brought `[DONE]` as the stream's end (`done_ns`). The replay runs when the stream comes
back, before each render of `/metrics` by its process and each live snapshot, and otherwise
on a pass of the live registry once `REPLAY_S` have gone by since the last (live.py). So a
scrape of a single process counts every token relayed before it, and under several workers
another worker's native streams reach the ITL histogram at most `REPLAY_S` and a pass late.
The idle and client-stall timeouts read the thread's last read and blocked-since times
(`clocks()`) of the streams the thread names on a pass (`due`: those whose clocks may be past
a timeout, or whose replay is due), so a timeout is seen within a pass of it, as on the Python
path. A client that leaves after the thread sent `[DONE]` had its whole answer, as on the
Python path: that cancels nothing.

A stream can also come to the thread as soon as its request is sent (`start(..., head=...)`,
relay.py `_start_native_at_head`): a streamed request counted from its first token (one
choice, running usage asked for). The thread then reads the upstream's head as well; when it
is a plain `200` event stream it writes the client's head, made as the Python path makes it
(`ClientLeg.head_parts` around the upstream's headers, filtered as `client_response_headers`
filters them), in one write with the first token, and keeps the upstream's head (`head`) for
Python to parse into its own state (the response's status, label and metrics, the client
cycle's) when it next looks at the stream: its first replay. Until the first token the thread
takes only that token's chunk or vLLM's role chunk. Any other head goes back to Python with
every byte read and nothing written; any other first event, from its first byte, after the
client's head. The first token's time is replayed
like the others, so its TTFT reaches the histogram at that replay: on the live registry's
first pass after it (a pass replays a stream still without a first token), before a render of
`/metrics` or a snapshot, or at the stream's end.

A terminal chunk that the Python path would hold for the usage chunk's fingerprint
(stream.py) is held by the thread as well, until a whole chunk follows it: a usage chunk is
cut and its fingerprint spliced into the held chunk, byte for byte as `StreamFeed` does; any
other chunk sends the stream back with the held chunk's read time apart (`held`, `held_ns`).

Used under phasewatch's own server (the client leg), on plain TCP on both sides (TLS stays in
Python), on Linux where the extension is built; `PHASEWATCH_NATIVE_RELAY=false` turns it off.
"""

from __future__ import annotations

import asyncio
import logging
from enum import IntEnum
from importlib import import_module
from typing import TYPE_CHECKING, Any, Protocol

from phasewatch.core.log_throttle import LogThrottle

# Why the native front let a connection go (`_native.c`): its upstream connection is of no
# more use (closed by the upstream, or part of a request went on it); the client's connection
# was idle for the server's keep-alive timeout.
FRONT_BROKEN, FRONT_EXPIRED = 5, 6

if TYPE_CHECKING:
    from phasewatch.proxy.timing import StreamTiming

log = logging.getLogger(__name__)
# A replay that keeps failing would be logged on every pass over the open streams.
_REPLAY_FAULTS = LogThrottle()


class Ending(IntEnum):
    """Why the thread handed a stream back (`_native.c`)."""

    HANDOVER = 1  # a chunk it does not take plainly, or the body's last chunk
    ASKED = 2  # the relay asked (`stop()`), or the native relay is closing
    UPSTREAM_EOF = 3  # the upstream closed its side
    UPSTREAM_ERROR = 4  # reading the upstream failed (`errno`)
    CLIENT_ERROR = 5  # writing to the client failed: it is gone
    ENDED = 6  # the body ended cleanly after [DONE], and the response's end was written


class Stream(Protocol):
    """One stream held by the thread (the extension's `Stream`)."""

    owner: Any
    ending: int
    errno: int
    leftover_ns: int
    leftover: bytes | None
    held: int
    held_ns: int
    unsent: bytes
    done_ns: int  # the time of the read that brought [DONE] (0: it has not come)
    end_written: int  # (ENDED) the response's end went out too, but for what `unsent` holds
    head: bytes | None  # (started at the head) the upstream's head, once the thread took it
    head_ns: int  # the time of the read that completed it

    kept: bool  # its connections were kept at its clean end (the native front, front.py)
    # A front's request: (request id, arrival, wall clock at arrival in ns, sent, model JSON,
    # endpoint 0/1, requests in flight at arrival); its bytes; its connection object once the
    # front went with it.
    front: tuple[bytes, int, int, int, bytes | None, int, int] | None
    front_request: bytes | None
    front_conn: Any

    def poll(self) -> tuple[bytes, int, int]: ...
    def clocks(self) -> tuple[int, int]: ...
    def stop(self) -> None: ...
    def urge(self) -> None: ...


class Owner(Protocol):
    def native_returned(self, stream: Stream) -> None: ...


# How long a stream that ended quietly waits at most for the event loop's own wake-up, in ms;
# None: the extension's (`QUIET_NS`, 20 ms). Tests lengthen it, to tell a wake-up asked for.
QUIET_MS: int | None = None


class NativeRelay:
    """The process's native thread, and the event loop's side of it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        relay = import_module("phasewatch.proxy._native").Relay
        self._relay = relay() if QUIET_MS is None else relay(quiet_ms=QUIET_MS)
        self._open = True
        # Faults that would recur per stream: each kind logged once a minute.
        self._start_faults, self._hand_back_faults = LogThrottle(), LogThrottle()
        self.after_batch: Any = None  # the front's restock, after each batch handed back
        self._front = False
        loop.add_reader(self._relay.fileno(), self._returned)

    def front_config(self, date: bool, rest: bytes, prefix: bytes, host: bytes, admin: bytes,
                     max_body: int) -> None:
        """The front (front.py) takes plain requests on kept connections from here on: the
        client head's server headers (`date` first if `date`, then `rest`), the upstream's base
        path and host header, the admin token's header (never forwarded), the body limit."""
        self._relay.front_config(date, rest, prefix, host, admin, max_body)
        self._front = True

    def stock(self, owner: Any, target: int) -> int:
        """Stream objects for the front's requests (owned by `owner` until Python looks at
        them) made up to `target` at the thread's hand; how many it has."""
        have: int = self._relay.stock(owner, target)
        return have

    def front_started(self) -> list[Stream]:
        """The front's streams held now that Python had not looked at."""
        streams: list[Stream] = self._relay.front_started()
        return streams

    def front_stop(self) -> None:
        self._relay.front_stop()

    def front_expire(self, before_ns: int) -> None:
        """The front's idle connections waiting for a request since before `before_ns` go
        back (`closed()`, at the thread's next turn)."""
        self._relay.front_expire(before_ns)

    @property
    def front_unseen(self) -> int:
        unseen: int = self._relay.front_unseen
        return unseen

    @property
    def in_flight(self) -> int:
        count: int = self._relay.in_flight
        return count

    @in_flight.setter
    def in_flight(self, count: int) -> None:
        self._relay.in_flight = count

    def start(self, up_fd: int, client_fd: int, strip_usage: bool, hold_terminal: bool,
              owner: Owner, head: tuple[bytes, bytes, bytes] | None = None,
              keep: Any = None) -> Stream | None:
        """Hand a stream to the thread, given its two sockets' descriptors (`plain_fd`): cut
        running usage (`strip_usage`), hold a terminal chunk (`hold_terminal`, as
        `StreamFeed` does when the closing usage chunk is cut). With `head` (the client head's
        prefix, its `x-request-id` line, its end) the thread takes the stream from the
        upstream's head on; else from a chunk boundary of the body. None when the thread could
        not take it, and the stream stays in Python."""
        if not self._open:
            return None
        try:
            stream: Stream = self._relay.start(up_fd, client_fd, strip_usage, hold_terminal,
                                               owner, head, keep)
        except (OSError, RuntimeError):
            self._start_faults.exception(
                log, "the native relay could not take a stream; it stays in Python",
                level=logging.WARNING)
            return None
        return stream

    def due(self, replay_before_ns: int, idle_before_ns: int,
            stall_before_ns: int) -> list[Any]:
        """The owners of the streams held now that a pass of the live registry must look at:
        not replayed since `replay_before_ns`, still without a first token, without a read since
        `idle_before_ns`, or whose client has not read since `stall_before_ns` (live.py)."""
        owners: list[Any] = self._relay.due(replay_before_ns, idle_before_ns, stall_before_ns)
        return owners

    def _returned(self) -> None:
        self._hand_back(self._relay.finished())

    def take_ended(self) -> None:
        """Take back the streams that ended with their response's end written: the thread
        tells of those on the event loop's next wake-up (this call) or within `QUIET_NS`."""
        self._hand_back(self._relay.ended())

    def _hand_back(self, streams: list[Stream]) -> None:
        for stream in streams:
            owner, stream.owner = stream.owner, None
            try:
                owner.native_returned(stream)
            except Exception:  # one exchange's fault must not strand the others
                self._hand_back_faults.exception(
                    log, "could not take a stream back from the native relay")
        if self._front:
            for owner, why, data, arrival_ns in self._relay.closed():
                try:
                    owner.give_back(data, arrival_ns, why == FRONT_BROKEN,
                                    why == FRONT_EXPIRED)
                except Exception:
                    self._hand_back_faults.exception(
                        log, "could not take a connection back from the native front")
            if self.after_batch is not None:
                self.after_batch()

    def close(self) -> None:
        """Stop the thread; a stream it still held goes back to its exchange first."""
        self._open = False
        self._loop.remove_reader(self._relay.fileno())
        self._relay.close()
        self._returned()


def native_relay(enabled: bool) -> NativeRelay | None:
    """The native relay for the running loop, or None: turned off, or not built here."""
    if not enabled:
        return None
    try:
        return NativeRelay(asyncio.get_running_loop())
    except ImportError:
        log.info("the native relay is not built in this install: streams are relayed in Python")
        return None


def replay(stream: Stream, timing: StreamTiming) -> tuple[int, int]:
    """Replay the events the thread logged since the last call into `timing`, as the Python
    path would have timed them; return (last read time, client blocked since) (0: none)."""
    events, last_read_ns, blocked_ns = stream.poll()
    if events:  # read in place, as int64s: no copy
        try:
            timing.exact_events(memoryview(events).cast("q"))
        except Exception:  # timing must never stop a stream from going on, or ending
            _REPLAY_FAULTS.exception(log, "could not replay a native stream's timing")
    return last_read_ns, blocked_ns


def plain_fd(transport: asyncio.BaseTransport) -> int | None:
    """The socket's descriptor of a plain TCP transport; None for TLS or anything else. Read
    once per connection (by its protocol): the lookups cost more than the handoff itself."""
    if transport.get_extra_info("sslcontext") is not None \
            or transport.get_extra_info("ssl_object") is not None:
        return None
    sock = transport.get_extra_info("socket")
    if sock is None:
        return None
    fd: int = sock.fileno()
    return fd if fd >= 0 else None
