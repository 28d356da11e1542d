"""What the relay needs at hand, built once per app in the lifespan and kept on `app.state`."""

from __future__ import annotations

from dataclasses import dataclass

import aiohttp

from app.core.metrics import ProxyMetrics
from app.core.records import RecordQueue
from app.core.settings import Settings
from app.proxy.labels import ModelLabels
from app.proxy.upstream_pool import UpstreamPool
from app.proxy.watchdog import IdleWatchdog


@dataclass(slots=True)
class ProxyContext:
    settings: Settings
    session: aiohttp.ClientSession  # the pass-through's client (not the hot path)
    pool: UpstreamPool  # the timed relay's upstream connections
    metrics: ProxyMetrics
    labels: ModelLabels
    records: RecordQueue
    upstream: str  # base URL, no trailing slash
    watchdog: IdleWatchdog
    passthrough_timeout: aiohttp.ClientTimeout
    in_flight: int = 0
