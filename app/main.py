"""The application factory: `create_app(settings)` wires the proxy together. Nothing at import time.

The lifespan builds the database engine (checking the schema), the record writer and retention
tasks, the upstream client and the metrics. Routes, in order: phasewatch's own (`/metrics`,
`/api/...`), the two timed inference paths, then a catch-all relaying the rest upstream.
No HTTP middleware: a BaseHTTPMiddleware doubles the per-chunk cost of a stream.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta

from fastapi import FastAPI, Response
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from sqlalchemy.engine import make_url
from starlette.exceptions import HTTPException
from starlette.routing import Route

from app import __version__
from app.api import requests as requests_api
from app.api import runs as runs_api
from app.api import stats as stats_api
from app.api.errors import http_error, validation_error
from app.core.db import create_engine, create_sessionmaker
from app.core.metrics import ProxyMetrics
from app.core.records import RecordQueue
from app.core.settings import Settings
from app.proxy.context import ProxyContext
from app.proxy.labels import ModelLabels
from app.proxy.passthrough import PassThrough
from app.proxy.relay import ENDPOINTS, Relay
from app.proxy.upstream import create_upstream_session
from app.store.migrate import prepare_schema
from app.store.retention import run_retention
from app.store.writer import RecordWriter

log = logging.getLogger(__name__)

ALL_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]


def create_app(settings: Settings, registry: CollectorRegistry | None = None) -> FastAPI:
    """Build the proxy app. Pass `registry` to read its metrics from a test; else a fresh one."""
    registry = registry if registry is not None else CollectorRegistry()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        metrics = ProxyMetrics(registry, settings.slo_ttft_s, settings.slo_itl_s)
        engine = create_engine(settings.database_url)
        try:
            await prepare_schema(engine, settings.database_url, settings.database_auto_upgrade)
        except Exception:
            await engine.dispose()
            raise
        app.state.sessionmaker = create_sessionmaker(engine)
        records = RecordQueue(settings.record_queue_size, metrics.records_dropped.inc)
        writer = RecordWriter(records, engine, metrics, settings.writer_batch_size,
                              settings.writer_flush_interval_s)
        session = create_upstream_session(settings)
        app.state.proxy = ProxyContext(
            settings=settings,
            session=session,
            metrics=metrics,
            labels=ModelLabels(settings.max_model_labels),
            records=records,
            upstream=settings.upstream_base,
        )
        retention = timedelta(days=settings.retention_days) if settings.retention_days else None
        tasks = [
            asyncio.create_task(writer.run(), name="record-writer"),
            asyncio.create_task(
                run_retention(engine, retention, settings.retention_interval_s), name="retention"
            ),
        ]
        log.info("phasewatch %s relaying to %s, storing in %s", __version__,
                 settings.upstream_base, make_url(settings.database_url).render_as_string())
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await session.close()
            await writer.flush(timeout_s=10)
            await engine.dispose()

    app = FastAPI(title="phasewatch", version=__version__, lifespan=lifespan)
    app.state.registry = registry
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(HTTPException, http_error)
    for router in (requests_api.router, runs_api.router, stats_api.router):
        app.include_router(router)

    @app.get("/metrics", include_in_schema=False)
    def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/api/health")
    def health() -> dict[str, str]:
        """phasewatch's own liveness; `/health` is the upstream's, relayed."""
        return {"status": "ok", "version": __version__, "upstream": settings.upstream_base}

    for path, endpoint in ENDPOINTS.items():
        app.router.routes.append(Route(path, Relay(endpoint), methods=["POST"]))
    app.router.routes.append(Route("/{path:path}", PassThrough(), methods=ALL_METHODS))
    return app
