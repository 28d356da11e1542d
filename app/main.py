"""The application factory: `create_app(settings)` wires the proxy together. Nothing at import time.

Routes, in order: phasewatch's own (`/metrics`, `/api/...`), the two timed inference paths,
then a catch-all that relays everything else to the upstream. No HTTP middleware: a
BaseHTTPMiddleware doubles the per-chunk cost of a stream.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.routing import Route

from app import __version__
from app.core.metrics import ProxyMetrics
from app.core.settings import Settings
from app.proxy.context import ProxyContext
from app.proxy.labels import ModelLabels
from app.proxy.passthrough import PassThrough
from app.proxy.records import RecordQueue
from app.proxy.relay import ENDPOINTS, Relay
from app.proxy.upstream import create_upstream_session

log = logging.getLogger(__name__)

ALL_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]


def create_app(settings: Settings, registry: CollectorRegistry | None = None) -> FastAPI:
    """Build the proxy app. Pass `registry` to read its metrics from a test; else a fresh one."""
    registry = registry if registry is not None else CollectorRegistry()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        metrics = ProxyMetrics(registry, settings.slo_ttft_s, settings.slo_itl_s)
        session = create_upstream_session(settings)
        app.state.proxy = ProxyContext(
            settings=settings,
            session=session,
            metrics=metrics,
            labels=ModelLabels(settings.max_model_labels),
            records=RecordQueue(settings.record_queue_size, metrics.records_dropped.inc),
            upstream=settings.upstream_base,
        )
        log.info("phasewatch %s relaying to %s", __version__, settings.upstream_base)
        try:
            yield
        finally:
            await session.close()

    app = FastAPI(title="phasewatch", version=__version__, lifespan=lifespan)
    app.state.registry = registry

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
