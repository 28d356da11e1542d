"""phasewatch's own view of a run: its stored records and `/api/stats`, read over HTTP.

Records are written by the proxy's background writer shortly after each request ends, so
`stored_records` polls until the expected number for a run id is there.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from app.bench.workload import WorkloadError


@dataclass(frozen=True, slots=True)
class ProxyStats:
    """From `GET /api/stats?run_id=...&by=none`; seconds, as the proxy measured them."""

    requests: int
    errors: int
    ttft_p50_s: float | None
    itl_p50_s: float | None  # median across requests of each request's ITL p50
    itl_mean_s: float | None  # token-weighted mean gap


async def _get(session: aiohttp.ClientSession, url: str, params: dict[str, Any]) -> Any:
    async with session.get(url, params=params) as response:
        if response.status != 200:
            raise WorkloadError(f"{url} answered {response.status}")
        return await response.json(loads=orjson.loads)


async def stored_records(
    session: aiohttp.ClientSession, proxy_url: str, run_id: str, expected: int,
    timeout_s: float = 15.0,
) -> list[dict[str, Any]]:
    """The run's stored records (oldest first), once `expected` of them are stored."""
    deadline = time.monotonic() + timeout_s
    while True:
        page = await _get(session, proxy_url + "/api/requests",
                          {"run_id": run_id, "limit": 1000})
        items: list[dict[str, Any]] = page["items"]
        if len(items) >= expected:
            return list(reversed(items))
        if time.monotonic() > deadline:
            raise WorkloadError(
                f"phasewatch stored {len(items)} of {expected} records for run {run_id}"
            )
        await asyncio.sleep(0.05)


async def run_stats(
    session: aiohttp.ClientSession, proxy_url: str, run_id: str, window: str = "1h"
) -> ProxyStats | None:
    body = await _get(session, proxy_url + "/api/stats",
                      {"run_id": run_id, "window": window, "by": "none"})
    if not body["groups"]:
        return None
    group = body["groups"][0]
    return ProxyStats(
        requests=group["requests"],
        errors=group["errors"],
        ttft_p50_s=group["ttft_s"]["p50"],
        itl_p50_s=group["itl_p50_s"]["p50"],
        itl_mean_s=group["itl_mean_s"],
    )
