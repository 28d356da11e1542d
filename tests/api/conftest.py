"""One phasewatch in front of the simulator, holding real traffic, for the API's tests.

Both run under uvicorn in threads on loopback, started once for the package (module-scoped
servers keep the suite's time). The proxy's admin API takes a token, as deployed. What it
stores, all through the relay or the bench client:
- a baseline phase and a window phase of streamed completions and chat completions, with
  non-streamed ones (no TTFT) and requests for a model the simulator refuses (`http_error`);
- a `phasewatch bench concurrency` run through the proxy, stored with its points, its requests
  carrying the run id; and a run still `running` (no summary, no end), built piece by piece;
- the engine's `/metrics` scraped, the live snapshots published, and the diagnosis schedule's
  verdict changes.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry
from sqlalchemy import func, select

from phasewatch.cli import main
from phasewatch.core.db import create_engine, create_sessionmaker
from phasewatch.core.settings import load_settings
from phasewatch.main import create_app
from phasewatch.sim.config import load_sim_settings
from phasewatch.sim.server import running_sim
from phasewatch.store.models import EngineScrape
from phasewatch.store.runs import create_run
from tests.support.databases import postgres_database
from tests.support.servers import ThreadServer

TOKEN = "api-tests-token"
STUDY = "study-running"  # the run built piece by piece


@dataclass(frozen=True)
class Served:
    """The proxy's URL and token, and what the fixture sent through it."""

    url: str
    model: str
    bench_run: str  # the id of the bench's stored run
    baseline: tuple[datetime, datetime]  # the first phase, arrivals in [since, until)
    window_until: datetime  # the second phase ran from baseline[1] to this
    records: int  # requests the proxy stored

    @property
    def headers(self) -> dict[str, str]:
        return {"x-phasewatch-admin-token": TOKEN}

    def get(self, path: str, **params: Any) -> httpx.Response:
        return httpx.get(self.url + path, params=params, headers=self.headers, timeout=30)


def _send(url: str, body: dict[str, Any], path: str = "/v1/completions") -> None:
    httpx.post(url + path, json=body, timeout=30).read()


def _phase(url: str, model: str, prompt_words: int) -> None:
    """16 streamed completions, 4 streamed chats, 2 unstreamed, 2 refused, 4 at a time."""
    prompt = "word " * prompt_words
    stream = {"model": model, "prompt": prompt, "max_tokens": 12, "stream": True}
    chat = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 12, "stream": True}
    calls = ([(stream, "/v1/completions")] * 16 + [(chat, "/v1/chat/completions")] * 4
             + [({**stream, "stream": False}, "/v1/completions")] * 2
             + [({**stream, "model": "no-such-model"}, "/v1/completions")] * 2)
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda call: _send(url, *call), calls))


def _wait(condition: Any, says: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{says}: not within {timeout} s")
        time.sleep(0.05)


async def _scrapes_since(database_url: str, moment: datetime) -> int:
    """Scrapes of the engine's /metrics the proxy stored at or after `moment`."""
    engine = create_engine(database_url)
    try:
        async with create_sessionmaker(engine)() as session:
            count = await session.scalar(select(func.count()).select_from(EngineScrape)
                                         .where(EngineScrape.at >= moment))
            return int(count or 0)
    finally:
        await engine.dispose()


async def _store_running_run(database_url: str) -> None:
    engine = create_engine(database_url)
    try:
        async with create_sessionmaker(engine)() as session:
            await create_run(session, name="a study", kind="study", target="http://x",
                             parameters={"note": "still running"}, run_id=STUDY)
    finally:
        await engine.dispose()


@pytest.fixture(scope="package", params=["sqlite", "postgres"])
def served(request: pytest.FixtureRequest,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """The stack on each backend: the answers are encoded from what each driver returns."""
    root = tmp_path_factory.mktemp("api")
    if request.param == "sqlite":
        yield from _served(f"sqlite+aiosqlite:///{root / 'phasewatch.db'}", root)
    else:
        with postgres_database(f"pw_api_{uuid.uuid4().hex[:12]}") as database_url:
            yield from _served(database_url, root)


def _served(database_url: str, root: Path) -> Iterator[Served]:
    # time_scale: the simulated model runs 4x faster than real time.
    with running_sim(load_sim_settings(port=0, log_level="warning", time_scale=0.25)) as sim:
        settings = load_settings(
            upstream_url=sim.url, database_url=database_url, admin_token=TOKEN,
            writer_flush_interval_s=0.02, metrics_cache_s=0, engine_scrape_interval_s=0.2,
            live_snapshot_interval_s=0.2, diagnosis_interval_s=0.3, diagnosis_window_s=60,
            diagnosis_recent_s=60, diagnosis_baseline_s=600, diagnosis_min_samples=5)
        proxy = ThreadServer(create_app(settings, registry=CollectorRegistry())).start()
        try:
            yield _fill(proxy.url, database_url, root)
        finally:
            proxy.stop()  # before the simulator, which would wait for its connections


def _fill(url: str, database_url: str, root: Path) -> Served:
    model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    headers = {"x-phasewatch-admin-token": TOKEN}
    start = datetime.now(UTC)
    _phase(url, model, prompt_words=40)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PHASEWATCH_ADMIN_TOKEN", TOKEN)  # so the bench files its requests
        code = main(["bench", "concurrency", "--url", url, "--concurrency", "2",
                     "--requests-per-stream", "3", "--prompt-tokens", "32", "--max-tokens",
                     "8", "--no-plots", "--quiet", "--out", str(root / "bench"),
                     "--database-url", database_url])
    assert code == 0
    asyncio.run(_store_running_run(database_url))
    middle = datetime.now(UTC)
    _phase(url, model, prompt_words=120)
    # The window ends once the engine was scraped in it twice, however fast the phase ran.
    _wait(lambda: asyncio.run(_scrapes_since(database_url, middle)) >= 2,
          "two engine scrapes in the window")
    end = datetime.now(UTC)
    runs = httpx.get(url + "/api/runs", params={"kind": "concurrency"}, headers=headers).json()
    sent = 2 * 24 + 6

    def stored() -> int:
        page = httpx.get(url + "/api/requests", params={"limit": 1000}, headers=headers)
        return len(page.json()["items"])

    _wait(lambda: stored() >= sent, f"{sent} records stored")
    _wait(lambda: httpx.get(url + "/api/diagnosis/history", headers=headers)
          .json()["items"], "a verdict change stored")
    return Served(url, model, runs["items"][0]["id"], (start, middle), end, stored())
