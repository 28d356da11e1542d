"""`GET /api/health` (liveness) and `GET /api/ready` (readiness): what orchestrators probe.

Open to every caller (app/phasewatch/core/admin.py keeps them out of the admin surface): they say
nothing about traffic. Liveness is the process answering at all; readiness says whether this process
should be sent traffic.
"""

from __future__ import annotations

import os
from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from phasewatch import __version__
from phasewatch.api.errors import ErrorResponse, error_response
from phasewatch.proxy.shutdown import Stage

router = APIRouter()


class Health(BaseModel):
    status: Literal["ok"] = Field(description="Always `ok`: the process answers.")
    version: str = Field(description="phasewatch's version.")
    upstream: str = Field(description="The engine's base URL this process relays to.")
    pid: int = Field(description="The process that answered (one of `--workers`).")
    role: Literal["leader", "follower", "stopped"] = Field(
        description="`leader`: this process runs retention, the diagnosis schedule and the "
                    "engine scrape for its database; `follower`: another does; `stopped`: "
                    "shutting down.")
    native_relay: Literal["running", "failed", "off"] = Field(
        description="The native relay's thread: `running`; `failed` (the streams it held ended "
                    "with an in-band error, every stream is relayed in Python since, and "
                    "`phasewatch_native_relay_failures_total` counted it); `off` (turned off, "
                    "not Linux, or another server).")


class Ready(BaseModel):
    status: Literal["ready"] = Field(description="Always `ready`; not ready answers 503.")


@router.get("/api/health", response_model=Health, operation_id="getHealth")
def health(request: Request) -> Health:
    """phasewatch's own liveness; `/health` is the upstream's, relayed."""
    state = request.app.state
    native = state.proxy.native
    return Health(status="ok", version=__version__, upstream=state.settings.upstream_base,
                  pid=os.getpid(), role=state.leadership.role.value,
                  native_relay="off" if native is None else "failed" if native.failed
                  else "running")


@router.get("/api/ready", response_model=Ready, operation_id="getReadiness", responses={
    503: {"model": ErrorResponse, "description": "Not ready (`not_ready`): shutting down, or "
          "records have not been stored for `PHASEWATCH_READY_WRITER_FAILING_S`."}})
def ready(request: Request) -> JSONResponse:
    """Readiness: whether this process should be sent traffic. 503 from the moment it starts
    shutting down (SIGTERM), and while its record writer has failed to store for longer than
    `PHASEWATCH_READY_WRITER_FAILING_S`; `/api/health` is liveness only."""
    state = request.app.state
    reasons = []
    if state.proxy.shutdown.stage is not Stage.SERVING:
        reasons.append(f"shutting down ({state.proxy.shutdown.stage.value})")
    failing_s = state.writer.failing_for_s()
    if failing_s > state.settings.ready_writer_failing_s:
        reasons.append(f"records have not been stored for {failing_s:.0f} s")
    if reasons:
        return error_response(503, "not ready: " + "; ".join(reasons), "not_ready")
    return JSONResponse({"status": "ready"})
