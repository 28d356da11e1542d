"""The native leg: the middle and tail of a stream relayed below Python, and how it comes back.

A streamed request whose tokens are counted exactly (timing.py) spends nearly all its reads as
running token chunks. Once Python's reading of it stands at a chunk boundary with nothing held
(relay.py `_offer_native`), both its sockets go to the thread of the `_native` extension
(csrc/relay.c), which relays and stamps those chunks with no Python per read, and the tail
too: the terminal chunk, the usage chunk, `[DONE]`, the body's end, and the response's end.

Invariants:
- One owner per socket (csrc/relay.h): from `start` until the stream comes back, the thread
  alone reads the upstream and writes the client; the event loop has both paused and out of
  its poll set (client_leg.py `lend`, upstream_pool.py `pause_reading`).
- Every byte the client gets and every figure are the Python path's: the thread takes only
  what it reads plainly (csrc/scan.c, the same `pw_token_event` the Python path uses), and
  hands the stream back at the first byte it does not; the (read time, completion tokens,
  prompt tokens) it logs are replayed into the stream's `StreamTiming` (`replay`) when it
  comes back, on a pass of the live registry (`due`: at least every `REPLAY_S`, every pass
  until its first token), and before each render of `/metrics` and each live snapshot.
- Every stream comes back with a wake-up of the event loop, as soon as the thread's batch of
  events is done: until the loop takes it back, no one reads its client's socket, so a request
  the client sends after the response's end would wait, unseen by its TTFT.
- The thread's streams hold no Python object; their owners (the exchanges) are kept here.
- If the thread fails, every stream it held comes back (`Ending.FAULT`): what it had read goes
  out, then an in-band error and `[DONE]` end the stream (recorded `internal_error`), since the
  state it left the stream in is not vouched for. The failure is logged, counted
  (`phasewatch_native_relay_failures_total`) and shown by `/api/health`, and no stream goes to
  the thread again.

Used under phasewatch's own server, on plain TCP on both sides (TLS stays in Python), on Linux;
`PHASEWATCH_NATIVE_RELAY=false` turns it off.
"""

from __future__ import annotations

import asyncio
import logging
from enum import IntEnum
from typing import TYPE_CHECKING, Any, Protocol

from phasewatch.core.log_throttle import LogThrottle
from phasewatch.proxy import _native
from phasewatch.proxy._native import Stream

if TYPE_CHECKING:
    from phasewatch.proxy.timing import StreamTiming

log = logging.getLogger(__name__)
# A replay that keeps failing would be logged on every pass over the open streams.
_REPLAY_FAULTS = LogThrottle()


class Ending(IntEnum):
    """Why the thread handed a stream back (csrc/relay.h `PW_END_*`)."""

    HANDOVER = 1  # a chunk it does not take plainly: Python goes on from it
    ASKED = 2  # the relay asked (`stop()`), or the native relay is closing
    UPSTREAM_EOF = 3  # the upstream closed its side
    UPSTREAM_ERROR = 4  # reading the upstream failed (`errno`)
    CLIENT_ERROR = 5  # the client hung up, or writing to it failed: it is gone
    ENDED = 6  # the body ended cleanly after [DONE], and the response's end was written
    FAULT = 7  # the thread failed (`errno`): Python ends the stream with an in-band error


class Owner(Protocol):
    def native_returned(self, stream: Stream) -> None: ...


class NativeRelay:
    """The process's native thread, and the event loop's side of it."""

    def __init__(self, loop: asyncio.AbstractEventLoop,
                 on_failure: Any = None) -> None:
        self._loop = loop
        self._relay = _native.Relay()
        self._owners: dict[Stream, Owner] = {}
        self._open = True
        self._failed = False
        self._on_failure = on_failure  # called once if the thread fails
        # Faults that would recur per stream: each kind logged once a minute.
        self._start_faults, self._hand_back_faults = LogThrottle(), LogThrottle()
        loop.add_reader(self._relay.fileno(), self.take_back)

    @property
    def holding(self) -> int:
        """Streams the thread holds now."""
        return len(self._owners)

    def start(self, up_fd: int, client_fd: int, strip_usage: bool, hold_terminal: bool,
              pending: bool, owner: Owner) -> Stream | None:
        """Hand a stream to the thread from a chunk boundary of its body, given its two sockets'
        descriptors (`plain_fd`): cut running usage (`strip_usage`), hold a terminal chunk
        (`hold_terminal`, as `StreamFeed` does when the closing usage chunk is cut), no token
        yet (`pending`). None when the thread could not take it: the stream stays in Python."""
        if not self._open:
            return None
        try:
            stream = self._relay.start(up_fd, client_fd, strip_usage, hold_terminal, pending)
        except OSError:
            self._start_faults.exception(
                log, "the native relay could not take a stream; it stays in Python",
                level=logging.WARNING)
            return None
        self._owners[stream] = owner
        return stream

    def due(self, replay_before_ns: int, idle_before_ns: int,
            stall_before_ns: int) -> list[Any]:
        """The owners of the held streams a pass of the live registry must look at (live.py):
        not replayed since `replay_before_ns`, still without a first token, without a read
        since `idle_before_ns`, or whose client has not read since `stall_before_ns`. (The
        owners are the live registry's exchanges: typed there, as `Watched`.)"""
        streams = self._relay.due(replay_before_ns, idle_before_ns,
                                                stall_before_ns)
        owners = self._owners
        return [owners[s] for s in streams if s in owners]

    @property
    def failed(self) -> bool:
        """Whether the thread failed: every stream is relayed in Python since."""
        return self._failed

    def take_back(self) -> None:
        """Take back every stream the thread has handed back (its wake-up's callback)."""
        streams = self._relay.finished()
        # (read after `finished`: the thread sets it before it hands its streams back)
        if self._relay.failed and not self._failed:
            self._failed, self._open = True, False  # before the hand-back: none goes back to it
            log.error("the native relay's thread failed (errno %d): every stream it held ended "
                      "with an in-band error, and every stream is relayed in Python from now "
                      "on", self._relay.failed)
            if self._on_failure is not None:
                self._on_failure()
        self._hand_back(streams)

    def _hand_back(self, streams: list[Stream]) -> None:
        owners = self._owners
        for stream in streams:
            owner = owners.pop(stream, None)
            if owner is None:
                continue
            try:
                owner.native_returned(stream)
            except Exception:  # one exchange's fault must not strand the others
                self._hand_back_faults.exception(
                    log, "could not take a stream back from the native relay")

    def close(self) -> None:
        """Stop the thread; every stream it still held goes back to its exchange first."""
        self._open = False
        self._loop.remove_reader(self._relay.fileno())
        self._relay.close()
        self._hand_back(self._relay.finished())


def native_relay(enabled: bool, on_failure: Any = None) -> NativeRelay | None:
    """The native relay for the running loop, or None: turned off, or not on Linux."""
    if not enabled:
        return None
    if not hasattr(_native, "Relay"):
        log.info("the native relay needs Linux: streams are relayed in Python")
        return None
    return NativeRelay(asyncio.get_running_loop(), on_failure)


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
