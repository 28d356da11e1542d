"""What `GET /api/stats` answers: windowed aggregates per group, declared for the OpenAPI
document.

Declarations only (app/phasewatch/api/encoding.py). The figures are
app/phasewatch/store/window_stats.py's `GroupStats`; their definitions are README, "Read API".
Percentiles are nearest rank.
"""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, Field

from phasewatch.store.window_stats import GroupBy


class Percentiles(BaseModel):
    """Nearest-rank percentiles, seconds; null where no request has the figure."""

    p50: float | None = Field(description="50th percentile (median), seconds.")
    p90: float | None = Field(description="90th percentile, seconds.")
    p95: float | None = Field(description="95th percentile, seconds.")
    p99: float | None = Field(description="99th percentile, seconds.")


class StatsGroup(BaseModel):
    """Aggregates of one group's requests over the window. Counts, rates, throughputs,
    `itl_mean_s` and the in-flight figures are exact; percentiles come from `sampled` of the
    group's requests."""

    group: str | None = Field(description="The model or endpoint (`by`); null for `by=none`, "
                              "or for requests whose body named no model.")
    requests: int = Field(description="Requests that arrived in the window (count).")
    errors: int = Field(description="Of them, requests with any outcome but `ok` (count).")
    request_rate_rps: float = Field(description="Requests / window (requests/s).")
    ttft_s: Percentiles = Field(description="TTFT, seconds, over requests that got a first "
                                "token.")
    itl_mean_s: float | None = Field(description="Mean inter-token latency, seconds, "
                                     "token-weighted: all gap time / all token gaps. Null "
                                     "without a token gap.")
    itl_p50_s: Percentiles = Field(description="Percentiles across requests of each "
                                   "request's own ITL p50, seconds (the per-token "
                                   "distribution is in the Prometheus histogram).")
    itl_p95_s: Percentiles = Field(description="Percentiles across requests of each "
                                   "request's own ITL p95, seconds.")
    tpot_p50_s: float | None = Field(description="Median time per output token, seconds, "
                                     "over `ok` requests.")
    e2e_p50_s: float | None = Field(description="Median end-to-end latency, seconds, over "
                                    "`ok` requests.")
    prompt_tokens_p50: float | None = Field(description="Median prompt length, tokens, over "
                                            "requests whose usage said.")
    output_throughput_tps: float = Field(description="Output tokens of `ok` requests / "
                                         "window (tokens/s).")
    prompt_throughput_tps: float = Field(description="Prompt tokens of `ok` requests / "
                                         "window (tokens/s).")
    in_flight_mean: float | None = Field(description="Mean of the requests already in flight "
                                         "when each request arrived (requests).")
    in_flight_max: int | None = Field(description="The most requests in flight at any "
                                      "request's arrival (requests).")
    sampled: int = Field(description="Requests the percentiles come from: all of the group's, "
                         "or its share of the window's sample (count).")


class StatsSample(BaseModel):
    """How many requests the percentiles come from, of how many the window holds."""

    rows: int = Field(description="Requests ranked for the percentiles: all, or a uniform "
                      "sample of at most about `PHASEWATCH_API_MAX_ROWS` (count).")
    of: int = Field(description="Requests in the window, in the groups answered (count).")


class Stats(BaseModel):
    """Aggregates of the requests that arrived in [`since`, `until`), per group."""

    window_s: float = Field(description="The window's length, seconds.")
    since: datetime = Field(description="The window's start (inclusive), UTC.")
    until: datetime = Field(description="The window's end (exclusive), UTC.")
    by: GroupBy = Field(description="What the groups are: each `model`, each `endpoint`, or "
                        "one group of every request (`none`).")
    sample: StatsSample = Field(description="How many requests the percentiles come from "
                                "(`rows`) of how many the window holds (`of`).")
    groups_left_off: bool = Field(description="True when the window had more than 1,000 "
                                  "groups: only the busiest are answered.")
    groups: list[StatsGroup] = Field(description="One per group, by group name.")
