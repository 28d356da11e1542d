"""`phasewatch serve --workers 2`: two processes on one port behave as one proxy.

The command runs as a subprocess in front of the scripted upstream, on its own SQLite file and
metrics directory. Every request below goes on a new connection, after `/api/health` on that
same connection, so the test knows which worker relayed or answered it.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.support.served import (
    CHAT,
    Answer,
    OpenStream,
    ask,
    parse_metrics,
    script,
    total,
    wait_for,
)
from tests.support.servers import free_port, subprocess_server

WORKERS = 2
INTERVAL_S = 0.2  # the diagnosis schedule's, and the leader lock's check


@pytest.fixture
def served(scripted_url: str, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """The proxy's URL and its metrics directory, once both workers answer."""
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    (metrics_dir / "counter_1.db").write_bytes(b"an earlier run's file")  # must be emptied
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {
        "PHASEWATCH_DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path / 'phasewatch.db'}",
        "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir),
        "PHASEWATCH_DIAGNOSIS_INTERVAL_S": str(INTERVAL_S),
        "PHASEWATCH_LEADER_CHECK_INTERVAL_S": str(INTERVAL_S),
        "PHASEWATCH_ENGINE_METRICS_ENABLED": "false",
        "PHASEWATCH_WRITER_FLUSH_INTERVAL_S": "0.02",
        "PHASEWATCH_LOG_LEVEL": "warning",
        "PHASEWATCH_ADMIN_OPEN": "true",
        "PHASEWATCH_METRICS_CACHE_S": "0",
    }
    args = ["-m", "phasewatch.cli", "serve", "--workers", str(WORKERS), "--upstream", scripted_url,
            "--port", str(port)]
    with subprocess_server(args, url + "/api/health", env=env, timeout=60):
        roles(url)  # both workers answer
        yield url, metrics_dir


def roles(url: str) -> dict[int, str]:
    """Each worker's role, by pid, asking until every worker has answered."""
    found: dict[int, str] = {}

    def every_worker() -> bool:
        answer = ask(url, path="/api/health")
        found[answer.pid] = answer.role
        return len(found) == WORKERS

    wait_for(every_worker, timeout=60, says="every worker answers")
    return found


def relay_one(url: str) -> int:
    """One short stream, relayed in full; the pid of the worker that relayed it."""
    answer = ask(url, "POST", "/v1/chat/completions", json=CHAT,
                 headers=script((0.005, "a"), (0.01, "b")))
    assert answer.response.status_code == 200
    assert answer.response.text.endswith("data: [DONE]\n\n")
    return answer.pid


def scrape_each_worker(url: str, times: int) -> list[Answer]:
    """Scrapes until every worker has answered `times` of them."""
    answers: list[Answer] = []

    def enough() -> bool:
        answers.append(ask(url))
        pids = [answer.pid for answer in answers]
        return len(set(pids)) == WORKERS and all(pids.count(p) >= times for p in set(pids))

    wait_for(enough, timeout=60, says=f"every worker answers {times} scrapes")
    return answers


def test_two_workers_count_store_and_schedule_as_one(served: tuple[str, Path]) -> None:
    url, _ = served
    sent = 40
    with ThreadPoolExecutor(8) as pool:
        relayed_by = list(pool.map(lambda _: relay_one(url), range(sent)))
    assert len(set(relayed_by)) == WORKERS, "both workers relayed some of the requests"

    # Every scrape shows the sum over both workers, whichever of them answers it.
    wait_for(lambda: total(parse_metrics(ask(url).response.text), "phasewatch_requests_total")
             == sent, says="the counts reach the requests sent")
    for answer in scrape_each_worker(url, times=3):
        samples = parse_metrics(answer.response.text)  # a series twice would fail here
        assert total(samples, "phasewatch_requests_total", outcome="ok") == sent
        assert total(samples, "phasewatch_time_to_first_token_seconds_count") == sent
        assert total(samples, "phasewatch_e2e_request_latency_seconds_bucket", le="+Inf") == sent
        assert total(samples, "phasewatch_requests_in_flight") == 0
        assert total(samples, "phasewatch_leader") == 1  # one leader between the two
        assert not [series for series in samples if "pid" in dict(series[1])]

    # Each worker stored its own records: all of them, once.
    def stored() -> list[str]:
        items = httpx.get(url + "/api/requests", params={"limit": 1000}).json()["items"]
        return [item["request_id"] for item in items]

    wait_for(lambda: len(stored()) >= sent, says="every record stored")
    ids = stored()
    assert len(ids) == len(set(ids)) == sent

    # One schedule: ten rounds take at least nine intervals (two schedules would take half),
    # and each change of verdict is stored once. With no traffic before them, the requests
    # are judged on their own against the SLO: healthy (insufficient data first if a round
    # came before 20 of them were stored).
    def evaluations() -> float:
        return total(parse_metrics(ask(url).response.text),
                     "phasewatch_diagnosis_evaluations_total")

    wait_for(evaluations, says="the schedule judges the model")
    start, before = time.monotonic(), evaluations()
    wait_for(lambda: evaluations() >= before + 10, says="ten more rounds")
    assert time.monotonic() - start >= 9 * INTERVAL_S
    history = httpx.get(url + "/api/diagnosis/history", params={"model": "m"}).json()
    assert [item["verdict"] for item in history["items"]] in (
        ["healthy"], ["healthy", "insufficient_data"])
    for answer in scrape_each_worker(url, times=1):  # the verdict gauges, from the one leader
        samples = parse_metrics(answer.response.text)
        assert total(samples, "phasewatch_diagnosis_verdict", model="m") == 1
        assert total(samples, "phasewatch_diagnosis_verdict", model="m",
                     verdict="healthy") == 1
    assert sorted(roles(url).values()) == ["follower", "leader"]


def test_a_killed_worker_leaves_no_stale_series(served: tuple[str, Path]) -> None:
    url, metrics_dir = served
    done = [relay_one(url) for _ in range(6)]
    streams: list[OpenStream] = []
    try:
        # Streams held open on both workers.
        def both_hold_streams() -> bool:
            streams.append(OpenStream(url, last_token_at=60.0))
            return len({stream.pid for stream in streams}) == WORKERS

        wait_for(both_hold_streams, says="open streams on both workers")
        wait_for(lambda: total(parse_metrics(ask(url).response.text),
                               "phasewatch_requests_in_flight") == len(streams),
                 says="in-flight counts every open stream")
        leader = next(answer.pid for answer in scrape_each_worker(url, times=1)
                      if answer.role == "leader")
        survivors = [stream for stream in streams if stream.pid != leader]

        os.kill(leader, signal.SIGKILL)

        # Its in-flight requests stop counting, its live-gauge files go, its counts stay, and
        # a worker takes the lead (the survivor or the worker started in its place).
        def settled() -> dict[tuple[str, tuple[tuple[str, str], ...]], float] | None:
            samples = parse_metrics(ask(url).response.text)
            in_flight = total(samples, "phasewatch_requests_in_flight")
            if in_flight != len(survivors) or total(samples, "phasewatch_leader") != 1:
                return None
            return samples

        samples = wait_for(settled, says="the dead worker's series gone, a new leader")
        assert total(samples, "phasewatch_requests_total") == len(done)
        assert not list(metrics_dir.glob(f"gauge_live*_{leader}.db"))
        assert list(metrics_dir.glob(f"counter_{leader}.db"))  # its counts are kept
        # uvicorn's supervisor started a worker in its place.
        wait_for(lambda: ask(url, path="/api/health").pid not in {leader, survivors[0].pid},
                 timeout=60, says="a new worker answers")
    finally:
        for stream in streams:
            stream.close()
    wait_for(lambda: total(parse_metrics(ask(url).response.text),
                           "phasewatch_requests_in_flight") == 0,
             says="in-flight back to zero once the streams close")
