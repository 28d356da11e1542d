"""The diagnosis through the proxy: `/api/diagnosis` and its baselines, the schedule's gauges and
history, the engine scraper, and faults that must not reach a client's stream.

Stored requests are written straight into the proxy's database (real SQLite or Postgres), so
the figures are known exactly and no test waits for wall-clock minutes.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client import CollectorRegistry

from phasewatch.core.db import create_engine, create_sessionmaker
from phasewatch.core.settings import load_settings
from phasewatch.main import create_app
from phasewatch.sim.config import load_sim_settings
from phasewatch.sim.server import running_sim
from phasewatch.store.diagnoses import read_observations
from phasewatch.store.migrate import upgrade
from phasewatch.store.models import RequestRow
from tests.conftest import Proxy
from tests.support.databases import PrivatePostgres
from tests.support.served import wait_for
from tests.support.servers import ThreadServer, free_port

QUIET = {"diagnosis_interval_s": 0, "engine_metrics_enabled": False}


def rows(model: str, start: datetime, seconds: float, n: int, *, ttft: float = 0.06,
         itl: float = 0.01, run_id: str | None = None, seed: int = 0) -> list[RequestRow]:
    """n requests spread over `seconds` from `start`, TTFT and ITL with a little noise."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        t = ttft * rng.lognormvariate(0, 0.05)
        gap = itl * rng.lognormvariate(0, 0.02)
        out.append(RequestRow(
            request_id=f"{model}-{seed}-{i}", started_at=start + timedelta(seconds=seconds * i / n),
            endpoint="completions", model=model, upstream="test", stream=True, outcome="ok",
            http_status=200, in_flight_at_arrival=rng.randint(0, 3), ttft_s=t,
            e2e_s=t + 31 * gap, tpot_s=gap, itl_count=31, itl_mean_s=gap, itl_p50_s=gap,
            itl_p95_s=gap * 1.2, itl_max_s=gap * 1.5, prompt_tokens=rng.randint(100, 400),
            output_tokens=32, tokens_exact=True, run_id=run_id, error=None,
        ))
    return out


def insert(url: str, batch: list[RequestRow]) -> None:
    async def write() -> None:
        engine = create_engine(url)
        try:
            async with create_sessionmaker(engine)() as session:
                session.add_all(batch)
                await session.commit()
        finally:
            await engine.dispose()

    asyncio.run(write())


def z(moment: datetime) -> str:
    return moment.isoformat().replace("+00:00", "Z")


NOW = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=30)
BASE_RANGE = (NOW - timedelta(minutes=20), NOW - timedelta(minutes=10))


@pytest.fixture
def stored(make_proxy: Callable[..., Proxy], scripted_url: str, database_url: str) -> Proxy:
    """A proxy whose database holds, for model "m": a calm baseline 20-10 minutes before NOW
    and a window of 5x TTFT in the last minute before NOW; a run "bench-1" the day before;
    and a second model "n" with too little traffic."""
    proxy = make_proxy(scripted_url, database_url=database_url, **QUIET)
    insert(database_url, [
        *rows("m", BASE_RANGE[0], 600, 80, seed=1),
        *rows("m", NOW - timedelta(minutes=1), 60, 80, ttft=0.3, seed=2),
        *rows("m", NOW - timedelta(days=1), 120, 60, run_id="bench-1", seed=3),
        *rows("n", NOW - timedelta(minutes=1), 60, 3, seed=4),
    ])
    return proxy


def get(proxy: Proxy, path: str = "/api/diagnosis", **params: Any) -> httpx.Response:
    return httpx.get(proxy.url + path, params=params, timeout=30)


def test_a_window_against_an_explicit_range(stored: Proxy) -> None:
    response = get(stored, model="m", until=z(NOW), window="1m",
                   baseline=f"{z(BASE_RANGE[0])}/{z(BASE_RANGE[1])}")
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["model"] == "m" and body["verdict"] == "queueing"
    assert 0.9 < body["confidence"] <= 1.0
    assert body["baseline"] == {"kind": "range", "since": BASE_RANGE[0].isoformat(),
                                "until": BASE_RANGE[1].isoformat(), "seconds": 600.0}
    assert body["window"]["seconds"] == 60.0
    assert body["actions"][0]["knob"] == "replicas"
    samples = body["evidence"]["samples"]
    assert samples["window"]["requests"] == 80 and samples["baseline"]["requests"] == 80
    assert body["evidence"]["ttft"]["ratio"] == pytest.approx(5, rel=0.15)
    assert body["engine_metrics"] is None


def test_the_default_baseline_is_the_span_before_the_window(stored: Proxy) -> None:
    # The hour before the last minute holds the calm baseline.
    body = get(stored, model="m", until=z(NOW), window="1m").json()
    assert body["baseline"]["kind"] == "previous" and body["baseline"]["seconds"] == 3600
    assert body["verdict"] == "queueing"
    # A baseline of 30 s right before the window holds nothing: the window is judged on its
    # own, against the SLO (its TTFT, 5x the calm one, is still within 0.5 s).
    body = get(stored, model="m", until=z(NOW), window="1m", baseline="30s").json()
    assert body["evidence"]["checks"]["baseline_free"] is True
    assert body["verdict"] == "healthy" and body["confidence"] <= 0.5
    assert "no baseline" in body["summary"]


def test_a_stored_run_as_the_known_good_baseline(stored: Proxy) -> None:
    body = get(stored, model="m", until=z(NOW), window="1m", baseline="run:bench-1").json()
    assert body["baseline"]["kind"] == "run" and body["baseline"]["run_id"] == "bench-1"
    assert body["evidence"]["samples"]["baseline"]["requests"] == 60
    assert body["verdict"] == "queueing"


def test_every_active_model_without_model(stored: Proxy) -> None:
    body = get(stored, until=z(NOW), window="1m").json()
    verdicts = {item["model"]: item["verdict"] for item in body["items"]}
    assert verdicts == {"m": "queueing", "n": "insufficient_data"}


@pytest.mark.parametrize(
    ("params", "param", "says"),
    [
        ({"window": "soon"}, "window", "a positive duration"),
        ({"baseline": "yesterday"}, "baseline", "run:<run id>"),
        ({"baseline": "2026-01-02T00:00:00Z/2026-01-01T00:00:00Z"}, "baseline", "start before"),
        ({"baseline": "run:"}, "baseline", "needs a run id"),
        ({"baseline": "run:never-ran"}, "baseline", "no stored request carries run id"),
        ({"min_samples": 1}, "min_samples", "greater than or equal to 5"),
        ({"until": "tomorrow"}, "until", "valid datetime"),
    ],
)
def test_bad_parameters_get_a_422_in_the_openai_format(
    make_proxy: Callable[..., Proxy], scripted_url: str, params: dict[str, Any], param: str,
    says: str,
) -> None:
    response = get(make_proxy(scripted_url, **QUIET), model="m", **params)
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == 422
    assert error["param"] == param and says in error["message"], error["message"]


def test_a_large_span_is_read_thinned_but_counted_whole(stored: Proxy, database_url: str) -> None:
    async def read() -> tuple[int, int]:
        engine = create_engine(database_url)
        try:
            async with create_sessionmaker(engine)() as session:
                span = await read_observations(session, model="m", since=BASE_RANGE[0],
                                               until=NOW, limit=30)
                return len(span.rows), span.total
        finally:
            await engine.dispose()

    read_rows, total = asyncio.run(read())
    assert total == 160
    assert 20 <= read_rows <= 40  # every 6th id: about 160 / 6


def test_arrivals_are_read_as_the_exact_posix_seconds_of_the_stored_times(
        make_proxy: Callable[..., Proxy], scripted_url: str, database_url: str) -> None:
    # The database computes each arrival's POSIX seconds (store/diagnoses.py `EpochSeconds`):
    # the same float, to the bit, as `timestamp()` of the datetime stored, whatever its
    # microseconds (0, 999999, and values whose decimal has no exact binary form).
    make_proxy(scripted_url, database_url=database_url, **QUIET)  # creates the schema
    batch = rows("m", NOW - timedelta(minutes=5), 60, 40, seed=7)
    micros = [0, 1, 999_999, 100_000, 333_333, 711_376, 500_000, 123_457]
    for i, row in enumerate(batch):
        row.started_at = row.started_at.replace(microsecond=micros[i % len(micros)]) \
            + timedelta(days=i * 97, seconds=i * 3_607)
    insert(database_url, batch)

    async def read() -> list[float]:
        engine = create_engine(database_url)
        try:
            async with create_sessionmaker(engine)() as session:
                span = await read_observations(session, model="m", limit=1000)
                return [row[0] for row in span.rows]
        finally:
            await engine.dispose()

    assert asyncio.run(read()) == sorted(row.started_at.timestamp() for row in batch)


@pytest.fixture
def scheduled(make_proxy: Callable[..., Proxy], scripted_url: str, sqlite_url: str) -> Proxy:
    """A proxy judging every 0.2 s a 60 s window against the 10 minutes before it, with a
    baseline already stored and a slow window arriving now."""
    now = datetime.now(UTC)
    proxy = make_proxy(scripted_url, diagnosis_interval_s=0.2, diagnosis_window_s=60,
                       diagnosis_baseline_s=600, engine_metrics_enabled=False)
    insert(sqlite_url, [*rows("m", now - timedelta(minutes=8), 300, 80, seed=5),
                        *rows("m", now - timedelta(seconds=50), 45, 80, ttft=0.4, seed=6)])
    return proxy


def test_the_schedule_exports_the_verdict_and_stores_changes_only(scheduled: Proxy) -> None:
    def verdict(v: str) -> float:
        return scheduled.sample("phasewatch_diagnosis_verdict", {"model": "m", "verdict": v})

    wait_for(lambda: verdict("queueing") == 1.0)
    for other in ("healthy", "decode_saturation", "out_of_capacity", "prefill_bound",
                  "interference", "kv_pressure", "insufficient_data"):
        assert scheduled.registry.get_sample_value(
            "phasewatch_diagnosis_verdict", {"model": "m", "verdict": other}) == 0.0
    assert scheduled.sample("phasewatch_diagnosis_confidence", {"model": "m"}) > 0.9
    rounds = scheduled.sample("phasewatch_diagnosis_evaluations_total")
    wait_for(lambda: scheduled.sample("phasewatch_diagnosis_evaluations_total") >= rounds + 3)
    history = get(scheduled, "/api/diagnosis/history", model="m").json()
    assert len(history["items"]) == 1  # three more rounds, the same verdict: no new row
    item = history["items"][0]
    assert item["verdict"] == "queueing" and item["model"] == "m"
    assert item["baseline"] == "previous 600s" and item["window_s"] == 60
    assert "Queueing" in item["summary"] and item["actions"][0]["knob"] == "replicas"
    assert item["evidence"]["ttft"]["rising"] is True
    text = httpx.get(scheduled.url + "/metrics").text
    assert 'phasewatch_diagnosis_verdict{model="m",verdict="queueing"} 1.0' in text


def test_history_paginates_newest_first(stored: Proxy, database_url: str) -> None:
    from phasewatch.store.diagnoses import add_diagnosis

    async def add() -> None:
        engine = create_engine(database_url)
        try:
            async with create_sessionmaker(engine)() as session:
                for i, verdict in enumerate(("healthy", "queueing", "healthy")):
                    await add_diagnosis(session, at=NOW + timedelta(seconds=i), model="m",
                                        window_s=300, baseline="previous 3600s",
                                        verdict=verdict, confidence=0.9,
                                        evidence={"summary": f"change {i}"})
                await add_diagnosis(session, at=NOW, model="other", window_s=300,
                                    baseline="previous 3600s", verdict="healthy",
                                    confidence=1.0, evidence={})
        finally:
            await engine.dispose()

    asyncio.run(add())
    first = get(stored, "/api/diagnosis/history", model="m", limit=2).json()
    assert [i["summary"] for i in first["items"]] == ["change 2", "change 1"]
    rest = get(stored, "/api/diagnosis/history", model="m", limit=2,
               cursor=first["next_cursor"]).json()
    assert [i["summary"] for i in rest["items"]] == ["change 0"] and rest["next_cursor"] is None
    assert len(get(stored, "/api/diagnosis/history").json()["items"]) == 4
    assert get(stored, "/api/diagnosis/history", limit=0).status_code == 422


def test_engine_metrics_are_scraped_and_read(make_proxy: Callable[..., Proxy]) -> None:
    with running_sim(load_sim_settings(port=0, log_level="warning")) as sim:
        proxy = make_proxy(sim.url, diagnosis_interval_s=0, engine_scrape_interval_s=0.1)
        wait_for(lambda: proxy.sample("phasewatch_engine_scrape_up") == 1.0)
        model = httpx.get(proxy.url + "/v1/models").json()["data"][0]["id"]
        for _ in range(3):
            httpx.post(proxy.url + "/v1/completions", timeout=10, json={
                "model": model, "prompt": "word " * 50, "max_tokens": 8, "stream": True}).read()
        time.sleep(0.3)  # a scrape after the requests
        body = get(proxy, model=model, window="1m", min_samples=5).json()
        proxy.server.stop()  # before the simulator, which would wait for its connections
    assert body["engine_metrics"] == {"url": sim.url + "/metrics", "up": True,
                                      "in_window": True}
    engine = body["evidence"]["engine"]
    assert engine["scrapes"] >= 2 and engine["metric_names"]["ttft"] == (
        "vllm:time_to_first_token_seconds")
    assert engine["ttft_count"] >= 3  # the engine saw the requests that the proxy relayed


def test_each_scheduled_round_reads_the_engine_as_it_is_then(
    make_proxy: Callable[..., Proxy]
) -> None:
    # The scrape interval alone would give one scrape in ten minutes; the schedule asks for a
    # fresh one before each round, so the engine's evidence is never older than the round.
    with running_sim(load_sim_settings(port=0, log_level="warning")) as sim:
        proxy = make_proxy(sim.url, diagnosis_interval_s=0.2, engine_scrape_interval_s=600)
        model = httpx.get(proxy.url + "/v1/models").json()["data"][0]["id"]
        httpx.post(proxy.url + "/v1/completions", timeout=10, json={
            "model": model, "prompt": "word " * 20, "max_tokens": 4, "stream": True}).read()
        rounds = proxy.sample("phasewatch_diagnosis_evaluations_total")
        wait_for(lambda: proxy.sample("phasewatch_diagnosis_evaluations_total") >= rounds + 4,
                 says="four scheduled rounds")
        body = get(proxy, model=model, window="1m", min_samples=5).json()
        proxy.server.stop()
    assert body["engine_metrics"]["up"] is True
    assert body["evidence"]["engine"]["scrapes"] >= 5  # the first, and one before each round


def test_an_unreachable_engine_is_counted_and_diagnosis_goes_on(
    stored: Proxy, make_proxy: Callable[..., Proxy], scripted_url: str, database_url: str
) -> None:
    stored.server.stop()  # it leads on this database; only the leader scrapes the engine
    proxy = make_proxy(scripted_url, database_url=database_url, diagnosis_interval_s=0,
                       engine_metrics_url=f"http://127.0.0.1:{free_port()}/metrics",
                       engine_scrape_interval_s=0.1)
    wait_for(lambda: proxy.sample("phasewatch_engine_scrape_failures_total") >= 2)
    assert proxy.sample("phasewatch_engine_scrape_up") == 0.0
    body = get(proxy, model="m", until=z(NOW), window="1m").json()
    assert body["verdict"] == "queueing" and body["evidence"]["engine"] is None
    assert body["engine_metrics"]["up"] is None  # no scrape stored by the window's end
    assert get(proxy, model="m", window="1m").json()["engine_metrics"]["up"] is False


def test_a_database_outage_fails_rounds_not_streams(
    scripted_url: str, private_postgres: PrivatePostgres
) -> None:
    upgrade(private_postgres.url)
    now = datetime.now(UTC)
    insert(private_postgres.url, rows("m", now - timedelta(seconds=30), 25, 40, seed=7))
    settings = load_settings(upstream_url=scripted_url, database_url=private_postgres.url,
                             admin_open=True, metrics_cache_s=0, diagnosis_interval_s=0.1,
                             diagnosis_window_s=60,
                             engine_metrics_enabled=False)
    registry = CollectorRegistry()
    server = ThreadServer(create_app(settings, registry=registry)).start()
    proxy = Proxy(server, registry)
    try:
        wait_for(lambda: proxy.sample("phasewatch_diagnosis_evaluations_total") >= 1)
        private_postgres.stop()
        wait_for(lambda: proxy.sample("phasewatch_diagnosis_evaluation_failures_total") >= 2,
                 timeout=20)
        script = {"x-script": orjson.dumps({"tokens": [[0.01, "a", 1], [0.02, "b", 1]]})
                  .decode()}
        for _ in range(3):  # streams go on while every round fails
            with httpx.stream("POST", proxy.url + "/v1/completions", headers=script, timeout=10,
                              json={"model": "m", "prompt": "x", "stream": True}) as response:
                assert response.status_code == 200
                assert response.read().endswith(b"data: [DONE]\n\n")
        private_postgres.start()
        rounds = proxy.sample("phasewatch_diagnosis_evaluations_total")
        wait_for(lambda: proxy.sample("phasewatch_diagnosis_evaluations_total") > rounds,
                 timeout=20)
    finally:
        server.stop()


def test_engine_metrics_settings() -> None:
    default = load_settings(upstream_url="http://10.0.0.5:8000/")
    assert default.engine_metrics_target == "http://10.0.0.5:8000/metrics"
    elsewhere = load_settings(engine_metrics_url="http://10.0.0.6:9400/metrics")
    assert elsewhere.engine_metrics_target == "http://10.0.0.6:9400/metrics"
    assert load_settings(engine_metrics_enabled=False).engine_metrics_target is None
