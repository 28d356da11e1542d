"""Which event loop phasewatch runs on: uvloop where it is installed (it is by default on Linux
and macOS, through uvicorn[standard]), asyncio's own loop elsewhere (Windows, PyPy).

HTTP parsing needs no such choice: httptools is a dependency on every platform, because the
relay's upstream leg (app/proxy/upstream_pool.py) and its client leg (app/proxy/client_leg.py)
are built on it.
"""

from __future__ import annotations

import asyncio
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
