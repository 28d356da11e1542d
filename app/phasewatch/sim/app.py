"""`create_sim_app(settings)`: the simulator as an ASGI app, built in its lifespan.

Config is resolved (and refused with a clear sentence) when the app is created; the registry,
metrics, clock, scheduler and engine are built when the server starts, kept on
`app.state.sim`, and torn down when it stops. Nothing is created at import time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from phasewatch.sim.api import router
from phasewatch.sim.config import (
    ResolvedConfig,
    SimSettings,
    load_sim_settings,
    resolve,
    scheduler_config,
    scheduler_for,
    with_chunked_prefill,
)
from phasewatch.sim.engine import Engine, ModelClock
from phasewatch.sim.faults import Fault, parse_fault
from phasewatch.sim.metrics import SimMetrics
from phasewatch.sim.protocol import ServedModel
from phasewatch.sim.tokenizer import Tokenizer

log = logging.getLogger("phasewatch.sim")

TIME_SCALE_HEADER = b"x-sim-time-scale"


@dataclass(slots=True)
class SimState:
    # `settings` and `config` change only through `set_chunked_prefill`; the rest is fixed.
    settings: SimSettings
    config: ResolvedConfig
    registry: CollectorRegistry
    metrics: SimMetrics
    engine: Engine
    tokenizer: Tokenizer
    served: ServedModel
    server_fault: Fault | None
    seed: int
    eos_probability: float
    started: int  # unix seconds, for /v1/models

    def set_chunked_prefill(self, enabled: bool) -> ResolvedConfig:
        """Switch chunked prefill while serving; the scheduler plans its next step with the
        budget the new setting resolves to. vLLM reads the flag once, at start: the simulator
        lets one benchmark compare both settings (`phasewatch bench interference
        --chunked-prefill both`). Raises SimConfigError if the new setting cannot work."""
        settings = with_chunked_prefill(self.settings, enabled)
        config = resolve(settings)
        self.engine.scheduler.config = scheduler_config(config)
        self.settings, self.config = settings, config
        log.info("chunked prefill switched %s: max_num_batched_tokens=%d",
                 "on" if enabled else "off", config.max_num_batched_tokens)
        return config


def startup_line(config: ResolvedConfig) -> str:
    scale = config.time_scale
    clock = (
        "real time"
        if scale == 1
        else f"time-scale {scale:g}: every modelled duration takes {scale:g}x wall time; "
        "metrics and reported times are model seconds"
    )
    return (
        f"phasewatch sim: {config.model.hf_name} as '{config.served_model_name}' on "
        f"{config.gpu.description}; max_num_seqs={config.max_num_seqs} "
        f"max_num_batched_tokens={config.max_num_batched_tokens} "
        f"chunked_prefill={'on' if config.enable_chunked_prefill else 'off'} "
        f"kv_blocks={config.num_kv_blocks}x{config.block_size} "
        f"max_model_len={config.max_model_len}; {clock}"
    )


class _DropIncompleteResponseLog(logging.Filter):
    """uvicorn logs an error when a response ends unfinished; the disconnect fault does that on
    purpose, so that one message is dropped while the simulator runs."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "returned without completing response" not in record.getMessage()


class TimeScaleHeader:
    """Pure-ASGI middleware: every response says which time scale produced it."""

    def __init__(self, app: ASGIApp, time_scale: float) -> None:
        self.app = app
        self.value = f"{time_scale:g}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (TIME_SCALE_HEADER, self.value)]
            await send(message)

        await self.app(scope, receive, send_with_header)


def create_sim_app(settings: SimSettings | None = None) -> FastAPI:
    """The simulator app. Raises SimConfigError now if the settings cannot work."""
    settings = settings or load_sim_settings()
    config = resolve(settings)
    server_fault = parse_fault(settings.fault) if settings.fault else None

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        registry = CollectorRegistry()
        metrics = SimMetrics(registry, config.served_model_name)
        scheduler = scheduler_for(config)
        engine = Engine(
            scheduler,
            ModelClock(config.time_scale),
            metrics,
            request_overhead_s=config.request_overhead_s,
            timeline_capacity=settings.timeline_capacity,
        )
        tokenizer = Tokenizer(config.vocab_size, seed=settings.seed)
        app.state.sim = SimState(
            settings=settings,
            config=config,
            registry=registry,
            metrics=metrics,
            engine=engine,
            tokenizer=tokenizer,
            served=ServedModel(config.served_model_name, config.max_model_len, tokenizer),
            server_fault=server_fault,
            seed=settings.seed,
            eos_probability=settings.eos_probability,
            started=int(time.time()),
        )
        log_filter = _DropIncompleteResponseLog()
        uvicorn_log = logging.getLogger("uvicorn.error")
        uvicorn_log.addFilter(log_filter)
        engine.start()
        log.info(startup_line(config))
        try:
            yield
        finally:
            await engine.stop()
            uvicorn_log.removeFilter(log_filter)

    app = FastAPI(
        title="phasewatch sim", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.include_router(router)
    app.add_middleware(TimeScaleHeader, time_scale=config.time_scale)
    return app
