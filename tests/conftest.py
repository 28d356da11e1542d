"""Fixtures shared by all tests: real servers on loopback, real databases."""

from __future__ import annotations

import asyncio
import gc
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from phasewatch.core.settings import load_settings
from phasewatch.main import create_app
from phasewatch.proxy.exchange_state import IllegalTransition
from tests.support.databases import PrivatePostgres, postgres_database
from tests.support.servers import ThreadServer, free_port, subprocess_server

# Threads in the test process hand the GIL over every 5 ms by default; that jitter would show
# up in the latencies the tests compare.
sys.setswitchinterval(0.0005)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Everything imported to collect the suite lives as long as the process: move it out of
    the cyclic collector's reach, as `phasewatch serve` does with its heap (app/phasewatch/main.py,
    `freeze_heap`). A full collection of that heap takes ~100 ms on this machine; struck in
    the middle of a timed test (the client and the proxy share this process), it showed as
    tens of ms of client-only TTFT."""
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def no_illegal_transition(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """An exchange's state machine refusing an event (app/phasewatch/proxy/exchange_state.py) is a
    bug, raised in a callback of a proxy's event loop and logged there: any test it happened in
    fails, whatever it asserted."""
    yield
    refused = [r for r in caplog.records
               if r.exc_info and isinstance(r.exc_info[1], IllegalTransition)]
    assert not refused, refused[0].getMessage()


class Proxy:
    """A phasewatch proxy under uvicorn in a thread, with its registry and stored records."""

    def __init__(self, server: ThreadServer, registry: CollectorRegistry) -> None:
        self.server = server
        self.registry = registry
        self.url = server.url
        self._seen: set[int] = set()

    def stored(self, **filters: Any) -> list[dict[str, Any]]:
        """Stored request records, oldest first (through the proxy's own API)."""
        response = httpx.get(self.url + "/api/requests", params={"limit": 1000, **filters})
        response.raise_for_status()
        return list(reversed(response.json()["items"]))

    def next_record(self, timeout: float = 10.0) -> SimpleNamespace:
        """The oldest stored record not returned before, waiting for the writer to store it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for row in self.stored():
                if row["id"] not in self._seen:
                    self._seen.add(row["id"])
                    return SimpleNamespace(**row)
            time.sleep(0.02)
        raise AssertionError(f"no new record stored within {timeout} s")

    def sample(self, name: str, labels: dict[str, str] | None = None) -> float:
        return self.registry.get_sample_value(name, labels or {}) or 0.0


@pytest.fixture(scope="session")
def scripted_url() -> Iterator[str]:
    port = free_port()
    # A proxy's pool may still hold a kept-alive connection when the session ends: uvicorn
    # would wait for it to close.
    args = ["-m", "uvicorn", "tests.support.scripted_upstream:app", "--port", str(port),
            "--log-level", "critical", "--loop", "uvloop", "--http", "httptools",
            "--timeout-graceful-shutdown", "1"]
    with subprocess_server(args, f"http://127.0.0.1:{port}/health"):
        yield f"http://127.0.0.1:{port}"


@pytest.fixture
def private_postgres() -> Iterator[PrivatePostgres]:
    """A PostgreSQL server of the test's own, which it may stop and start."""
    pg = PrivatePostgres()
    pg.start()
    try:
        yield pg
    finally:
        pg.remove()


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite+aiosqlite:///{tmp_path / 'phasewatch.db'}"


@pytest.fixture(params=["sqlite", "postgres"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An empty database of each kind: an SQLite file, and a fresh Postgres database."""
    if request.param == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path / 'phasewatch.db'}"
    else:
        with postgres_database(f"pw_{uuid.uuid4().hex[:12]}") as url:
            yield url


@pytest.fixture
def make_proxy(sqlite_url: str, tmp_path: Path) -> Iterator[Callable[..., Proxy]]:
    """Proxies under uvicorn in threads, each with a database of its own unless given one (the
    first `sqlite_url`, the others SQLite files beside it): two proxies compared must not read
    each other's records."""
    started: list[ThreadServer] = []

    def make(upstream: str, http: Any = None,
             loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None,
             **overrides: Any) -> Proxy:
        """`http`: uvicorn's protocol to serve with; default phasewatch's (as `serve` runs).
        `loop_factory`: the event loop (default asyncio's; `serve` runs uvloop's)."""
        registry = CollectorRegistry()
        # The admin API opened, as on a trusted network: tests of other things read records
        # through it (tests/faults/test_admin_access.py tests the closed default). /metrics rendered
        # afresh for each scrape: tests read it right after acting (tests/proxy/test_metrics.py
        # tests the cache).
        own_db = (f"sqlite+aiosqlite:///{tmp_path / f'phasewatch-{len(started)}.db'}"
                  if started else sqlite_url)
        overrides = {"database_url": own_db, "writer_flush_interval_s": 0.02,
                     "admin_open": True, "metrics_cache_s": 0, **overrides}
        settings = load_settings(upstream_url=upstream, **overrides)
        server = ThreadServer(create_app(settings, registry=registry), http=http,
                              loop_factory=loop_factory).start()
        started.append(server)
        return Proxy(server, registry)

    yield make
    for server in started:
        server.stop()


@pytest.fixture
def proxy(make_proxy: Callable[..., Proxy], scripted_url: str) -> Proxy:
    return make_proxy(scripted_url)
