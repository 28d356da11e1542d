"""The relay never waits for the database: slow or down, records queue, overflow is counted, and
writing resumes by itself. Shown against a locked SQLite file and a real Postgres stopped and
started under load (20 s down, nothing lost)."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from typing import Any

import httpx
import orjson
from prometheus_client import CollectorRegistry
from sqlalchemy import func, select

from phasewatch.core.db import create_engine
from phasewatch.core.settings import load_settings
from phasewatch.main import create_app
from phasewatch.store.migrate import upgrade
from phasewatch.store.models import RequestRow
from tests.conftest import Proxy
from tests.support.databases import PrivatePostgres
from tests.support.served import wait_for
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


OUTAGE_S = 20.0


def test_postgres_stopped_for_20_s_under_load_loses_nothing(
    scripted_url: str, private_postgres: PrivatePostgres
) -> None:
    """The default queue (10,000 records) outlasts a 20 s outage at this load: every stream
    succeeds during it, and once the database is back every record is stored, none dropped."""
    upgrade(private_postgres.url)
    settings = load_settings(upstream_url=scripted_url, database_url=private_postgres.url,
                             admin_open=True, writer_flush_interval_s=0.02)
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
        wait_for(lambda: proxy.sample("phasewatch_records_written_total") >= 10,
                 says="records stored before the outage")
        private_postgres.stop()  # the database goes away mid-load
        went_down, before = time.monotonic(), sent
        wait_for(lambda: proxy.sample("phasewatch_record_write_failures_total") >= 1,
                 says="the writer sees the outage")
        # The outage lasts OUTAGE_S (the scenario's length, not a synchronisation wait).
        wait_for(lambda: failures or time.monotonic() - went_down >= OUTAGE_S,
                 timeout=OUTAGE_S + 5, says="the outage's length")
        during_outage = sent - before
        assert proxy.sample("phasewatch_record_queue_depth") > 0  # held, waiting
        private_postgres.start()
        wait_for(lambda: failures or proxy.sample("phasewatch_record_queue_depth") < 5,
                 timeout=30, says="the queue drained once the database is back")
    finally:
        stop.set()
        client.join(timeout=15)
    assert not failures, f"a client stream failed during the outage: {failures[0]!r}"
    assert during_outage > 100, during_outage

    async def count() -> int:
        engine = create_engine(private_postgres.url)
        try:
            async with engine.connect() as connection:
                return int(await connection.scalar(select(func.count()).select_from(RequestRow))
                           or 0)
        finally:
            await engine.dispose()

    # The last stream's record is offered just after its last byte reached the client.
    wait_for(lambda: asyncio.run(count()) == sent, timeout=10, says=f"{sent} records stored")
    server.stop()
    assert proxy.sample("phasewatch_records_dropped_total") == 0
    assert proxy.sample("phasewatch_records_written_total") == sent


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
