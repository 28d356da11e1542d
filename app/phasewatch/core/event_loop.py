"""Which event loop phasewatch runs on: uvloop where it is installed (it is by default on Linux
and macOS, through uvicorn[standard]), asyncio's own loop elsewhere (Windows, PyPy).

HTTP parsing needs no such choice: httptools is a dependency on every platform, because the relay's
upstream leg (app/phasewatch/proxy/upstream_pool.py) and its client leg
(app/phasewatch/proxy/client_leg.py) are built on it.
"""

from __future__ import annotations

import asyncio
import os
import select
from importlib.util import find_spec
from typing import Literal

LoopName = Literal["uvloop", "asyncio"]


def loop_name() -> LoopName:
    """uvicorn's `loop` setting: uvloop when importable, else asyncio."""
    return "uvloop" if find_spec("uvloop") is not None else "asyncio"


def new_event_loop() -> asyncio.AbstractEventLoop:
    if loop_name() == "uvloop":
        import uvloop

        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


class PollSet:
    """The running loop's kernel poll set, for taking a paused socket out of it at once.

    libuv (under uvloop) takes a socket whose reading stopped out of its epoll set only when
    the next event comes for it: a paused transport whose peer then writes wakes the loop for
    nothing but that removal (the relay pauses the upstream's transport for each stream it
    hands to the native leg). `forget` removes it when reading stops. libuv adds it again when
    reading resumes, as after its own removal. Only while the transport has no write pending:
    libuv then still watches the socket for writing, and expects it in the set. On asyncio's
    own loop (no `_get_backend_id`) there is nothing to do: it removes the socket at once."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        backend = getattr(loop, "_get_backend_id", None)  # uvloop: libuv's epoll descriptor
        self._epoll: select.epoll | None = None
        if backend is not None and hasattr(select, "epoll"):
            # Our own descriptor of the loop's epoll instance (closing it leaves the loop's).
            self._epoll = select.epoll.fromfd(os.dup(backend()))

    def forget(self, transport: asyncio.Transport, fd: int) -> None:
        """`transport` (socket `fd`) has stopped reading: out of the set now."""
        epoll = self._epoll
        if epoll is None or transport.is_reading() or transport.get_write_buffer_size():
            return
        try:
            epoll.unregister(fd)
        except OSError:  # not in the set: never added, or already taken out
            pass

    def close(self) -> None:
        if self._epoll is not None:
            self._epoll.close()
