"""Start real servers on free loopback ports for tests: in a thread, or as a subprocess.

A thread is cheapest and lets a test reach the app's state; a subprocess keeps the server's
event loop off the test's GIL, which matters where a test compares timings to milliseconds.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Coroutine, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, TypeVar

import httpx
import uvicorn

from phasewatch.proxy.client_leg import PhasewatchHttpProtocol

T = TypeVar("T")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ThreadServer:
    """A uvicorn server running an ASGI app in a background thread with its own event loop."""

    def __init__(self, app: Any, port: int | None = None, http: Any = None,
                 loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None) -> None:
        """`loop_factory`: the event loop to serve on (default asyncio's own; `serve` runs on
        uvloop's where it is installed, `uvloop.new_event_loop`)."""
        self.app = app
        self._loop_factory = loop_factory or asyncio.new_event_loop
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on",
            # phasewatch's own protocol, as `phasewatch serve` runs it, unless a test says.
            loop="asyncio", http=http or PhasewatchHttpProtocol, timeout_graceful_shutdown=5,
        )
        self.server = uvicorn.Server(config)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        self.loop = self._loop_factory()
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self.server.serve())

    def start(self) -> ThreadServer:
        self.thread.start()
        deadline = time.monotonic() + 15
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"server on port {self.port} did not start")
            time.sleep(0.01)
        return self

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 10) -> T:
        """Run a coroutine on the server's own loop (to read app state safely)."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


@contextmanager
def thread_server(app: Any) -> Iterator[ThreadServer]:
    server = ThreadServer(app).start()
    try:
        yield server
    finally:
        server.stop()


def wait_http(url: str, timeout: float = 30.0, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Poll `url` until it answers 200, or fail saying how the server died."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before {url} answered")
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{url} did not answer within {timeout} s")


@contextmanager
def subprocess_server(
    args: Sequence[str], health_url: str, env: dict[str, str] | None = None, timeout: float = 30.0,
    python: str = sys.executable, cwd: Path | None = None,
) -> Iterator[subprocess.Popen[bytes]]:
    """Run `python args...` in a subprocess until `health_url` answers; stop it afterwards
    with SIGTERM, as an orchestrator would. One that has not exited 10 s later is killed with
    every process it started (its own process group: `phasewatch serve --workers N`'s
    workers too), so none outlives the test to load the ones after it; and a warning says so."""
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.Popen([python, *args], env=full_env, cwd=cwd, start_new_session=True)
    try:
        wait_http(health_url, timeout=timeout, proc=proc)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            warnings.warn(f"{' '.join(args)} did not exit within 10 s of SIGTERM: killed",
                          stacklevel=1)
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
