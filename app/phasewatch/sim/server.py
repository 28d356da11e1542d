"""Run the simulator: blocking for the CLI, or in a background thread for tests and demos.

Both use uvicorn with httptools, on uvloop where it is installed
(app/phasewatch/core/event_loop.py).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI

from phasewatch.core.event_loop import loop_name, new_event_loop
from phasewatch.sim.app import SimState, create_sim_app, startup_line
from phasewatch.sim.config import SimSettings, resolve

T = TypeVar("T")


def uvicorn_config(app: FastAPI, host: str, port: int, log_level: str) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        loop=loop_name(),
        http="httptools",
        lifespan="on",
        log_level=log_level,
        access_log=False,
        timeout_graceful_shutdown=5,
    )


def run_sim(settings: SimSettings) -> None:
    """Serve until interrupted. Raises SimConfigError before binding if the settings are bad."""
    app = create_sim_app(settings)
    print(startup_line(resolve(settings)), flush=True)
    uvicorn.Server(uvicorn_config(app, settings.host, settings.port, settings.log_level)).run()


class RunningSim:
    """A simulator serving on loopback from a background thread with its own event loop."""

    def __init__(self, settings: SimSettings) -> None:
        self.app = create_sim_app(settings)
        self._config = uvicorn_config(self.app, settings.host, settings.port, "warning")
        self._server = uvicorn.Server(self._config)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="phasewatch-sim", daemon=True)
        self.url = ""

    def _run(self) -> None:
        self._loop = new_event_loop()
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._server.serve())

    def start(self, timeout: float = 15.0) -> RunningSim:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the simulator did not start")
            time.sleep(0.01)
        port = self._server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://{self._config.host}:{port}"
        return self

    @property
    def state(self) -> SimState:
        state: SimState = self.app.state.sim
        return state

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 10.0) -> T:
        """Run a coroutine on the simulator's loop (to read engine state safely)."""
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=15)


@contextmanager
def running_sim(settings: SimSettings) -> Iterator[RunningSim]:
    """Serve the simulator for the duration of a `with` block (port 0 picks a free port)."""
    sim = RunningSim(settings).start()
    try:
        yield sim
    finally:
        sim.stop()
