"""phasewatch's own view of a run: its stored records and `/api/stats`, read over HTTP.

Records are written by the proxy's background writer shortly after each request ends, so
`stored_records` and `run_records` poll until the expected number for a run id is there.
`proxy_figures` summarizes a point's records the way `/api/stats` does (pure): TTFT
percentiles over requests, ITL as percentiles across requests of each request's own ITL p50
(the proxy keeps per-request summaries, not every gap), and the token-weighted mean gap.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from phasewatch.bench.errors import WorkloadError
from phasewatch.bench.stats import named_quantiles
from phasewatch.bench.workload import admin_headers


@dataclass(frozen=True, slots=True)
class ProxyStats:
    """From `GET /api/stats?run_id=...&by=none`; seconds, as the proxy measured them."""

    requests: int
    errors: int
    ttft_p50_s: float | None
    itl_p50_s: float | None  # median across requests of each request's ITL p50
    itl_mean_s: float | None  # token-weighted mean gap


async def _get(session: aiohttp.ClientSession, url: str, params: dict[str, Any]) -> Any:
    async with session.get(url, params=params, headers=admin_headers()) as response:
        if response.status in (401, 403):
            raise WorkloadError(
                f"{url} answered {response.status}: phasewatch's admin API is closed; run the "
                "bench with the proxy's token in PHASEWATCH_ADMIN_TOKEN (README, \"The admin "
                "API is closed by default\")")
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


async def run_records(
    session: aiohttp.ClientSession, proxy_url: str, run_id: str, expected: int,
    timeout_s: float = 15.0,
) -> list[dict[str, Any]]:
    """Every record stored for `run_id` (all pages), waiting up to `timeout_s` for `expected`
    of them; returns what is there by then (a request that never reached the proxy has none)."""
    deadline = time.monotonic() + timeout_s
    while True:
        items: list[dict[str, Any]] = []
        cursor: int | None = None
        while True:
            params: dict[str, Any] = {"run_id": run_id, "limit": 1000}
            if cursor is not None:
                params["cursor"] = cursor
            page = await _get(session, proxy_url + "/api/requests", params)
            items.extend(page["items"])
            cursor = page.get("next_cursor")
            if cursor is None:
                break
        if len(items) >= expected or time.monotonic() > deadline:
            return list(reversed(items))
        await asyncio.sleep(0.1)


def proxy_figures(records: list[dict[str, Any]], scale: float = 1.0) -> dict[str, Any]:
    """A point's requests as phasewatch measured them; seconds (model seconds when scaled)."""
    ok = [r for r in records if r.get("outcome") == "ok"]
    ttfts = [r["ttft_s"] / scale for r in records if r.get("ttft_s") is not None]
    p50s = [r["itl_p50_s"] / scale for r in records if r.get("itl_p50_s") is not None]
    gaps = sum(r.get("itl_count") or 0 for r in records if r.get("itl_mean_s") is not None)
    gap_time = sum((r.get("itl_count") or 0) * r["itl_mean_s"] / scale for r in records
                   if r.get("itl_mean_s") is not None)
    maxes = [r["itl_max_s"] / scale for r in records if r.get("itl_max_s") is not None]
    return {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "ttft_s": named_quantiles(ttfts),
        "itl_p50_s": named_quantiles(p50s),
        "itl_mean_s": gap_time / gaps if gaps else None,
        "itl_max_s": max(maxes) if maxes else None,
        "output_tokens": sum(r.get("output_tokens") or 0 for r in ok),
    }
