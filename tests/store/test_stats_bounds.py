"""`/api/stats` stays bounded: past `PHASEWATCH_API_MAX_ROWS` its percentiles come from a uniform
sample (totals stay exact), windows past `PHASEWATCH_API_MAX_WINDOW_S` are refused, and a call
past `PHASEWATCH_API_TIMEOUT_S` is stopped, its database query with it. On both backends.
(Under load, with a million rows: tests/faults/test_admin_api_load.py.)"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from sqlalchemy import select, text

from phasewatch.core.db import create_engine, create_sessionmaker
from phasewatch.core.quantiles import percentiles
from phasewatch.store.models import RequestRow
from phasewatch.store.window_stats import sample_cut, sample_key
from tests.conftest import Proxy

UNTIL = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=5)
MODELS = ("a", "b", "c")


def requests(n: int, models: Callable[[int], str] = lambda i: MODELS[i % 3],
             seed: int = 0) -> list[dict[str, Any]]:
    """n requests over the hour before UTC, models in turn (as round-robin traffic), 10% errors."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        ok = rng.random() > 0.1
        ttft, gap = rng.lognormvariate(-2.5, 0.6), rng.lognormvariate(-4.0, 0.3)
        out.append({
            "request_id": f"r{i}", "started_at": UNTIL - timedelta(seconds=3600 * (n - i) / n),
            "endpoint": "completions", "model": models(i), "upstream": "test", "stream": True,
            "outcome": "ok" if ok else "stream_error", "http_status": 200,
            "in_flight_at_arrival": rng.randrange(16), "ttft_s": ttft,
            "e2e_s": ttft + 31 * gap if ok else None, "tpot_s": gap if ok else None,
            "itl_count": 31, "itl_mean_s": gap, "itl_p50_s": gap, "itl_p95_s": gap * 1.3,
            "itl_max_s": gap * 2, "prompt_tokens": rng.randrange(10, 4000),
            "output_tokens": 32, "tokens_exact": True, "run_id": None, "error": None,
        })
    return out


def store(url: str, rows: list[dict[str, Any]]) -> None:
    async def write() -> None:
        engine = create_engine(url)
        try:
            async with engine.begin() as connection:
                await connection.execute(RequestRow.__table__.insert(), rows)
        finally:
            await engine.dispose()

    asyncio.run(write())


def read_sample(url: str, cut: int) -> list[tuple[Any, ...]]:
    """The rows the sample holds: (model, outcome, ttft_s, tpot_s, prompt_tokens)."""
    async def read() -> list[tuple[Any, ...]]:
        engine = create_engine(url)
        try:
            async with create_sessionmaker(engine)() as session:
                result = await session.execute(
                    select(RequestRow.model, RequestRow.outcome, RequestRow.ttft_s,
                           RequestRow.tpot_s, RequestRow.prompt_tokens)
                    .where(sample_key() < cut))
                return [tuple(row) for row in result]
        finally:
            await engine.dispose()

    return asyncio.run(read())


def stats(proxy: Proxy, **params: Any) -> httpx.Response:
    return httpx.get(proxy.url + "/api/stats", timeout=30,
                     params={"until": UNTIL.isoformat(), "window": "1h", **params})


def test_past_the_row_cap_percentiles_come_from_a_uniform_sample(
    make_proxy: Callable[..., Proxy], scripted_url: str, database_url: str
) -> None:
    # Under the cut for 297 of 1,500, ids 1-1,500 have exactly 297 hashes (for 300 they have
    # 301, and the sample query stops at 300, the last one being whichever came last).
    proxy = make_proxy(scripted_url, database_url=database_url, api_max_rows=297)
    rows = requests(1500)
    store(database_url, rows)
    body = stats(proxy).json()
    cut = sample_cut(1500, 297)
    assert cut is not None
    sample = read_sample(database_url, cut)
    assert len(sample) == 297
    assert body["sample"] == {"rows": 297, "of": 1500}
    assert body["groups_left_off"] is False
    for group in body["groups"]:
        mine = [r for r in rows if r["model"] == group["group"]]
        drawn = [r for r in sample if r[0] == group["group"]]
        # Totals exact, from every row of the window.
        assert group["requests"] == len(mine) == 500
        assert group["errors"] == sum(r["outcome"] != "ok" for r in mine)
        assert group["output_throughput_tps"] == pytest.approx(
            sum(32 for r in mine if r["outcome"] == "ok") / 3600)
        assert group["itl_mean_s"] == pytest.approx(
            sum(r["itl_mean_s"] for r in mine) / len(mine))
        assert group["in_flight_max"] == max(r["in_flight_at_arrival"] for r in mine)
        # Percentiles: nearest rank over this group's part of the sample, a third of it (the
        # models take turns, and a stride of ids would have read one model only).
        assert group["sampled"] == len(drawn)
        assert 90 <= len(drawn) <= 110
        p50, p90, p95, p99 = percentiles([r[2] for r in drawn], (0.5, 0.9, 0.95, 0.99))
        assert group["ttft_s"] == {"p50": p50, "p90": p90, "p95": p95, "p99": p99}
        ok = [r for r in drawn if r[1] == "ok"]
        assert group["tpot_p50_s"] == percentiles([r[3] for r in ok], (0.5,))[0]
        assert group["prompt_tokens_p50"] == percentiles([r[4] for r in drawn], (0.5,))[0]
    # Within the cap, the whole window is ranked.
    last = [r["ttft_s"] for r in rows if r["started_at"] >= UNTIL - timedelta(minutes=10)]
    whole = stats(proxy, window="10m", by="none").json()
    assert whole["sample"] == {"rows": len(last), "of": len(last)} and len(last) == 250
    assert whole["groups"][0]["ttft_s"]["p99"] == percentiles(last, (0.99,))[0]


def test_only_the_busiest_groups_are_answered(
    make_proxy: Callable[..., Proxy], scripted_url: str, sqlite_url: str
) -> None:
    proxy = make_proxy(scripted_url)
    # 1,002 model names (a client can send any): "busy" has 3 requests, the rest one each.
    store(sqlite_url, requests(1004, models=lambda i: "busy" if i < 3 else f"m{i:04d}"))
    body = stats(proxy).json()
    assert body["groups_left_off"] is True and len(body["groups"]) == 1000
    names = [g["group"] for g in body["groups"]]
    assert "busy" in names and names == sorted(names)
    assert body["sample"] == {"rows": 1002, "of": 1002}  # the groups answered, and only them


def test_a_window_past_the_widest_is_refused(
    make_proxy: Callable[..., Proxy], scripted_url: str
) -> None:
    proxy = make_proxy(scripted_url, api_max_window_s=3600)
    assert stats(proxy, window="1h").status_code == 200
    response = stats(proxy, window="61m")
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert "window: at most 3600 s (PHASEWATCH_API_MAX_WINDOW_S)" in error["message"]


def test_a_call_past_its_time_budget_is_answered_503(
    make_proxy: Callable[..., Proxy], scripted_url: str
) -> None:
    # A budget shorter than any query: the first await on the database is past it.
    proxy = make_proxy(scripted_url, api_timeout_s=1e-6)
    for path in ("/api/stats", "/api/requests", "/api/runs", "/api/diagnosis/history"):
        response = httpx.get(proxy.url + path, timeout=10)
        assert response.status_code == 503, path
        error = response.json()["error"]
        assert error["type"] == "query_timeout"
        assert "PHASEWATCH_API_TIMEOUT_S" in error["message"] and "narrower" in error["message"]
    assert httpx.get(proxy.url + "/api/health", timeout=10).status_code == 200


def test_a_query_whose_caller_gave_up_stops_in_the_database(database_url: str) -> None:
    """Cancelling the caller stops its query: asyncpg cancels it on the server; an SQLite
    query would run on in aiosqlite's thread (and its connection's close would wait for it)
    but is interrupted (app/phasewatch/core/db.py)."""
    slow = ("SELECT pg_sleep(30)" if database_url.startswith("postgresql") else
            "WITH RECURSIVE c(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM c "
            "WHERE i < 1000000000) SELECT count(*) FROM c")

    async def give_up() -> float:
        engine = create_engine(database_url)
        try:
            started = time.monotonic()
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.3), create_sessionmaker(engine)() as session:
                    await session.execute(text(slow))
            stopped = time.monotonic() - started
            async with create_sessionmaker(engine)() as session:  # the engine still works
                assert await session.scalar(text("SELECT 1")) == 1
            return stopped
        finally:
            await engine.dispose()

    assert asyncio.run(give_up()) < 3.0
