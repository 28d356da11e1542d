"""What the relay needs at hand, built once per app in the lifespan and kept on `app.state`."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

import aiohttp

from phasewatch.core.admin import AdminAccess
from phasewatch.core.metrics import ProxyMetrics
from phasewatch.core.records import RecordQueue
from phasewatch.core.settings import Settings
from phasewatch.proxy.labels import ModelLabels
from phasewatch.proxy.live import LiveStreams
from phasewatch.proxy.native import NativeRelay
from phasewatch.proxy.shutdown import Shutdown
from phasewatch.proxy.upstream_pool import UpstreamPool

if TYPE_CHECKING:  # imported only when switched on: it needs the `otel` extra
    from phasewatch.otel.export import OtelExport


@dataclass(slots=True)
class ProxyContext:
    settings: Settings
    session: aiohttp.ClientSession  # the pass-through's client (not the hot path)
    pool: UpstreamPool  # the timed relay's upstream connections
    metrics: ProxyMetrics
    labels: ModelLabels
    records: RecordQueue
    upstream: str  # base URL, no trailing slash
    live: LiveStreams  # the open exchanges: idle timeout, live gauges, snapshot
    admin: AdminAccess  # who may file requests under a run (x-phasewatch-run-id)
    shutdown: Shutdown  # serving, draining or ending
    passthrough_timeout: aiohttp.ClientTimeout
    # The loop the app serves on, at hand: `asyncio.get_running_loop()` makes a system call
    # (getpid) each time, a few times a request.
    loop: asyncio.AbstractEventLoop
    exemplars: bool = False  # TTFT and ITL observations carry the request's id
    otel: OtelExport | None = None  # None: OpenTelemetry is off, and none of it runs
    native: NativeRelay | None = None  # None: streams are relayed in Python alone
    in_flight: int = 0
