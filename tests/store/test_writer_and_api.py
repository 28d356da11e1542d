"""Records flow from the relay to the database and back out of the read API, on both backends."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import orjson
import pytest

from phasewatch.core.db import create_engine, create_sessionmaker
from phasewatch.core.quantiles import percentiles
from phasewatch.store.runs import add_point, create_run, finish_run
from tests.conftest import Proxy

FAST = {"tokens": [[0.01, "a", 1], [0.02, "b", 1], [0.03, "c", 1]]}


def send(proxy: Proxy, model: str, script: dict[str, Any], run_id: str | None = None,
         request_id: str | None = None) -> None:
    headers = {"x-script": orjson.dumps(script).decode()}
    if run_id:
        headers["x-phasewatch-run-id"] = run_id
    if request_id:
        headers["x-request-id"] = request_id
    httpx.post(proxy.url + "/v1/completions", headers=headers, timeout=10,
               json={"model": model, "prompt": "x", "stream": True}).read()


def wait_stored(proxy: Proxy, count: int) -> list[dict[str, Any]]:
    for _ in range(200):
        rows = proxy.stored()
        if len(rows) >= count:
            return rows
        asyncio.run(asyncio.sleep(0.02))
    raise AssertionError(f"only {len(proxy.stored())} of {count} records stored")


@pytest.fixture
def filled(make_proxy: Any, scripted_url: str, database_url: str) -> Proxy:
    proxy = make_proxy(scripted_url, database_url=database_url)
    for i in range(12):
        send(proxy, "alpha", FAST, run_id="run-a" if i < 4 else None, request_id=f"a{i}")
    for i in range(5):
        send(proxy, "beta", {"tokens": [[0.05, "x", 1], [0.06, "y", 1]]}, request_id=f"b{i}")
    for _ in range(3):
        send(proxy, "beta", {"status": 500})
    wait_stored(proxy, 20)
    return proxy


def test_every_record_is_stored_with_its_figures(filled: Proxy) -> None:
    rows = filled.stored()
    assert len(rows) == 20
    row = next(r for r in rows if r["request_id"] == "a0")
    assert row["outcome"] == "ok" and row["model"] == "alpha" and row["stream"] is True
    assert row["output_tokens"] == 3 and row["prompt_tokens"] == 7 and row["itl_count"] == 2
    assert row["run_id"] == "run-a" and row["tokens_exact"] is True
    assert 0.005 < row["ttft_s"] < 0.05 and row["e2e_s"] >= row["ttft_s"]
    assert datetime.fromisoformat(row["started_at"]).tzinfo is not None
    failed = [r for r in rows if r["outcome"] == "http_error"]
    assert len(failed) == 3 and all(r["http_status"] == 500 for r in failed)
    assert filled.sample("phasewatch_records_written_total") == 20


def test_over_long_client_text_is_cut_not_a_poison_batch(
    make_proxy: Any, scripted_url: str, database_url: str
) -> None:
    proxy = make_proxy(scripted_url, database_url=database_url)
    send(proxy, "m" * 400, FAST, run_id="r" * 300, request_id="q" * 500)
    send(proxy, "alpha", FAST, request_id="after")
    rows = wait_stored(proxy, 2)
    # The model as labels keep it (app/phasewatch/proxy/labels.py); the rest cut by the writer.
    assert [len(rows[0][k]) for k in ("model", "run_id", "request_id")] == [128, 64, 128]
    assert rows[1]["request_id"] == "after"


def test_a_record_the_database_refuses_is_rejected_alone(
    make_proxy: Any, scripted_url: str, database_url: str
) -> None:
    proxy = make_proxy(scripted_url, database_url=database_url, writer_flush_interval_s=0.5)
    send(proxy, "alpha", FAST, request_id="before")
    # Postgres text cannot hold NUL: an upstream error type with one (names are cleaned of it
    # before they reach a record; an upstream's error type is kept as it came).
    send(proxy, "alpha", {"status": 400, "error_type": "Bad\u0000Request"}, request_id="nul")
    send(proxy, "alpha", FAST, request_id="after")
    expected = {"before", "after"} if "postgresql" in database_url else {"before", "nul", "after"}
    rows = wait_stored(proxy, len(expected))
    assert {r["request_id"] for r in rows} == expected
    assert proxy.sample("phasewatch_records_rejected_total") == 3 - len(expected)


def test_filters_and_keyset_pagination(filled: Proxy) -> None:
    assert len(filled.stored(model="beta")) == 8
    assert len(filled.stored(model="beta", outcome="http_error")) == 3
    assert [r["request_id"] for r in filled.stored(request_id="b2")] == ["b2"]
    assert len(filled.stored(run_id="run-a")) == 4
    future = (datetime.now(UTC) + timedelta(minutes=1)).isoformat()
    assert filled.stored(since=future) == []
    assert len(filled.stored(until=future)) == 20
    seen: list[int] = []
    cursor = None
    while True:
        params: dict[str, Any] = {"limit": 6, **({"cursor": cursor} if cursor else {})}
        page = httpx.get(filled.url + "/api/requests", params=params).json()
        seen += [r["id"] for r in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert len(seen) == 20 and seen == sorted(seen, reverse=True)  # newest first, no repeats


def test_window_stats_per_model(filled: Proxy) -> None:
    body = httpx.get(filled.url + "/api/stats", params={"window": "5m", "by": "model"}).json()
    assert body["window_s"] == 300 and body["by"] == "model"
    groups = {g["group"]: g for g in body["groups"]}
    assert set(groups) == {"alpha", "beta"}
    alpha, beta = groups["alpha"], groups["beta"]
    assert (alpha["requests"], alpha["errors"], beta["requests"], beta["errors"]) == (12, 0, 8, 3)
    ttfts = [r["ttft_s"] for r in filled.stored(model="alpha")]
    p50, p90, p95, p99 = percentiles(ttfts, (0.5, 0.9, 0.95, 0.99))
    assert alpha["ttft_s"] == {"p50": p50, "p90": p90, "p95": p95, "p99": p99}
    assert alpha["output_throughput_tps"] == pytest.approx(12 * 3 / 300)
    assert alpha["itl_mean_s"] == pytest.approx(0.01, abs=0.004)
    assert beta["itl_p50_s"]["p50"] == pytest.approx(0.01, abs=0.004)
    everything = httpx.get(filled.url + "/api/stats", params={"by": "none"}).json()
    assert everything["groups"][0]["requests"] == 20
    run = httpx.get(filled.url + "/api/stats", params={"run_id": "run-a", "by": "none"}).json()
    assert run["groups"][0]["requests"] == 4


def test_stats_of_an_empty_window(filled: Proxy) -> None:
    past = (datetime.now(UTC) - timedelta(days=1)).isoformat()
    body = httpx.get(filled.url + "/api/stats", params={"until": past, "window": "1h"}).json()
    assert body["groups"] == []


@pytest.mark.parametrize(
    ("path", "params", "param", "says"),
    [
        ("/api/stats", {"window": "five minutes"}, None, "window: a positive duration"),
        ("/api/stats", {"window": "0m"}, None, "window: a positive duration"),
        ("/api/stats", {"by": "colour"}, "by", "by: Input should be"),
        ("/api/requests", {"limit": 0}, "limit", "limit: Input should be greater than"),
        ("/api/requests", {"outcome": "great"}, "outcome", "outcome: Input should be"),
        ("/api/requests", {"since": "yesterday"}, "since", "since: Input should be a valid"),
        ("/api/runs", {"limit": 5000}, "limit", "limit: Input should be less than"),
    ],
)
def test_bad_query_parameters_get_a_clear_422(
    make_proxy: Any, scripted_url: str, path: str, params: dict[str, Any], param: str | None,
    says: str
) -> None:
    proxy = make_proxy(scripted_url)
    response = httpx.get(proxy.url + path, params=params)
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == 422
    assert says in error["message"], error["message"]
    if param:
        assert error["param"] == param


def test_runs_and_their_points(make_proxy: Any, scripted_url: str, database_url: str) -> None:
    proxy = make_proxy(scripted_url, database_url=database_url)

    async def store_runs() -> str:
        engine = create_engine(database_url)
        try:
            async with create_sessionmaker(engine)() as session:
                await create_run(session, name="old", kind="concurrency", target="http://x",
                                 parameters={"concurrency": [1, 4]})
                run = await create_run(session, name="sweep", kind="prompt_length",
                                       target="http://y", parameters={"prompt": [64, 256]},
                                       engine={"version": "0.11"})
                for step, x in enumerate((64, 256)):
                    await add_point(session, run.id, step=step, x_name="prompt_tokens",
                                    x_value=x, requests=10, errors=0, ttft_p50_s=0.04 + step,
                                    extra={"note": "ok"})
                await finish_run(session, run.id, status="finished", summary={"points": 2})
                return run.id
        finally:
            await engine.dispose()

    run_id = asyncio.run(store_runs())
    runs = httpx.get(proxy.url + "/api/runs").json()["items"]
    assert [r["name"] for r in runs] == ["sweep", "old"]
    assert len(httpx.get(proxy.url + "/api/runs", params={"kind": "concurrency"}).json()
               ["items"]) == 1
    page = httpx.get(proxy.url + "/api/runs", params={"limit": 1}).json()
    assert page["next_cursor"] is not None
    detail = httpx.get(f"{proxy.url}/api/runs/{run_id}").json()
    assert detail["status"] == "finished" and detail["engine"] == {"version": "0.11"}
    assert [p["x_value"] for p in detail["points"]] == [64, 256]
    assert detail["points"][1]["ttft_p50_s"] == pytest.approx(1.04)
    missing = httpx.get(f"{proxy.url}/api/runs/nope")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
