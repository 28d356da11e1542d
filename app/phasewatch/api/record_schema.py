"""What `GET /api/requests` answers: stored request records, declared for the OpenAPI document.

Declarations only: the route returns the rows encoded by orjson (app/phasewatch/api/encoding.py) and
never builds these models. The fields are the `requests` table's columns
(app/phasewatch/store/models.py); what each figure means is README, "What each figure means".
"""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, Field

from phasewatch.core.records import Outcome


class StoredRequest(BaseModel):
    """One proxied inference request, with every figure the proxy measured. Intervals are
    seconds on the proxy's monotonic clock, from the request's arrival (its first bytes read)."""

    id: int = Field(description="The record's key; pages are cut by it (`cursor`).")
    request_id: str = Field(description="The client's `x-request-id`, or one phasewatch made "
                            "(at most 128 characters).")
    started_at: datetime = Field(description="Arrival, wall clock, UTC.")
    endpoint: str = Field(description="`completions` or `chat.completions`.")
    model: str | None = Field(description="The model asked for, as labels keep it (control "
                              "characters replaced, at most 128 characters); null when the "
                              "body named none.")
    upstream: str = Field(description="The upstream base URL the request was relayed to.")
    stream: bool = Field(description="Whether the client asked for a stream.")
    outcome: Outcome = Field(description="How the request ended (README, \"Outcomes\").")
    http_status: int | None = Field(description="The HTTP status sent to the client; null "
                                    "when it ended before one was sent.")
    in_flight_at_arrival: int = Field(description="Inference requests already open in this "
                                      "proxy when it arrived (requests).")
    ttft_s: float | None = Field(description="Time to first token, seconds: arrival to the "
                                 "read that completed the first event carrying a token. Null "
                                 "without one (not streamed, or no token came).")
    e2e_s: float | None = Field(description="End to end, seconds: arrival to the last read "
                                "of the response. Null when it has no end (nothing came back).")
    tpot_s: float | None = Field(description="Time per output token, seconds: (E2E - TTFT) / "
                                 "(output tokens - 1). Null without a TTFT or an E2E, or with "
                                 "fewer than 2 output tokens.")
    itl_count: int = Field(description="Token gaps (inter-token latency samples) of this "
                           "request: one per token after the first (count).")
    itl_mean_s: float | None = Field(description="Mean inter-token latency, seconds, over "
                                     "this request's token gaps; null with none.")
    itl_p50_s: float | None = Field(description="Median inter-token latency, seconds "
                                    "(nearest rank, over this request's token gaps).")
    itl_p95_s: float | None = Field(description="95th percentile inter-token latency, "
                                    "seconds (nearest rank, over this request's token gaps).")
    itl_max_s: float | None = Field(description="Longest token gap of this request, seconds.")
    prompt_tokens: int | None = Field(description="Prompt tokens, from the upstream's "
                                      "`usage` (tokens); null when it did not say.")
    output_tokens: int | None = Field(description="Output tokens, from the upstream's `usage` "
                                      "(tokens); null when it did not say.")
    tokens_exact: bool = Field(description="Whether tokens were counted chunk by chunk from "
                               "running usage (true), or spread from the final usage "
                               "(README, \"What each figure means\").")
    run_id: str | None = Field(description="The benchmark run it belongs to "
                               "(`x-phasewatch-run-id`, honoured with the admin token only).")
    error: str | None = Field(description="A short reason for an outcome other than `ok`; "
                              "never prompt or completion text.")


class RequestPage(BaseModel):
    """A page of stored requests, newest first."""

    items: list[StoredRequest] = Field(description="At most `limit` records, newest first.")
    next_cursor: int | None = Field(description="Pass as `cursor` for the next page; null on "
                                    "the last one.")
