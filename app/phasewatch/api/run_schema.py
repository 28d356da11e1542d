"""What `GET /api/runs` and `GET /api/runs/{id}` answer: stored benchmark runs and their points,
declared for the OpenAPI document.

Declarations only (app/phasewatch/api/encoding.py). The fields are the `runs` and `run_points`
columns (app/phasewatch/store/models.py); the bench's definitions of each figure: docs/bench.md,
"What every figure means". `parameters`, `engine`, `summary` and `extra` are JSON objects whose keys
depend on the mode and the server: declared as free-form objects, described in docs/bench.md, "Where
runs are stored".
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, Field


class StoredRun(BaseModel):
    """A named benchmark or experiment against one target."""

    id: str = Field(description="The run's id, also the `x-phasewatch-run-id` its requests "
                    "carried: `<mode>-<YYYYmmdd-HHMMSS>-<4 hex>` for `phasewatch bench`.")
    name: str = Field(description="A name for people.")
    kind: str = Field(description="The bench mode (`prompt`, `concurrency`, `interference`, "
                      "`rate`, `goodput`), or another kind of experiment.")
    target: str = Field(description="The URL the run was sent to.")
    status: str = Field(description="`running`, `finished` or `failed`.")
    parameters: dict[str, Any] = Field(description="The mode's options, the model, how prompt "
                                       "tokens were counted, the clock (docs/bench.md).")
    engine: dict[str, Any] = Field(description="What the server told of itself: version, "
                                   "max_model_len, cache config, the simulator's settings, "
                                   "phasewatch in between (docs/bench.md).")
    started_at: datetime = Field(description="When the run started, UTC.")
    finished_at: datetime | None = Field(description="When it ended, UTC; null while running.")
    summary: dict[str, Any] | None = Field(description="The mode's summary (goodput's best "
                                           "rate, interference's long TTFT, phasewatch's "
                                           "records found); null while running.")


class StoredRunPoint(BaseModel):
    """One step of a run's sweep: the x value and the figures the bench client measured there.
    Latencies are seconds; ITL is per chunk, as `vllm bench` counts it (docs/bench.md)."""

    id: int = Field(description="The point's key.")
    run_id: str = Field(description="The run it belongs to.")
    step: int = Field(description="Its place in the sweep, from 0.")
    x_name: str = Field(description="What the sweep varies: `prompt_tokens`, `concurrency`, "
                        "`rate`, `phase`, ...")
    x_value: float = Field(description="The value of `x_name` at this step, in its unit: "
                           "tokens for `prompt_tokens`, streams for `concurrency`, requests/s "
                           "for `rate`.")
    requests: int = Field(description="Requests sent at this step (count).")
    errors: int = Field(description="Of them, requests that failed (count); left out of every "
                        "latency and token figure.")
    concurrency: float | None = Field(description="Achieved concurrency: the mean number of "
                                      "requests open on the client (requests; Little's law).")
    ttft_p50_s: float | None = Field(description="TTFT p50, seconds: send to the first output "
                                     "event, over the step's successful requests.")
    ttft_p90_s: float | None = Field(description="TTFT p90, seconds.")
    ttft_p95_s: float | None = Field(description="TTFT p95, seconds.")
    ttft_p99_s: float | None = Field(description="TTFT p99, seconds.")
    itl_p50_s: float | None = Field(description="ITL p50, seconds: gaps between output events "
                                    "(one per chunk), all successful requests' pooled.")
    itl_p90_s: float | None = Field(description="ITL p90, seconds.")
    itl_p95_s: float | None = Field(description="ITL p95, seconds.")
    itl_p99_s: float | None = Field(description="ITL p99, seconds.")
    output_throughput_tps: float | None = Field(description="Output tokens of successful "
                                                "requests / the step's span (tokens/s).")
    total_throughput_tps: float | None = Field(description="(Prompt + output) tokens of "
                                               "successful requests / span (tokens/s).")
    goodput_rps: float | None = Field(description="Good requests / span (requests/s): "
                                      "successful, TTFT at most the TTFT objective and TPOT at "
                                      "most the ITL objective, each request judged on its own "
                                      "(docs/bench.md, \"Goodput\"); null without an SLO.")
    extra: dict[str, Any] | None = Field(description="What has no column: `figures` (TPOT, "
                                         "E2E, token counts, request rate, ...), `repeats`, "
                                         "`spread`, `proxy` (phasewatch's own figures for the "
                                         "same requests), mode details (docs/bench.md).")


class RunPage(BaseModel):
    """A page of stored runs, newest first."""

    items: list[StoredRun] = Field(description="At most `limit` runs, newest first.")
    next_cursor: datetime | None = Field(description="Pass as `cursor` for the next page (the "
                                         "last run's start); null on the last page.")


class RunWithPoints(StoredRun):
    """A stored run with every point of its sweep."""

    points: list[StoredRunPoint] = Field(description="The sweep's points, by step.")
