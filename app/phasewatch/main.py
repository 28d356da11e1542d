"""The application factory: `create_app(settings)` wires the proxy together. Nothing at import time.

The lifespan builds the database engine (checking the schema), the record writer, the live
registry's task, the upstream client, the metrics, the diagnosis and the leadership that runs
retention, the engine scrape and the diagnosis schedule in one process per database
(store/leader.py). `serve_app` is what `phasewatch serve` runs in each worker.

Invariant: the two timed inference paths go from a small pure-ASGI dispatcher straight to the
relay; only phasewatch's own routes (`/metrics`, `/api/...`, the OpenAPI docs) and the
pass-through reach FastAPI, and there is no HTTP middleware on the hot path.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Any

import aiohttp
from fastapi import Depends, FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from prometheus_client import CollectorRegistry
from sqlalchemy.engine import make_url
from starlette.datastructures import State
from starlette.exceptions import HTTPException

from phasewatch import __version__
from phasewatch.api import diagnosis as diagnosis_api
from phasewatch.api import probes as probes_api
from phasewatch.api import requests as requests_api
from phasewatch.api import runs as runs_api
from phasewatch.api import stats as stats_api
from phasewatch.api.errors import (
    DATABASE_ERRORS,
    database_error,
    http_error,
    reject_nul,
    validation_error,
)
from phasewatch.core.admin import AdminAccess, is_admin_path
from phasewatch.core.db import create_engine, create_sessionmaker
from phasewatch.core.event_loop import PollSet
from phasewatch.core.exposition import Exposition
from phasewatch.core.metrics import ProxyMetrics
from phasewatch.core.records import RecordQueue
from phasewatch.core.settings import Settings, load_settings
from phasewatch.diagnosis.metrics import DiagnosisMetrics
from phasewatch.diagnosis.service import DiagnosisService
from phasewatch.engine.metrics import EngineScrapeMetrics
from phasewatch.engine.scraper import EngineScraper
from phasewatch.otel import check_otel
from phasewatch.plan.capacity import CapacityMetrics, CapacityService
from phasewatch.proxy.arrival import KernelArrivals
from phasewatch.proxy.asgi import REQUEST_ID, Receive, Scope, Send, header, send_error
from phasewatch.proxy.client_leg import (
    ARRIVALS,
    HEAD_TIMEOUT,
    SHUTDOWN_HOOK,
    client_leg,
)
from phasewatch.proxy.context import ProxyContext
from phasewatch.proxy.labels import ModelLabels
from phasewatch.proxy.live import LiveGauges, LiveStreams
from phasewatch.proxy.native import native_relay
from phasewatch.proxy.passthrough import pass_through
from phasewatch.proxy.relay import ENDPOINTS, relay
from phasewatch.proxy.shutdown import Shutdown
from phasewatch.proxy.upstream import create_upstream_session
from phasewatch.proxy.upstream_pool import UpstreamPool
from phasewatch.store.leader import Duty, Leadership, LeadershipMetrics, leader_lock
from phasewatch.store.live_publisher import LivePublisher
from phasewatch.store.migrate import prepare_schema
from phasewatch.store.retention import run_retention
from phasewatch.store.writer import RecordWriter

log = logging.getLogger(__name__)

OWN_PATHS = ("/metrics", "/api/", "/docs", "/redoc", "/openapi.json")
# How long a background thread may keep the GIL from the relay's loop (`serve_app`).
SWITCH_INTERVAL_S = 0.0005
# The cyclic collector's oldest generation, under `serve`: collected after this many
# collections of the middle one (CPython's default: 10).
FULL_COLLECTION_AFTER = 100
# The youngest generation, under `serve`: collected after this many more allocations than
# deallocations of tracked objects (CPython's default: 700, about every second request here).
YOUNG_COLLECTION_AFTER = 10_000


class Phasewatch:
    """The ASGI app: the relay for inference, FastAPI for phasewatch's own routes (the admin
    ones only for callers app/phasewatch/core/admin.py allows), the pass-through for the rest of the
    upstream's API."""

    def __init__(self, api: FastAPI, admin: AdminAccess) -> None:
        self.api = api
        self.admin = admin

    @property
    def state(self) -> State:
        return self.api.state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.api(scope, receive, send)
            return
        try:
            await self._http(scope, receive, send)
        finally:
            # The server's cycle holds the scope, the scope the client leg, and the leg the
            # cycle and the relay's callbacks: let go, so that the request's objects are
            # freed as it ends rather than by the cyclic collector.
            leg = client_leg(scope)
            if leg is not None:
                leg.release()

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"]
        endpoint = ENDPOINTS.get(path)
        if endpoint is not None and scope["method"] == "POST":
            await relay(self.api.state.proxy, endpoint, scope, receive, send)
            return
        if not path.startswith(OWN_PATHS):
            await pass_through(self.api.state.proxy, scope, receive, send)
            return
        if is_admin_path(path) and not self.admin.allows(scope["headers"]):
            status, message = self.admin.refusal()
            await send_error(send, status, message, "permission_denied",
                             (header(scope, REQUEST_ID) or b"-").decode("latin-1"))
            return
        await self.api(scope, receive, send)


def create_app(
    settings: Settings, registry: CollectorRegistry | None = None, freeze_heap: bool = False
) -> Phasewatch:
    """Build the proxy app. Pass `registry` to read its metrics from a test; else a fresh one.

    `freeze_heap` is for the process that runs only this app (`phasewatch serve`): once
    started, everything built so far lives as long as the process, so it is moved out of the
    cyclic collector's reach (`gc.freeze`) and no full collection walks it while streams
    wait.
    """
    registry = registry if registry is not None else CollectorRegistry()
    token = settings.admin_token.get_secret_value() if settings.admin_token else None
    admin = AdminAccess(token, settings.admin_open)
    # One process's metrics, or every worker's; rendered at most once per metrics_cache_s.
    exposition = Exposition(registry, settings.metrics_dir, settings.metrics_cache_s)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
        metrics = ProxyMetrics(registry, settings.slo_ttft_s, settings.slo_itl_s)
        otel = None
        if settings.otel_enabled:  # only then is OpenTelemetry imported (app/phasewatch/otel)
            check_otel(os.environ)
            from phasewatch.otel.export import OtelExport
            otel = OtelExport(settings.slo_ttft_s, settings.slo_itl_s,
                              settings.otel_provider_name, settings.upstream_base)
        engine = create_engine(settings.database_url)
        try:
            await prepare_schema(engine, settings.database_url, settings.database_auto_upgrade)
        except Exception:
            await engine.dispose()
            raise
        app.state.sessionmaker = create_sessionmaker(engine)
        records = RecordQueue(settings.record_queue_size, metrics.records_dropped.inc,
                              metrics.record_queue_depth.set)
        writer = RecordWriter(records, engine, metrics, settings.writer_batch_size,
                              settings.writer_flush_interval_s)
        session = create_upstream_session(settings)
        pool = UpstreamPool(settings.upstream_base, settings.upstream_connect_timeout_s,
                            settings.upstream_max_connections,
                            poll_set=PollSet(asyncio.get_running_loop()))
        live = LiveStreams(settings.upstream_idle_timeout_s, settings.stall_threshold_s,
                           LiveGauges(registry), settings.live_snapshot_max_requests,
                           settings.client_stall_timeout_s,
                           gauges_each_pass=exposition.multiprocess)
        # A scrape of this process counts every token relayed before it
        # (app/phasewatch/proxy/live.py).
        exposition.before_render = live.before_render
        app.state.proxy = ProxyContext(
            settings=settings,
            session=session,
            pool=pool,
            metrics=metrics,
            labels=ModelLabels(settings.max_model_labels),
            records=records,
            upstream=settings.upstream_base,
            live=live,
            admin=admin,
            shutdown=Shutdown(live, settings.shutdown_grace_s),
            loop=asyncio.get_running_loop(),
            passthrough_timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=settings.upstream_connect_timeout_s,
                sock_read=settings.upstream_idle_timeout_s),
            # prometheus_client keeps no exemplars under several workers.
            exemplars=settings.exemplars and not exposition.multiprocess,
            otel=otel,
            native=native_relay(settings.native_relay, metrics.native_failures.inc),
        )
        live.native = app.state.proxy.native
        retention = timedelta(days=settings.retention_days) if settings.retention_days else None
        tasks = [
            asyncio.create_task(writer.run(), name="record-writer"),
            asyncio.create_task(live.run(), name="live-streams"),
        ]
        # Every process publishes its requests in flight, so any of them diagnoses from the
        # live state of all (docs/diagnosis.md, "Requests still in flight").
        app.state.live_publisher = LivePublisher(
            app.state.proxy.live.snapshot, app.state.sessionmaker,
            settings.live_snapshot_interval_s,
            keep_s=max(settings.diagnosis_live_max_age_s, 3 * settings.live_snapshot_interval_s),
            max_requests=settings.live_snapshot_max_requests)
        if settings.live_snapshot_interval_s > 0:
            tasks.append(asyncio.create_task(app.state.live_publisher.run(),
                                             name="live-publisher"))
        # Retention, the engine scrape and the diagnosis schedule run once per database, in the
        # one process (of every worker and replica) that leads; every process answers the API.
        duties: dict[str, Duty] = {"retention": lambda: run_retention(
            engine, retention, settings.retention_interval_s)}
        scraper = None
        if settings.engine_metrics_target is not None:
            # The engine's own metrics corroborate what the records show (docs/diagnosis.md).
            scraper = EngineScraper(
                settings.engine_metrics_target, settings.engine_scrape_interval_s,
                settings.engine_scrape_timeout_s,
                keep_s=settings.diagnosis_window_s + settings.diagnosis_baseline_s + 60,
                sessionmaker=app.state.sessionmaker, metrics=EngineScrapeMetrics(registry))
            duties["engine-scraper"] = scraper.run
        app.state.diagnosis = DiagnosisService(
            app.state.sessionmaker, settings,
            DiagnosisMetrics(registry, multiprocess=exposition.multiprocess),
            fresh_engine=None if scraper is None else scraper.fresh)
        if settings.diagnosis_interval_s > 0:
            duties["diagnosis"] = app.state.diagnosis.run
        if settings.capacity_interval_s > 0:
            # The SLO headroom per model, for autoscalers (docs/plan.md).
            duties["capacity"] = CapacityService(
                app.state.sessionmaker, settings,
                CapacityMetrics(registry, multiprocess=exposition.multiprocess)).run
        app.state.leadership = Leadership(
            leader_lock(settings.database_url), duties, settings.leader_check_interval_s,
            LeadershipMetrics(registry))
        tasks.append(asyncio.create_task(app.state.leadership.run(), name="leadership"))
        if freeze_heap:
            gc.collect()
            gc.freeze()
        log.info("phasewatch %s relaying to %s, storing in %s", __version__,
                 settings.upstream_base, make_url(settings.database_url).render_as_string())
        shutdown: Shutdown = app.state.proxy.shutdown
        shutdown.install()  # under `phasewatch serve`: SIGTERM drains, a second one ends
        app.state.writer = writer
        arrivals = KernelArrivals()  # a connection's first request: its first byte's receipt
        try:
            # The server protocol starts the drain when uvicorn starts shutting down, however
            # the signal reached it (app/phasewatch/proxy/client_leg.py).
            state: dict[str, Any] = {SHUTDOWN_HOOK: shutdown.begin, ARRIVALS: arrivals,
                                     HEAD_TIMEOUT: settings.client_head_timeout_s}
            yield state
        finally:
            arrivals.close()
            shutdown.uninstall()
            exposition.before_render = None
            shutdown.end_streams()  # none should be left by now; none may outlive the app
            if app.state.proxy.native is not None:
                app.state.proxy.native.close()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await session.close()
            pool.close()
            # The records and the last OpenTelemetry export, side by side in the same bound.
            await asyncio.gather(
                writer.flush(timeout_s=settings.shutdown_flush_s),
                *([otel.shutdown(settings.shutdown_flush_s)] if otel is not None else []))
            await writer.close()
            await engine.dispose()

    app = FastAPI(title="phasewatch", version=__version__, lifespan=lifespan)
    app.state.registry = registry
    app.state.settings = settings  # the API's bounds (api/budget.py, api/stats.py)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(HTTPException, http_error)
    for error in DATABASE_ERRORS:
        app.add_exception_handler(error, database_error)
    for router in (requests_api.router, runs_api.router, stats_api.router, diagnosis_api.router,
                   probes_api.router):
        app.include_router(router, dependencies=[Depends(reject_nul)])

    @app.get("/metrics", include_in_schema=False)
    async def metrics(request: Request) -> Response:
        data, content_type = await exposition.latest(request.headers.get("accept", ""))
        return Response(data, media_type=content_type)

    return Phasewatch(app, admin)


def serve_app() -> Phasewatch:
    """The app `phasewatch serve` runs in each of its processes (uvicorn's factory, so that
    every worker builds its own): settings from the environment, where the command put its
    flags."""
    settings = load_settings()
    pid = " [%(process)d]" if settings.workers > 1 else ""
    logging.basicConfig(level=settings.log_level.upper(),
                        format=f"%(levelname)s %(name)s{pid}: %(message)s")
    # The relay's event loop shares the GIL with background threads (the diagnosis's
    # statistics, the SQLite driver, the OpenTelemetry exporter): a thread computing yields it
    # to the loop within the switch interval, 0.5 ms here instead of CPython's 5 ms, so no
    # thread holds chunks back longer than that per wake-up (docs/benchmarks.md, "Garbage
    # collection and the GIL").
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    # A full collection walks every long-lived object: under load, every request in flight, a
    # pause each open stream feels. Full collections come after 100 middle ones (CPython: 10)
    # and young ones after 10,000 allocations (CPython: 700): fewer, still short pauses, for a
    # little cyclic garbage kept longer; reference counting frees nearly everything as before.
    # The measurements are in docs/benchmarks.md ("Garbage collection and the GIL").
    _, middle, _ = gc.get_threshold()
    gc.set_threshold(YOUNG_COLLECTION_AFTER, middle, FULL_COLLECTION_AFTER)
    return create_app(settings, freeze_heap=True)
