"""The relay never waits for the database: slow or down, records queue, overflow is counted, and
writing resumes by itself. Shown against a locked SQLite file and a real Postgres stopped and
started under load."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from typing import Any

import httpx
import orjson

from app.core.settings import load_settings
from app.main import create_app
from app.store.migrate import upgrade
from tests.conftest import Proxy
from tests.support.databases import PrivatePostgres
from tests.support.servers import ThreadServer

SCRIPT = {"x-script": orjson.dumps({"tokens": [[0.01, "a", 1], [0.02, "b", 1]]}).decode()}


def relay_one(proxy: Proxy, client: httpx.Client | None = None) -> float:
    """One streamed request; returns its wall time, and checks the client got all of it."""
    started = time.monotonic()
    with (client or httpx).stream(
        "POST", proxy.url + "/v1/completions", headers=SCRIPT, timeout=10,
        json={"model": "scripted", "prompt": "x", "stream": True},
    ) as response:
        body = response.read()
    assert response.status_code == 200 and body.endswith(b"data: [DONE]\n\n")
    return time.monotonic() - started


def test_a_locked_database_never_slows_the_relay(make_proxy: Any, scripted_url: str,
                                                  sqlite_url: str) -> None:
    proxy = make_proxy(scripted_url, record_queue_size=5, writer_batch_size=1)
    relay_one(proxy)
    proxy.next_record()  # stored: the database works before it is locked
    path = sqlite_url.split(":///", 1)[1]
    lock = sqlite3.connect(path, timeout=1, isolation_level=None)
    lock.execute("BEGIN EXCLUSIVE")  # another process holds the file: every write waits
    try:
        times = [relay_one(proxy) for _ in range(12)]
        # The writer holds one record while it waits; 5 more queue; the other 6 are dropped.
        # (The last record is offered just after its stream's last byte: give it a moment.)
        deadline = time.monotonic() + 2
        while proxy.sample("phasewatch_records_dropped_total") < 6 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proxy.sample("phasewatch_records_dropped_total") == 6
        assert max(times) < 0.5  # the streams took their scripted ~20 ms, not the lock's time
        # Live while the writer hangs on the lock: the one it holds and the five queued.
        assert proxy.sample("phasewatch_record_queue_depth") == 6
    finally:
        lock.execute("ROLLBACK")
        lock.close()
    deadline = time.monotonic() + 15
    while len(proxy.stored()) < 7 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(proxy.stored()) == 7  # 1 before + 1 held + 5 queued: all written once unlocked
    while proxy.sample("phasewatch_record_queue_depth") and time.monotonic() < deadline:
        time.sleep(0.01)  # the writer lets go of its batch just after the commit
    assert proxy.sample("phasewatch_record_queue_depth") == 0


def test_postgres_stopped_and_restarted_under_load(scripted_url: str,
                                                    private_postgres: PrivatePostgres) -> None:
    upgrade(private_postgres.url)
    settings = load_settings(upstream_url=scripted_url, database_url=private_postgres.url,
                             admin_open=True,
                             record_queue_size=20, writer_flush_interval_s=0.02)
    from prometheus_client import CollectorRegistry
    registry = CollectorRegistry()
    server = ThreadServer(create_app(settings, registry=registry)).start()
    proxy = Proxy(server, registry)
    sent = 0
    stop = threading.Event()
    failures: list[BaseException] = []

    def load() -> None:  # a steady client: one stream after another, ~20-40 a second
        nonlocal sent
        with httpx.Client() as client:
            while not stop.is_set():
                try:
                    relay_one(proxy, client)
                    sent += 1
                except BaseException as exc:  # report any failure to the test
                    failures.append(exc)
                    return

    client = threading.Thread(target=load)
    client.start()
    try:
        time.sleep(1.0)
        private_postgres.stop()  # the database goes away mid-load
        time.sleep(3.0)
        during_outage = sent
        assert proxy.sample("phasewatch_record_write_failures_total") >= 1
        assert proxy.sample("phasewatch_records_dropped_total") > 0, (sent, failures)  # bound held
        private_postgres.start()
        time.sleep(3.0)  # the writer backs off at most 5 s; give it a turn
    finally:
        stop.set()
        client.join(timeout=15)
    assert not failures, f"a client stream failed during the outage: {failures[0]!r}"
    assert sent > during_outage > 0
    deadline = time.monotonic() + 10

    async def count() -> int:
        from sqlalchemy import func, select

        from app.core.db import create_engine
        from app.store.models import RequestRow
        engine = create_engine(private_postgres.url)
        try:
            async with engine.connect() as connection:
                return int(await connection.scalar(select(func.count()).select_from(RequestRow))
                           or 0)
        finally:
            await engine.dispose()

    stored = 0
    while time.monotonic() < deadline:
        # Read with the count: the last stream's record is offered (and maybe dropped) just
        # after its last byte reached the client, so a drop can follow `sent`.
        dropped = proxy.sample("phasewatch_records_dropped_total")
        stored = asyncio.run(count())
        if stored == sent - dropped:
            break
        time.sleep(0.2)
    server.stop()
    # Nothing accepted into the queue was lost: stored + dropped accounts for every request.
    assert stored == sent - dropped, (stored, sent, dropped)
    assert proxy.sample("phasewatch_records_written_total") == stored


def test_clean_shutdown_flushes_the_queue(scripted_url: str, sqlite_url: str) -> None:
    settings = load_settings(upstream_url=scripted_url, database_url=sqlite_url, admin_open=True,
                             writer_flush_interval_s=30, writer_batch_size=10_000)
    server = ThreadServer(create_app(settings)).start()
    proxy = Proxy(server, None)  # type: ignore[arg-type]
    for _ in range(8):
        relay_one(proxy)
    assert proxy.stored() == []  # still waiting for its 30 s batch window
    server.stop()
    rows = sqlite3.connect(sqlite_url.split(":///", 1)[1]).execute(
        "SELECT count(*) FROM requests").fetchone()
    assert rows == (8,)
