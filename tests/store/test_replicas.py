"""Two `phasewatch serve` replicas on one Postgres, as a Deployment of two behind a Service runs:
retention, the engine scrape and the diagnosis schedule run in one of them (the advisory lock),
each stores every record it relays, both answer `/api/diagnosis` the same, and the other takes
over when the leader is killed.

The replicas are subprocesses in front of the scripted upstream; the simulator, in this process,
serves the engine metrics they scrape. A calm baseline and a slow window for model "m" are
written straight into the database, so the verdict is known (queueing).
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from contextlib import ExitStack
from datetime import UTC, datetime, timedelta

import httpx
from sqlalchemy import select

from phasewatch.core.db import create_engine
from phasewatch.sim.config import load_sim_settings
from phasewatch.sim.server import running_sim
from phasewatch.store.migrate import upgrade
from phasewatch.store.models import Diagnosis, EngineScrape
from tests.diagnosis.test_api import insert, rows, z
from tests.support.databases import postgres_database
from tests.support.served import parse_metrics, script, total, wait_for
from tests.support.servers import free_port, subprocess_server

INTERVAL_S = 0.2  # the schedule's and the leader lock's check
# The engine is scraped before each scheduled round; its own interval is out of the test's way.
SCRAPE_INTERVAL_S = 600.0


async def _read(url: str) -> tuple[list[datetime], list[str]]:
    engine = create_engine(url)
    try:
        async with engine.connect() as connection:
            scrapes = list((await connection.scalars(
                select(EngineScrape.at).where(EngineScrape.snapshot.is_not(None))
                .order_by(EngineScrape.at))).all())
            verdicts = list((await connection.scalars(
                select(Diagnosis.verdict).where(Diagnosis.model == "m")
                .order_by(Diagnosis.id))).all())
            return scrapes, verdicts
    finally:
        await engine.dispose()


def relay(url: str, model: str) -> None:
    response = httpx.post(url + "/v1/chat/completions", timeout=30, json={
        "model": model, "messages": [{"role": "user", "content": "hi"}], "stream": True,
    }, headers={**script((0.005, "a"), (0.01, "b")), "x-phasewatch-run-id": "replicas"})
    assert response.status_code == 200 and response.text.endswith("data: [DONE]\n\n")


def health(url: str) -> dict[str, str]:
    return dict(httpx.get(url + "/api/health", timeout=10).json())


def test_two_replicas_share_one_schedule_store_everything_and_answer_alike(
    scripted_url: str,
) -> None:
    with ExitStack() as stack:
        database = stack.enter_context(postgres_database(f"pw_{uuid.uuid4().hex[:12]}"))
        sim = stack.enter_context(running_sim(load_sim_settings(port=0, log_level="warning")))
        upgrade(database)
        now = datetime.now(UTC)
        insert(database, [*rows("m", now - timedelta(minutes=8), 300, 80, seed=5),
                          *rows("m", now - timedelta(seconds=40), 35, 80, ttft=0.4, seed=6)])
        env = {
            "PHASEWATCH_DATABASE_URL": database,
            "PHASEWATCH_ENGINE_METRICS_URL": sim.url + "/metrics",
            "PHASEWATCH_ENGINE_SCRAPE_INTERVAL_S": str(SCRAPE_INTERVAL_S),
            "PHASEWATCH_DIAGNOSIS_INTERVAL_S": str(INTERVAL_S),
            "PHASEWATCH_LEADER_CHECK_INTERVAL_S": str(INTERVAL_S),
            "PHASEWATCH_DIAGNOSIS_WINDOW_S": "60",
            "PHASEWATCH_DIAGNOSIS_BASELINE_S": "600",
            "PHASEWATCH_WRITER_FLUSH_INTERVAL_S": "0.02",
            "PHASEWATCH_LOG_LEVEL": "warning",
            "PHASEWATCH_ADMIN_OPEN": "true",
            "PHASEWATCH_METRICS_CACHE_S": "0",
        }
        replicas = {}
        for _ in range(2):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            args = ["-m", "phasewatch.cli", "serve", "--upstream", scripted_url,
                    "--port", str(port)]
            replicas[url] = stack.enter_context(
                subprocess_server(args, url + "/api/health", env=env, timeout=60))
        urls = list(replicas)

        # Each replica stores what it relays: every record, once.
        sent = 20
        for i in range(sent):
            relay(urls[i % 2], "r")

        def stored() -> list[str]:
            items = httpx.get(urls[0] + "/api/requests",
                              params={"run_id": "replicas", "limit": 1000}).json()["items"]
            return [item["request_id"] for item in items]

        wait_for(lambda: len(stored()) >= sent, says="every record stored")
        assert len(set(stored())) == len(stored()) == sent

        # One leader between them, by their own word and by their metrics.
        assert sorted(health(url)["role"] for url in urls) == ["follower", "leader"]
        leader = next(url for url in urls if health(url)["role"] == "leader")
        follower = next(url for url in urls if url != leader)
        assert sum(total(parse_metrics(httpx.get(url + "/metrics").text), "phasewatch_leader")
                   for url in urls) == 1

        # One engine scraper, asked by one schedule before each round: every stored scrape at
        # least a round's interval after the one before (two leaders would interleave theirs).
        # One schedule: the verdict stored once.
        def scraped_and_judged() -> tuple[list[datetime], list[str]] | None:
            scrapes, verdicts = asyncio.run(_read(database))
            return (scrapes, verdicts) if len(scrapes) >= 8 and verdicts else None

        scrapes, verdicts = wait_for(scraped_and_judged, says="scrapes and a verdict stored")
        gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(scrapes)]
        assert min(gaps) >= INTERVAL_S, gaps
        # The rows say TTFT rose 7x; the engine (the simulator, idle) has nothing waiting, so
        # once its scrapes are in the window the wait is not called queueing. Each stored
        # row is a change: a second schedule would store each verdict again.
        wait_for(lambda: asyncio.run(_read(database))[1][-1] == "unexplained",
                 says="the engine's empty queue read")
        verdicts = asyncio.run(_read(database))[1]
        assert all(a != b for a, b in itertools.pairwise(verdicts)), verdicts

        # The default question is the schedule's, answered alike by leader and follower.
        defaults = [httpx.get(url + "/api/diagnosis", params={"model": "m"}, timeout=30).json()
                    for url in urls]
        assert [d["source"] for d in defaults] == ["schedule", "schedule"]
        assert [d["verdict"] for d in defaults] == ["unexplained", "unexplained"]

        # The same question gets the same answer from either replica.
        until = z(datetime.now(UTC))
        for params in ({"model": "m", "window": "1m", "until": until},
                       {"window": "1m", "until": until}):
            answers = [httpx.get(url + "/api/diagnosis", params=params, timeout=30).json()
                       for url in urls]
            assert answers[0] == answers[1]
        one = httpx.get(follower + "/api/diagnosis", timeout=30,
                        params={"model": "m", "window": "1m", "until": until}).json()
        assert one["verdict"] == "unexplained"
        assert one["evidence"]["checks"]["engine_queue_empty"] is True
        assert one["engine_metrics"]["up"] is True and one["evidence"]["engine"]["scrapes"] >= 2

        # The leader dies; the other replica takes over.
        replicas[leader].kill()
        wait_for(lambda: health(follower)["role"] == "leader", says="the follower takes over")
        scraped = len(asyncio.run(_read(database))[0])
        wait_for(lambda: len(asyncio.run(_read(database))[0]) > scraped,
                 says="the new leader scrapes")
