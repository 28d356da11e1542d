"""The evidence behind a diagnosis (`evidence` of `GET /api/diagnosis` and of its history),
declared for the OpenAPI document.

Declarations only: the diagnosis builds these as plain dicts (app/phasewatch/diagnosis/diagnose.py
and the `evidence()` of each comparison) and the route encodes them with orjson
(app/phasewatch/api/encoding.py). What each comparison and rule means: docs/diagnosis.md, "Method".

Every ratio is window / baseline. A figure the diagnosis could not compute (too few values,
a division by zero) is null; a key marked "absent when ..." is left out of the object then.
With `insufficient_data` the evidence holds `method`, `rules`, `samples`, `engine`,
`ttft_proxy_vs_engine` and `checks.enough_samples` only. A window judged without a baseline
(`checks.baseline_free`) holds those, `notes`, `slo` and the checks it read.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from phasewatch.diagnosis.verdicts import Verdict


class DiagnosisRules(BaseModel):
    """The thresholds and test settings the diagnosis ran with (ratios are window /
    baseline)."""

    min_samples: int = Field(description="Timed requests each side needs, below which nothing "
                             "is judged (requests).")
    alpha: float = Field(description="One-sided significance level of each test.")
    ttft_ratio: float = Field(description="A material TTFT rise (ratio).")
    itl_ratio: float = Field(description="A material ITL rise (ratio).")
    prompt_ratio: float = Field(description="Prompts materially longer, mean tokens (ratio).")
    rate_ratio: float = Field(description="Materially more requests per second (ratio).")
    concurrency_ratio: float = Field(description="Materially more requests in flight "
                                     "(ratio; evidence only).")
    spike_share: float = Field(description="Stalls: the rise in the share of spiking requests "
                               "that counts (fraction).")
    spike_factor: float = Field(description="A spike: a stall factor past this multiple of "
                                "the baseline's p90 stall factor ...")
    min_stall: float = Field(description="... and past this stall factor (longest gap / "
                             "median gap).")
    long_prompt_factor: float = Field(description="A long prompt: this multiple of the "
                                      "baseline's median prompt length.")
    min_overlap_share: float = Field(description="Share of spikes that must overlap long "
                                     "prefills (fraction).")
    kv_full: float = Field(description="Engine KV cache usage counted as near full "
                           "(fraction, 0-1).")
    min_itl_gaps: int = Field(description="Token gaps a request needs for its median gap to "
                              "count (gaps).")
    min_stall_gaps: int = Field(description="Token gaps a request needs for its stall factor "
                                "to count (gaps).")
    min_stratum: int = Field(description="Baseline requests a prompt octave needs for a "
                             "median (requests).")
    min_coverage: float = Field(description="Share of the window that TTFT at equal prompt "
                                "length must cover (fraction).")
    rounds: int = Field(description="Bootstrap replicates.")
    seed: int = Field(description="The bootstrap's seed: equal inputs give equal findings.")
    slo_ttft_s: float | None = Field(description="The TTFT SLO threshold, seconds "
                                     "(`PHASEWATCH_SLO_TTFT_S`); null: no SLO.")
    slo_itl_s: float | None = Field(description="The ITL SLO threshold, seconds "
                                    "(`PHASEWATCH_SLO_ITL_S`); null: no SLO.")
    slo_share: float = Field(description="A rise matters when the window's p95 reaches this "
                             "share of its SLO threshold (fraction) ...")
    large_rise: float = Field(description="... or when the rise is at least this ratio, "
                              "whatever the SLO.")
    queue_negligible_share: float = Field(description="The engine's mean queue time under "
                                          "this share of the window's TTFT median is no "
                                          "queue (fraction).")


class SampleEvidence(BaseModel):
    """One side's requests (the window's, or the baseline's)."""

    requests: int = Field(description="Requests in the span (count).")
    read: int = Field(description="Requests read: fewer than `requests` when a large span was "
                      "evenly thinned (`PHASEWATCH_DIAGNOSIS_MAX_SAMPLES`).")
    timed: int = Field(description="Requests with a TTFT: finished `ok` with a first token, "
                       "and those in flight (count).")
    in_flight: int = Field(description="Requests still in flight, from the live snapshots "
                           "(count; 0 for the baseline).")
    in_flight_waiting: int = Field(description="Of them, still waiting for their first token "
                                   "(count).")
    errors: int = Field(description="Requests read that did not end `ok` (count).")
    error_share: float | None = Field(description="errors / read (fraction); null when none "
                                      "was read.")
    span_s: float | None = Field(description="The part of the span that had traffic, seconds: "
                                 "first arrival to its end, widened by one mean gap.")
    rate_rps: float | None = Field(description="requests / span_s (requests/s).")


class SamplesEvidence(BaseModel):
    window: SampleEvidence = Field(description="The window's requests.")
    baseline: SampleEvidence = Field(description="The baseline's requests.")


class EngineEvidence(BaseModel):
    """The engine's own figures over the window, from the stored scrapes of its `/metrics`."""

    scrapes: int = Field(description="Scrapes that fell in the window (count).")
    waiting_mean: float | None = Field(description="Requests waiting for a slot, mean over "
                                       "the scrapes (requests).")
    waiting_max: float | None = Field(description="... and the most (requests).")
    running_mean: float | None = Field(description="Requests in the running batch, mean "
                                       "(requests).")
    running_max: float | None = Field(description="... and the most (requests).")
    kv_cache_usage_mean: float | None = Field(description="KV cache in use, mean (fraction, "
                                              "0-1).")
    kv_cache_usage_max: float | None = Field(description="... and the most (fraction, 0-1).")
    preemptions: float | None = Field(description="Preemptions during the window (count).")
    ttft_count: float | None = Field(description="First tokens the engine observed in the "
                                     "window (count).")
    ttft_mean_s: float | None = Field(description="The engine's mean TTFT, seconds (exact, "
                                      "from its histogram's sum and count).")
    ttft_p50_s: float | None = Field(description="The engine's TTFT p50, seconds "
                                     "(interpolated in its buckets).")
    ttft_p95_s: float | None = Field(description="The engine's TTFT p95, seconds "
                                     "(interpolated in its buckets).")
    queue_time_mean_s: float | None = Field(description="The engine's mean time waiting for a "
                                            "slot per request, seconds.")
    metric_names: dict[str, str] = Field(description="Signal -> the engine metric name that "
                                         "had it (vLLM renames some across versions).")


class ProxyVsEngine(BaseModel):
    """The proxy's TTFT beside the engine's over the window."""

    proxy_mean_s: float | None = Field(description="The proxy's mean TTFT, seconds.")
    engine_mean_s: float | None = Field(description="The engine's mean TTFT, seconds.")
    gap_mean_s: float | None = Field(description="proxy - engine, seconds: network + proxy + "
                                     "the engine's frontend before its own clock.")
    proxy_p50_s: float | None = Field(description="The proxy's TTFT p50, seconds.")
    engine_p50_s: float | None = Field(description="The engine's TTFT p50, seconds "
                                       "(interpolated in its buckets).")
    note: str = Field(description="What the gap is.")


class Checks(BaseModel):
    """Every boolean the rules read (docs/diagnosis.md, "Which evidence decided"). Null: could
    not be judged (no SLO, no engine metrics, too few values). When `enough_samples` is false,
    only it is present, or (judged without a baseline) it, `baseline_free`, `window_meets_slo`
    and `engine_queue_empty`."""

    enough_samples: bool = Field(description="Both sides have `min_samples` timed requests.")
    ttft_rising: bool | None = Field(None, description="Raw TTFT rose (material and "
                                     "significant, or its tail moved).")
    ttft_rising_at_equal_prompt: bool | None = Field(None, description="TTFT rose at equal "
                                                     "prompt length and decode pace.")
    itl_rising: bool | None = Field(None, description="The requests' median token gap rose.")
    prompts_longer: bool | None = Field(None, description="Prompts got materially longer "
                                        "(mean tokens).")
    request_rate_rising: bool | None = Field(None, description="The request rate rose, "
                                             "materially and significantly.")
    concurrency_rising: bool | None = Field(None, description="More requests in flight at "
                                            "arrival.")
    stalls_rising: bool | None = Field(None, description="The share of streams stalling "
                                       "mid-output rose.")
    stalls_with_long_prefills: bool | None = Field(None, description="The stalls line up with "
                                                   "long prompts' prefills.")
    kv_pressure: bool | None = Field(None, description="The engine's KV cache near full and "
                                     "preempting; null without engine metrics.")
    ttft_rising_live: bool | None = Field(None, description="Requests in flight wait past the "
                                          "baseline's TTFT p99 more often than chance allows.")
    itl_rising_live: bool | None = Field(None, description="The streams decoding now are "
                                         "slower than the baseline's.")
    ttft_rise_matters: bool | None = Field(None, description="A TTFT rise matters against the "
                                           "SLO.")
    itl_rise_matters: bool | None = Field(None, description="An ITL rise matters against the "
                                          "SLO.")
    baseline_meets_slo: bool | None = Field(None, description="The baseline's p95s are within "
                                            "the SLO; null: no SLO.")
    window_meets_slo: bool | None = Field(None, description="The window's p95s are within the "
                                          "SLO; null: no SLO.")
    engine_queue_empty: bool | None = Field(None, description="The engine had nothing waiting "
                                            "and (where it reports it) negligible queue time "
                                            "over the window; null without engine metrics.")
    baseline_free: bool | None = Field(None, description="Judged from the window, the SLO and "
                                       "the engine alone: too few baseline requests.")


class ComparisonSide(BaseModel):
    """One side of a comparison, in the comparison's `unit`."""

    n: int = Field(description="Values compared (count).")
    median: float | None = Field(None, description="Their median, in `unit`; present when "
                                 "`center` is `median`.")
    mean: float | None = Field(None, description="Their mean, in `unit`; present when "
                               "`center` is `mean`.")
    p95: float | None = Field(description="Their 95th percentile, in `unit`.")


class Comparison(BaseModel):
    """One figure compared, window against baseline: did it rise, materially and
    significantly? (docs/diagnosis.md, "\\"Rising\\": material and significant")."""

    rising: bool = Field(description="Material and significant, or the tail moved.")
    material: bool = Field(description="The centre ratio is at least `threshold_ratio`.")
    significant: bool = Field(description="`p_value` is below the rules' `alpha`.")
    tail_rising: bool = Field(description="Even the low end of the p95 ratio's 95% interval "
                              "is past the threshold.")
    threshold_ratio: float = Field(description="The ratio that counts as material.")
    center: Literal["median", "mean"] = Field(description="What the centre is: the median, "
                                              "or the mean (prompt length, concurrency).")
    unit: str = Field(description="The unit of the sides' values: `s` (seconds), `tokens`, "
                      "or a phrase saying what they are.")
    window: ComparisonSide = Field(description="The window's values.")
    baseline: ComparisonSide = Field(description="The baseline's values.")
    ratio: float | None = Field(description="Window centre / baseline centre.")
    ratio_ci95: tuple[float | None, float | None] = Field(description="95% bootstrap interval "
                                                          "of `ratio`.")
    ratio_p95: float | None = Field(description="Window p95 / baseline p95.")
    ratio_p95_ci95: tuple[float | None, float | None] = Field(description="95% bootstrap "
                                                              "interval of `ratio_p95`.")
    p_value: float = Field(description="One-sided, window larger: Mann-Whitney U for a "
                           "median, the bootstrap for a mean.")
    effect_size: float = Field(description="P(a window value > a baseline value); 0.5: none.")
    support: float = Field(description="Share of bootstrap replicates with a material rise "
                           "(fraction, 0-1).")


class AdjustedComparison(Comparison):
    """TTFT at equal prompt length (and decode pace): each request's TTFT over the baseline's
    median at the same prompt octave, so a shift to long prompts is not read as queueing."""

    coverage: float | None = Field(description="Share of the window's requests (with a prompt "
                                   "length) judged (fraction).")
    strata: int = Field(description="Prompt octaves with a baseline median (count).")
    by_decode_pace: bool = Field(description="Also divided by each request's decode pace "
                                 "relative to the baseline's.")


class AdjustedMissing(BaseModel):
    """Why TTFT could not be judged at equal prompt length."""

    coverage: float | None = Field(description="Share of the window's requests the baseline "
                                   "covers (fraction).")
    strata: int = Field(description="Prompt octaves with a baseline median (count).")
    reason: str = Field(description="Why, in words.")


class StallSide(BaseModel):
    n: int = Field(description="Requests with enough token gaps for a stall factor (count).")
    spikes: int = Field(description="Of them, requests whose stall factor spiked (count).")
    share: float | None = Field(description="spikes / n (fraction).")
    stall_factor_p90: float | None = Field(description="p90 of the stall factors (longest "
                                           "gap / median gap; 1 for an even stream).")


class StallEvidence(BaseModel):
    """Mid-stream stalls, and whether they line up with long prefills (docs/diagnosis.md,
    "Stalls against overlapping long prefills")."""

    rising: bool = Field(description="The share of spiking requests rose by at least "
                         "`min_share_rise`, significantly.")
    with_long_prefills: bool = Field(description="The spikes line up with long prompts' "
                                     "prefills.")
    spike_threshold_stall_factor: float | None = Field(description="A request spikes at or "
                                                       "past this stall factor.")
    window: StallSide = Field(description="The window's requests.")
    baseline: StallSide = Field(description="The baseline's requests.")
    min_share_rise: float = Field(description="The rise in share that counts (fraction).")
    p_value: float = Field(description="Two-proportion z-test, window share larger.")
    support: float = Field(description="P(the share rose by `min_share_rise`), normal "
                           "approximation (0-1).")
    long_prompt_tokens: float | None = Field(description="What counts as a long prompt "
                                             "(tokens).")
    long_prefills_in_window: int = Field(description="Window requests with a long prompt "
                                         "(count).")
    requests_overlapping_long_prefills: int = Field(description="Window requests whose decode "
                                                    "overlapped a long prefill (count).")
    spikes_overlapping_long_prefills: int = Field(description="Of the spikes, those that did "
                                                  "(count).")
    association_p_value: float | None = Field(description="Spikes more frequent among "
                                              "overlapped requests; null with too few of "
                                              "either kind.")


class RequestRateEvidence(BaseModel):
    window_rps: float | None = Field(description="The window's request rate (requests/s).")
    baseline_rps: float | None = Field(description="The baseline's request rate "
                                       "(requests/s).")
    ratio: float | None = Field(description="window_rps / baseline_rps.")
    p_value: float = Field(description="Conditional binomial test of two Poisson counts, "
                           "window larger.")
    rising: bool = Field(description="Material (at least `threshold_ratio`) and significant.")
    threshold_ratio: float = Field(description="The ratio that counts as material.")


class LiveQueueEvidence(BaseModel):
    """Requests in flight waiting past the baseline's TTFT p99 (docs/diagnosis.md, "Requests
    still in flight")."""

    waiting: int = Field(description="Requests in flight still waiting for their first token "
                         "(count).")
    oldest_waiting_s: float | None = Field(description="The oldest one's age, seconds.")
    baseline_ttft_p99_s: float | None = Field(description="The baseline's TTFT p99, seconds.")
    waiting_past_baseline_p99: int = Field(description="Waiting requests already past it "
                                           "(count).")
    of: int = Field(description="Requests of the window it is counted over: timed and "
                    "waiting (count).")
    p_value: float = Field(description="Binomial tail at p = 0.01.")
    rising: bool = Field(description="At least 3 past it, and `p_value` below `alpha`.")
    note: str = Field(description="What a waiting request's TTFT is.")


class SloEvidence(BaseModel):
    """Where TTFT and ITL stand against the SLO thresholds (docs/diagnosis.md, "Against the
    SLO"). ITL p95s are over the requests' median gaps."""

    ttft_threshold_s: float | None = Field(description="TTFT threshold, seconds; null: none.")
    itl_threshold_s: float | None = Field(description="ITL threshold, seconds; null: none.")
    share_that_matters: float = Field(description="A rise matters from this share of its "
                                      "threshold (fraction).")
    ttft_p95_window_s: float | None = Field(description="The window's TTFT p95, seconds.")
    ttft_p95_baseline_s: float | None = Field(description="The baseline's TTFT p95, seconds.")
    itl_p95_window_s: float | None = Field(description="The window's ITL p95, seconds.")
    itl_p95_baseline_s: float | None = Field(description="The baseline's ITL p95, seconds.")


class Correlation(BaseModel):
    """Spearman's rank correlation, and its one-sided p-value for rho > 0."""

    rho: float = Field(description="Spearman's rho (-1 to 1).")
    p_value: float = Field(description="One-sided, rho > 0.")
    n: int = Field(description="Pairs (count).")


class Correlations(BaseModel):
    itl_vs_concurrency: Correlation | None = Field(description="Requests' median token gap "
                                                   "against requests in flight at arrival, "
                                                   "both sides pooled.")
    ttft_vs_concurrency: Correlation | None = Field(description="TTFT against requests in "
                                                    "flight at arrival, both sides pooled.")
    ttft_vs_prompt_tokens_in_window: Correlation | None = Field(description="TTFT against "
                                                                "prompt tokens, in the "
                                                                "window.")


class ScheduleEvidence(BaseModel):
    """Why the schedule holds the verdict it reports (docs/diagnosis.md, "The schedule"); in
    the schedule's rounds only."""

    held: Verdict | None = Field(description="The verdict the schedule holds after this "
                                 "round.")
    held_since_s: float | None = Field(description="When it took hold, POSIX seconds.")
    round_verdict: Verdict = Field(description="This round's own verdict.")
    what_changed: list[str] | None = Field(None, description="At a change from one verdict to "
                                           "another: the checks that differ from the last "
                                           "round that agreed with the one held before "
                                           "(`itl_rising: false -> true`); absent otherwise.")
    round_confidence: float = Field(description="This round's own confidence (0-1).")
    candidate: Verdict | None = Field(description="A different verdict seen in the last "
                                      "rounds, not held yet.")
    candidate_rounds: int = Field(description="Rounds in a row it has been seen (count).")
    rounds_needed: int = Field(description="Rounds in a row a new verdict needs (count).")
    switch_confidence: float = Field(description="... unless its confidence is at least this "
                                     "(0-1).")
    changed: bool = Field(description="Whether the held verdict changed this round.")
    because: str = Field(description="Why it moved or not: `first round`, `same as held`, "
                         "`pending: 1 of 2 round(s)`, `held 2 round(s)`, `overwhelming: ...`.")


class Evidence(BaseModel):
    """The numbers behind a verdict."""

    method: str = Field(description="The method's name and version "
                        "(`phasewatch-diagnosis/1`).")
    rules: DiagnosisRules = Field(description="The thresholds and settings it ran with.")
    samples: SamplesEvidence = Field(description="Both sides' requests.")
    engine: EngineEvidence | None = Field(description="The engine's figures over the window; "
                                          "null without engine metrics.")
    ttft_proxy_vs_engine: ProxyVsEngine | None = Field(description="The proxy's TTFT beside "
                                                       "the engine's; null without the "
                                                       "engine's.")
    checks: Checks = Field(description="Every boolean the rules read.")
    notes: list[str] | None = Field(None, description="Caveats the summary repeats; absent "
                                    "with insufficient data.")
    ttft: Comparison | None = Field(None, description="Raw TTFT, seconds.")
    ttft_at_equal_prompt: AdjustedComparison | None = Field(
        None, description="TTFT at equal prompt length (and pace), as a ratio to the "
        "baseline's; null when the baseline does not cover the window's prompts.")
    ttft_at_equal_prompt_missing: AdjustedMissing | None = Field(
        None, description="Why `ttft_at_equal_prompt` is null; absent otherwise.")
    itl: Comparison | None = Field(None, description="Each request's median token gap, "
                                   "seconds.")
    itl_in_flight: Comparison | None = Field(None, description="The median gap so far of the "
                                             "streams decoding now, seconds; null with too "
                                             "few.")
    stalls: StallEvidence | None = Field(None, description="Mid-stream stalls; null with too "
                                         "few requests with enough gaps.")
    prompt_tokens: Comparison | None = Field(None, description="Prompt length, tokens (mean).")
    concurrency: Comparison | None = Field(None, description="Requests in flight at arrival, "
                                           "counting the request (mean).")
    request_rate: RequestRateEvidence | None = Field(None, description="Requests per second, "
                                                     "window against baseline.")
    live_queue: LiveQueueEvidence | None = Field(None, description="Requests in flight "
                                                 "waiting past the baseline's TTFT p99; null "
                                                 "when none waits.")
    slo: SloEvidence | None = Field(None, description="TTFT and ITL p95s against the SLO.")
    correlations: Correlations | None = Field(None, description="The relations the article "
                                              "reads.")
    schedule: ScheduleEvidence | None = Field(None, description="The schedule's hold; in its "
                                              "rounds (stored changes, `source` `schedule` "
                                              "and `on_demand`) only.")
