"""`/metrics` stays bounded and cheap: hostile model names cannot grow its series, and a scrape
storm costs one render per cache interval. Real proxy under uvicorn, scripted upstream."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import orjson

from tests.support.served import wait_for

SCRIPT = {"x-script": orjson.dumps({"tokens": [[0.01, "a", 1], [0.02, "b", 1]]}).decode()}


def test_hostile_model_names_cannot_grow_the_series(make_proxy: Any, scripted_url: str) -> None:
    proxy = make_proxy(scripted_url, max_model_labels=2)
    for i in range(6):
        # The scripted upstream serves any name; only the first two get their own label.
        httpx.post(proxy.url + "/v1/completions",
                   json={"model": f"model-{i}", "prompt": "x"}, headers=SCRIPT)
    for i in range(6):
        httpx.post(proxy.url + "/v1/completions", json={"model": f"bad-{i}", "prompt": "x"},
                   headers={"x-script": '{"status": 404}'})
    registry = proxy.registry
    models = {s.labels["model"] for m in registry.collect() if m.name == "phasewatch_requests"
              for s in m.samples}
    assert models == {"model-0", "model-1", "other"}
    assert proxy.sample("phasewatch_requests_total",
                        {"model": "other", "endpoint": "completions", "outcome": "ok"}) == 4


class CountingCollector:
    """Counts how often a scrape renders the registry."""

    def __init__(self) -> None:
        self.renders = 0

    def collect(self) -> list[Any]:
        self.renders += 1
        return []


def test_a_scrape_storm_costs_one_render_per_interval(make_proxy: Any, scripted_url: str) -> None:
    proxy = make_proxy(scripted_url, metrics_cache_s=0.5)  # default 1 s
    counter = CountingCollector()
    proxy.registry.register(counter)

    async def storm() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=proxy.url, timeout=10) as client:
            return await asyncio.gather(*(client.get("/metrics") for _ in range(50)))

    answers = asyncio.run(storm())
    assert all(a.status_code == 200 for a in answers) and len({a.text for a in answers}) == 1
    assert counter.renders == 1  # fifty scrapers, one render
    wait_for(lambda: httpx.get(proxy.url + "/metrics").status_code == 200
             and counter.renders == 2, says="a render once the interval is over")
