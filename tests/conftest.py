"""Fixtures shared by all tests: real servers on loopback."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from app.core.settings import load_settings
from app.main import create_app
from app.proxy.records import RequestRecord
from tests.support.servers import ThreadServer, free_port, subprocess_server

# Threads in the test process hand the GIL over every 5 ms by default; that jitter would show
# up in the latencies the tests compare. Servers whose timing is asserted use subprocesses.
sys.setswitchinterval(0.0005)


class Proxy:
    """A phasewatch proxy under uvicorn in a thread, with its registry and records at hand."""

    def __init__(self, server: ThreadServer, registry: CollectorRegistry) -> None:
        self.server = server
        self.registry = registry
        self.url = server.url

    def next_record(self, timeout: float = 10.0) -> RequestRecord:
        async def get() -> RequestRecord:
            queue = self.server.app.state.proxy.records
            return await __import__("asyncio").wait_for(queue.get(), timeout)

        return self.server.call(get(), timeout=timeout + 1)

    def pending_records(self) -> int:
        async def size() -> int:
            return int(self.server.app.state.proxy.records.qsize())

        return self.server.call(size())

    def sample(self, name: str, labels: dict[str, str] | None = None) -> float:
        return self.registry.get_sample_value(name, labels or {}) or 0.0


@pytest.fixture(scope="session")
def scripted_url() -> Iterator[str]:
    port = free_port()
    args = ["-m", "uvicorn", "tests.support.scripted_upstream:app", "--port", str(port),
            "--log-level", "critical", "--loop", "uvloop", "--http", "httptools"]
    with subprocess_server(args, f"http://127.0.0.1:{port}/health"):
        yield f"http://127.0.0.1:{port}"


@pytest.fixture
def make_proxy() -> Iterator[Callable[..., Proxy]]:
    started: list[ThreadServer] = []

    def make(upstream: str, **overrides: Any) -> Proxy:
        registry = CollectorRegistry()
        settings = load_settings(upstream_url=upstream, **overrides)
        server = ThreadServer(create_app(settings, registry=registry)).start()
        started.append(server)
        return Proxy(server, registry)

    yield make
    for server in started:
        server.stop()


@pytest.fixture
def proxy(make_proxy: Callable[..., Proxy], scripted_url: str) -> Proxy:
    return make_proxy(scripted_url)
