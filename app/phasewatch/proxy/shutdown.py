"""Shutting down in bounded time without losing a stream's ending or a record.

Where the process is, is one value (`Stage`):
- serving;
- draining: the first SIGTERM or SIGINT (or uvicorn starting its shutdown) came. Readiness
  fails at once, uvicorn stops accepting connections, and open streams may run to their end
  for up to the grace (`PHASEWATCH_SHUTDOWN_GRACE_S`);
- ending: the grace is over, or a second signal came. Every open exchange ends now: a stream
  gets an in-band error event and `[DONE]`, a request still waiting for its answer a 503,
  and each is recorded with the outcome `shutdown`; closing their upstream connections makes
  the engine abort them.
uvicorn then closes the connections and runs the app's lifespan shutdown, which stores every
queued record before the process exits. A second signal never skips that (uvicorn alone
would exit at once on a second SIGINT, without flushing, and ignore a second SIGTERM).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import Callable
from enum import Enum
from types import FrameType
from typing import Any

from phasewatch.proxy.live import LiveStreams

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Stage(Enum):
    SERVING = "serving"
    DRAINING = "draining"
    ENDING = "ending"


class Shutdown:
    def __init__(self, live: LiveStreams, grace_s: float) -> None:
        self.live = live
        self.grace_s = grace_s
        self.stage = Stage.SERVING
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._previous: dict[int, Any] = {}

    def begin(self) -> None:
        """Start draining (idempotent): the grace starts now."""
        if self.stage is not Stage.SERVING:
            return
        self.stage = Stage.DRAINING
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self.grace_s, self.end_streams)
        log.info("shutting down: %d open stream(s) have %.0f s to end", len(self.live),
                 self.grace_s)

    def end_streams(self) -> None:
        """End every open exchange now (idempotent)."""
        if self.stage is Stage.ENDING:
            return
        self.stage = Stage.ENDING
        if self._timer is not None:
            self._timer.cancel()
        ended = self.live.end_all()
        if ended:
            log.warning("shutting down: ended %d open exchange(s) with an error (outcome "
                        "`shutdown`)", ended)

    # -- signals ------------------------------------------------------------------------------

    def install(self) -> None:
        """Hear SIGTERM and SIGINT before uvicorn does (only where signals can be handled: the
        main thread). The first is passed on to uvicorn's handler, which starts its graceful
        shutdown; a later one ends the streams at once and is not passed on."""
        if threading.current_thread() is not threading.main_thread():
            return
        self._loop = asyncio.get_running_loop()
        for sig in SIGNALS:
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._on_signal)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        first = self.stage is Stage.SERVING
        loop = self._loop
        if loop is not None:
            loop.call_soon_threadsafe(self.begin if first else self.end_streams)
        previous = self._previous.get(sig)
        if first and callable(previous):
            handler: Callable[[int, FrameType | None], Any] = previous
            handler(sig, frame)
