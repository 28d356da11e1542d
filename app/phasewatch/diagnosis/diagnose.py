"""The diagnosis: one verdict for one model's window against its baseline, with its evidence.

`diagnose(window, baseline, engine, rules)` compares, window against baseline:
- TTFT, raw and at equal prompt length and decode pace (`prompt_adjust`);
- ITL: each request's median token gap (its decode pace);
- mid-stream stalls and whether they line up with long prefills (`stalls`);
- the workload: prompt length (mean, since prefill work adds up), request rate (Poisson rate
  test) and concurrency at arrival (in flight, counting the request itself);
and, when given, reads the engine's own figures for the window (KV cache, queue, preemptions).
The window may carry requests still in flight (`Sample.in_flight`, `live_view`): a waiting
one's TTFT is censored at its age, a decoding one brings its pace so far.

Rules, most specific cause first (docs/diagnosis.md explains each):
1. too few timed requests on either side -> insufficient_data
2. engine KV cache near full and preempting -> kv_pressure
3. stalls rising and lining up with long prefills -> interference
4. TTFT rising at equal prompt length and pace, or requests in flight waiting past the
   baseline's TTFT p99 (and, if prompts grew, the request rate rose too) and ITL rising ->
   out_of_capacity; TTFT only -> queueing; ITL only -> decode_saturation (an ITL rise that
   comes with longer prompts and no more requests is prefill work, not decode batch). A rise
   counts only if it matters against the SLO (`Rules.slo_*`): reported otherwise, not counted.
   The engine's own queue, where scraped (`on_its_own.engine_queue`), overrules: while it had
   nothing waiting, TTFT rising with ITL is decode_saturation (first tokens wait behind
   decode steps), and TTFT rising alone is unexplained (the wait is in front of the engine)
5. prompts longer and TTFT or ITL rising -> prefill_bound
6. otherwise healthy, unless the window misses the SLO: healthy never does. Then the cause
   the window and engine name on their own (`on_its_own.judge_alone`), else unexplained.

Without enough baseline requests (a cold start) but enough in the window, the window is
judged on its own the same way, marked `baseline_free`, at lower confidence.

Confidence is built from bootstrap support (how often the deciding comparisons come out the
same way on data like these), adjusted by the engine's corroboration. Pure: no clock, no I/O;
randomness from `rules.seed`, so equal inputs give equal findings.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from phasewatch.core.quantiles import percentile
from phasewatch.diagnosis.compare import Center, Shift, compare, finite
from phasewatch.diagnosis.live_view import QueueEvidence, live_observations, queue_evidence
from phasewatch.diagnosis.observations import EngineSignals, Observation, Sample, Stage
from phasewatch.diagnosis.on_its_own import (
    EngineQueue,
    engine_queue,
    judge_alone,
    misses,
)
from phasewatch.diagnosis.prompt_adjust import Adjusted, adjusted_shift, relative_ttft
from phasewatch.diagnosis.stalls import StallRules, Stalls, analyse_stalls
from phasewatch.diagnosis.statistics import Correlation, rate_ratio_greater, spearman
from phasewatch.diagnosis.verdicts import ACTIONS, MEANING, Verdict

METHOD = "phasewatch-diagnosis/1"


@dataclass(frozen=True, slots=True)
class Rules:
    """Thresholds and test settings. Ratios are window / baseline."""

    min_samples: int = 20  # timed requests a side, below which nothing is judged
    alpha: float = 0.01  # one-sided significance level of each test
    ttft_ratio: float = 1.5  # a material TTFT rise
    itl_ratio: float = 1.25  # a material ITL rise
    prompt_ratio: float = 1.5  # prompts materially longer (mean tokens)
    rate_ratio: float = 1.25  # materially more requests per second
    concurrency_ratio: float = 1.5  # materially more requests in flight (evidence only)
    spike_share: float = 0.10  # stalls: rise in the share of spiking requests
    spike_factor: float = 2.0  # a spike: stall factor past this x the baseline's p90 ...
    min_stall: float = 3.0  # ... and past this
    long_prompt_factor: float = 4.0  # a long prompt: this x the baseline's median prompt
    min_overlap_share: float = 0.6  # share of spikes that must overlap long prefills
    kv_full: float = 0.9  # engine KV cache usage counted as near full
    min_itl_gaps: int = 3  # token gaps a request needs for its median gap to count
    min_stall_gaps: int = 8  # ... and for its stall factor to count
    min_stratum: int = 5  # baseline requests a prompt octave needs for a median
    min_coverage: float = 0.25  # window share that TTFT-at-equal-prompt must cover
    rounds: int = 500  # bootstrap replicates
    seed: int = 0
    # The SLO thresholds (PHASEWATCH_SLO_TTFT_S / _ITL_S; None: no SLO). A rise names a verdict
    # only when it matters: the window's p95 reaches `slo_share` of its threshold, or the rise
    # (window / baseline) is at least `large_rise`, a doubling, whatever the SLO. A smaller
    # rise is reported (checks, notes) but decides nothing.
    slo_ttft_s: float | None = None
    slo_itl_s: float | None = None
    slo_share: float = 0.75
    large_rise: float = 2.0
    # The engine's mean queue time under this share of the window's TTFT median is no queue.
    queue_negligible_share: float = 0.1


@dataclass(frozen=True, slots=True)
class Finding:
    verdict: Verdict
    confidence: float  # 0-1
    summary: str
    evidence: dict[str, Any]

    @property
    def actions(self) -> list[dict[str, str]]:
        return [action.as_dict() for action in ACTIONS[self.verdict]]

    def as_dict(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict.value,
            "confidence": self.confidence,
            "summary": self.summary,
            "meaning": MEANING[self.verdict],
            "actions": self.actions,
            "evidence": self.evidence,
        }


def _timed(sample: Sample) -> list[Observation]:
    """The requests with a TTFT: finished ok ones, and those still in flight (live_view)."""
    finished = [o for o in sample.observations if o.ok and o.ttft_s is not None]
    return finished + live_observations(sample.in_flight, finished)


def _finished(timed: list[Observation]) -> list[Observation]:
    return [o for o in timed if o.stage is Stage.FINISHED]


def _sample_evidence(sample: Sample, timed: int) -> dict[str, Any]:
    seen = len(sample.observations)
    errors = sum(1 for o in sample.observations if not o.ok)
    return {
        "requests": sample.requests,
        "read": seen,  # fewer than requests when the shell thinned a large span
        "timed": timed,  # finished ok with a first token, and in flight (below)
        "in_flight": len(sample.in_flight),
        "in_flight_waiting": sum(1 for r in sample.in_flight if r.waiting),
        "errors": errors,
        "error_share": finite(errors / seen) if seen else None,
        "span_s": finite(sample.span_s),
        "rate_rps": finite(sample.rate_rps),
    }


def _correlation(c: Correlation | None) -> dict[str, Any] | None:
    if c is None:
        return None
    return {"rho": round(c.rho, 4), "p_value": round(c.p_value, 6), "n": c.n}


def _engine_evidence(engine: EngineSignals | None) -> dict[str, Any] | None:
    if engine is None:
        return None

    def f(value: float | None) -> float | None:
        return None if value is None else finite(value)

    return {
        "scrapes": engine.scrapes,
        "waiting_mean": f(engine.waiting_mean), "waiting_max": f(engine.waiting_max),
        "running_mean": f(engine.running_mean), "running_max": f(engine.running_max),
        "kv_cache_usage_mean": f(engine.kv_usage_mean),
        "kv_cache_usage_max": f(engine.kv_usage_max),
        "preemptions": f(engine.preemptions),
        "ttft_count": f(engine.ttft_count), "ttft_mean_s": f(engine.ttft_mean_s),
        "ttft_p50_s": f(engine.ttft_p50_s), "ttft_p95_s": f(engine.ttft_p95_s),
        "queue_time_mean_s": f(engine.queue_time_mean_s),
        "metric_names": dict(engine.metric_names),
    }


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds >= 0.01 else f"{seconds * 1e3:.1f} ms"


def _shift_text(name: str, s: Shift | None, unit: str = "time") -> str:
    if s is None:
        return f"{name}: not comparable"
    label = "p50" if s.center == "median" else "mean"
    fmt = _ms if unit == "time" else (lambda v: f"{v:.0f}")
    return (f"{name} {label} {fmt(s.window)} vs {fmt(s.baseline)} "
            f"({s.ratio:.2f}x, 95% CI {s.ratio_ci[0]:.2f}-{s.ratio_ci[1]:.2f}; "
            f"p95 {s.ratio_p95:.2f}x)")


def _support(s: Shift | None) -> float:
    return 0.0 if s is None else s.support


@dataclass(frozen=True, slots=True)
class Levels:
    """Where TTFT and ITL stand against their SLO thresholds (p95, seconds)."""

    ttft_window: float | None
    ttft_baseline: float | None
    itl_window: float | None  # p95 of the requests' median gaps
    itl_baseline: float | None

    def matters(self, value: float | None, slo: float | None, share: float, rise: float,
                large: float) -> bool:
        """Whether a rise counts: always without an SLO; else when its level comes close to
        the SLO, or the rise (window / baseline) is at least `large`."""
        return slo is None or (value is not None and value >= share * slo) or rise >= large


def _p95(values: list[float]) -> float | None:
    return percentile(sorted(values), 0.95) if values else None


def _levels(w: list[Observation], b: list[Observation], rules: Rules) -> Levels:
    def gaps(sample: list[Observation]) -> list[float]:
        return [o.itl_p50_s for o in sample
                if o.itl_count >= rules.min_itl_gaps and o.itl_p50_s is not None]

    return Levels(_p95([o.ttft_s for o in w if o.ttft_s is not None]),
                  _p95([o.ttft_s for o in b if o.ttft_s is not None]),
                  _p95(gaps(w)), _p95(gaps(b)))


@dataclass(frozen=True, slots=True)
class Measures:
    """Every comparison of the window with the baseline (None: not enough to compare)."""

    ttft: Shift | None
    relative: Adjusted  # TTFT at equal prompt length and pace, per request
    ttft_adj: Shift | None
    itl: Shift | None
    itl_live: Shift | None  # the pace of the streams decoding now against the baseline's
    prompt: Shift | None
    concurrency: Shift | None
    rate_ratio: float
    rate_p: float
    load_up: bool  # the request rate rose, materially and significantly
    stalls: Stalls | None
    itl_vs_concurrency: Correlation | None
    ttft_vs_concurrency: Correlation | None
    ttft_vs_prompt: Correlation | None
    queue: QueueEvidence | None  # live requests waiting past the baseline's TTFT p99
    levels: Levels  # p95s against the SLO


def _measure(window: Sample, baseline: Sample, w_timed: list[Observation],
             b_timed: list[Observation], rules: Rules) -> Measures:
    rng = np.random.default_rng(rules.seed)
    enough = max(5, math.ceil(rules.min_samples / 2))

    def cmp(w: list[float], b: list[float], threshold: float, center: Center = "median",
            tail: bool = True) -> Shift | None:
        if len(w) < enough or len(b) < enough:
            return None
        return compare(w, b, threshold=threshold, alpha=rules.alpha, rng=rng,
                       rounds=rules.rounds, center=center, tail=tail)

    def itls(sample: list[Observation]) -> list[float]:
        return [o.itl_p50_s for o in sample
                if o.itl_count >= rules.min_itl_gaps and o.itl_p50_s is not None
                and o.itl_p50_s > 0]

    def prompts(sample: list[Observation]) -> list[float]:
        return [float(o.prompt_tokens) for o in sample if o.prompt_tokens is not None]

    relative = relative_ttft(w_timed, b_timed, rules.min_stratum, rules.min_itl_gaps)
    rate_ratio = (window.rate_rps / baseline.rate_rps) if baseline.rate_rps > 0 else math.inf
    rate_p = rate_ratio_greater(window.requests, window.span_s, baseline.requests,
                                baseline.span_s)
    pooled = [*w_timed, *b_timed]
    itl_pairs = [(o.itl_p50_s, float(o.in_flight)) for o in pooled
                 if o.itl_count >= rules.min_itl_gaps and o.itl_p50_s is not None]
    prompt_pairs = [(o.ttft_s, float(o.prompt_tokens)) for o in w_timed
                    if o.ttft_s is not None and o.prompt_tokens is not None]
    return Measures(
        queue=queue_evidence(w_timed, [o.ttft_s for o in b_timed if o.ttft_s is not None],
                             rules.alpha),
        levels=_levels(w_timed, b_timed, rules),
        ttft=cmp([o.ttft_s for o in w_timed if o.ttft_s is not None],
                 [o.ttft_s for o in b_timed if o.ttft_s is not None], rules.ttft_ratio),
        relative=relative,
        ttft_adj=adjusted_shift(relative, min_samples=rules.min_samples,
                                min_coverage=rules.min_coverage, threshold=rules.ttft_ratio,
                                alpha=rules.alpha, rng=rng, rounds=rules.rounds),
        # Judged on the median only: a decode step is shared by the whole batch, so a bigger
        # batch slows every stream; a few slow streams are stalls, judged as such.
        itl=cmp(itls(w_timed), itls(b_timed), rules.itl_ratio, tail=False),
        # The streams decoding at the snapshot are the present batch: their pace shows a
        # bigger batch before the window's finished requests, mostly older, move its median.
        # Those that have ended since count here too (their pace so far), never twice in one
        # comparison.
        itl_live=cmp(itls([o for o in live_observations(window.in_flight, [])
                           if o.stage is Stage.DECODING]), itls(b_timed),
                     rules.itl_ratio, tail=False),
        prompt=cmp(prompts(w_timed), prompts(b_timed), rules.prompt_ratio, "mean"),
        concurrency=cmp([o.in_flight + 1.0 for o in w_timed],
                        [o.in_flight + 1.0 for o in b_timed], rules.concurrency_ratio, "mean"),
        rate_ratio=rate_ratio,
        rate_p=rate_p,
        load_up=rate_ratio >= rules.rate_ratio and rate_p < rules.alpha,
        stalls=analyse_stalls(
            _finished(w_timed), b_timed,
            StallRules(rules.min_stall_gaps, rules.min_stall, rules.spike_factor,
                       rules.spike_share, rules.long_prompt_factor, rules.min_overlap_share,
                       rules.alpha),
            rules.min_samples,
        ),
        # The relations the article reads: ITL and TTFT against concurrency, TTFT against
        # prompt length.
        itl_vs_concurrency=spearman([a for a, _ in itl_pairs], [b for _, b in itl_pairs]),
        ttft_vs_concurrency=spearman([o.ttft_s for o in pooled if o.ttft_s is not None],
                                     [float(o.in_flight) for o in pooled
                                      if o.ttft_s is not None]),
        ttft_vs_prompt=spearman([a for a, _ in prompt_pairs], [b for _, b in prompt_pairs]),
    )


@dataclass(frozen=True, slots=True)
class Decision:
    verdict: Verdict
    confidence: float
    judged: Shift | None  # the TTFT comparison the verdict read
    checks: dict[str, bool | None]
    notes: list[str]


def _decide(m: Measures, engine: EngineSignals | None, queue: EngineQueue,
            rules: Rules) -> Decision:
    prompt_up = m.prompt is not None and m.prompt.rising
    ttft_up = m.ttft is not None and m.ttft.rising
    # At equal prompt length and pace when the baseline covers the window's prompts; when it
    # does not and prompts did not change, raw TTFT is the same question.
    judged = m.ttft_adj if m.ttft_adj is not None else (None if prompt_up else m.ttft)
    # Requests still waiting past the baseline's TTFT p99 show a queue before they end.
    queue_live = m.queue is not None and m.queue.rising
    ttft_rise = (judged is not None and judged.rising) or queue_live
    itl_live = m.itl_live is not None and m.itl_live.rising
    itl_up = (m.itl is not None and m.itl.rising) or itl_live
    # A rise names a verdict only if it matters against the SLO as well as the baseline.
    lv = m.levels
    ttft_matters = lv.matters(lv.ttft_window, rules.slo_ttft_s, rules.slo_share,
                              0.0 if judged is None else judged.ratio, rules.large_rise)
    itl_matters = lv.matters(lv.itl_window, rules.slo_itl_s, rules.slo_share,
                             max(0.0 if s is None else s.ratio for s in (m.itl, m.itl_live)),
                             rules.large_rise)
    # A rise with longer prompts counts as load only if more requests came too.
    ttft_load = ttft_rise and ttft_matters and (not prompt_up or m.load_up)
    decode_load = itl_up and itl_matters and (not prompt_up or m.load_up)
    kv_full = (engine is not None and engine.kv_usage_max is not None
               and engine.kv_usage_max >= rules.kv_full
               and (engine.preemptions or 0.0) >= 1.0)
    stalls = m.stalls
    interference = stalls is not None and stalls.rising and stalls.with_long_prefills
    concurrency_up = m.concurrency is not None and m.concurrency.rising
    itl_tracks_load = (m.itl_vs_concurrency is not None and m.itl_vs_concurrency.rho > 0
                       and m.itl_vs_concurrency.p_value < rules.alpha)

    notes: list[str] = []
    s_ttft = max(_support(judged),
                 1 - m.queue.p_value if queue_live and m.queue is not None else 0.0)
    s_itl = max(_support(m.itl), _support(m.itl_live) if itl_live else 0.0)
    # A rise that does not matter against the SLO weighs nothing in the confidence either.
    if not ttft_matters:
        s_ttft = 0.0
    if not itl_matters:
        s_itl = 0.0
    for name, rising, matters, level, slo in (
            ("TTFT", ttft_rise, ttft_matters, lv.ttft_window, rules.slo_ttft_s),
            ("ITL", itl_up, itl_matters, lv.itl_window, rules.slo_itl_s)):
        if rising and not matters and slo is not None:
            notes.append(f"{name} rose, but by less than {rules.large_rise:g}x and its p95 "
                         f"({_ms(level or 0.0)}) stays under "
                         f"{rules.slo_share:.0%} of its {_ms(slo)} SLO: reported, not counted.")
    s_stall = 0.0 if stalls is None else stalls.support
    if kv_full:
        assert engine is not None
        verdict = Verdict.KV_PRESSURE
        mean_use = engine.kv_usage_mean if engine.kv_usage_mean is not None else 0.0
        confidence = 0.5 + 0.5 * min(1.0, mean_use / rules.kv_full)
    elif interference:
        verdict = Verdict.INTERFERENCE
        confidence = s_stall
    elif ttft_load and decode_load and queue is EngineQueue.EMPTY:
        verdict = Verdict.DECODE_SATURATION
        confidence = s_itl
        notes.append("TTFT rose with ITL while the engine had nothing waiting: first tokens "
                     "wait behind longer decode steps, not in a queue.")
    elif ttft_load and decode_load:
        verdict = Verdict.OUT_OF_CAPACITY
        confidence = s_ttft * s_itl
    elif ttft_load and queue is EngineQueue.EMPTY:
        verdict = Verdict.UNEXPLAINED
        confidence = 0.5 * s_ttft * (1 - s_itl)
        notes.append("TTFT rose, but the engine shows no waiting requests and negligible "
                     "queue time: the wait is in front of it (proxy, network, API server).")
    elif ttft_load:
        verdict = Verdict.QUEUEING
        confidence = s_ttft * (1 - s_itl)
    elif decode_load:
        verdict = Verdict.DECODE_SATURATION
        confidence = s_itl * (1 - s_ttft)
        if not (concurrency_up or itl_tracks_load):
            confidence *= 0.5
            notes.append("ITL rose without more requests in flight: capping concurrency may "
                         "not help (a slower GPU, longer contexts?).")
    elif prompt_up and (ttft_up or itl_up):
        verdict = Verdict.PREFILL_BOUND
        confidence = _support(m.prompt) * max(_support(m.ttft), s_itl)
    else:
        verdict = Verdict.HEALTHY
        confidence = (1 - s_ttft) * (1 - s_itl) * (1 - s_stall)
        if stalls is not None and stalls.rising:
            notes.append("Streams stall mid-output more often, but not during long prefills: "
                         "look at engine preemptions (KV cache) and the network.")

    baseline_clean = _meets(lv.ttft_baseline, lv.itl_baseline, rules)
    if verdict is Verdict.HEALTHY and baseline_clean is False:
        # Unchanged from a baseline that itself misses the SLO is not normal: say so.
        confidence *= 0.5
        notes.append("No clean baseline: the baseline itself misses the SLO (TTFT p95 "
                     f"{_ms(lv.ttft_baseline or 0.0)}, ITL p95 {_ms(lv.itl_baseline or 0.0)}); "
                     "unchanged is not the same as normal. Compare with a known-good run "
                     "(baseline=run:<id>).")

    # The engine's queue corroborates a queueing verdict (it cannot contradict one: above).
    if verdict in (Verdict.QUEUEING, Verdict.OUT_OF_CAPACITY) and queue is EngineQueue.WAITING:
        assert engine is not None
        confidence = 1 - (1 - confidence) * 0.5
        notes.append(f"The engine's queue agrees: {engine.waiting_mean or 0:.1f} requests "
                     f"waiting on average, {engine.waiting_max or 0:.0f} at most.")

    window_misses = misses(lv.ttft_window, lv.itl_window, rules.slo_ttft_s, rules.slo_itl_s)
    if verdict is Verdict.HEALTHY and window_misses.any:
        # Unchanged from the baseline is not healthy when the window misses the SLO.
        alone = judge_alone(window_misses, queue,
                            None if engine is None else engine.running_mean)
        assert alone is not None
        verdict, confidence = alone.verdict, alone.confidence
        notes.append("No change from the baseline names a cause, but the window misses the "
                     "SLO" + (" (so did the baseline)" if baseline_clean is False else "")
                     + ": judged from the window and the engine alone.")
        notes.extend(alone.notes)

    checks: dict[str, bool | None] = {
        "enough_samples": True,
        "ttft_rising": ttft_up,
        "ttft_rising_at_equal_prompt": None if judged is None else judged.rising,
        "itl_rising": itl_up,
        "prompts_longer": prompt_up,
        "request_rate_rising": m.load_up,
        "concurrency_rising": concurrency_up,
        "stalls_rising": stalls is not None and stalls.rising,
        "stalls_with_long_prefills": stalls is not None and stalls.with_long_prefills,
        "kv_pressure": None if engine is None or engine.kv_usage_max is None else kv_full,
        "ttft_rising_live": queue_live,
        "itl_rising_live": itl_live,
        "ttft_rise_matters": ttft_matters,
        "itl_rise_matters": itl_matters,
        "baseline_meets_slo": baseline_clean,
        "window_meets_slo": _meets(lv.ttft_window, lv.itl_window, rules),
        "engine_queue_empty": None if queue is EngineQueue.UNKNOWN else (
            queue is EngineQueue.EMPTY),
        "baseline_free": False,
    }
    return Decision(verdict, round(min(1.0, max(0.0, confidence)), 4), judged, checks, notes)


def _meets(ttft: float | None, itl: float | None, rules: Rules) -> bool | None:
    """Both p95s within their SLO thresholds (None: no SLO, or nothing to judge)."""
    verdicts = [value <= slo for value, slo in ((ttft, rules.slo_ttft_s), (itl, rules.slo_itl_s))
                if value is not None and slo is not None]
    return None if not verdicts else all(verdicts)


def _comparisons(m: Measures, window: Sample, baseline: Sample, w_timed: list[Observation],
                 engine: EngineSignals | None, rules: Rules) -> dict[str, Any]:
    """The evidence of every comparison, JSON-ready."""
    relative = m.relative
    out: dict[str, Any] = {
        "ttft": None if m.ttft is None else m.ttft.evidence(),
        "ttft_at_equal_prompt": None if m.ttft_adj is None else {
            **m.ttft_adj.evidence("ratio to the baseline median at the same prompt octave"
                                  + (", per unit of decode pace" if relative.by_pace else "")),
            "coverage": finite(relative.coverage), "strata": relative.strata,
            "by_decode_pace": relative.by_pace,
        },
        "itl": None if m.itl is None else m.itl.evidence(),
        "itl_in_flight": None if m.itl_live is None else m.itl_live.evidence(
            "median token gap so far of the streams decoding now"),
        "stalls": None if m.stalls is None else m.stalls.evidence(),
        "prompt_tokens": None if m.prompt is None else m.prompt.evidence("tokens"),
        "concurrency": None if m.concurrency is None else m.concurrency.evidence(
            "requests in flight at arrival, counting the request"),
        "request_rate": {
            "window_rps": finite(window.rate_rps), "baseline_rps": finite(baseline.rate_rps),
            "ratio": finite(m.rate_ratio), "p_value": round(m.rate_p, 6), "rising": m.load_up,
            "threshold_ratio": rules.rate_ratio,
        },
        "live_queue": None if m.queue is None else m.queue.evidence(),
        "slo": {
            "ttft_threshold_s": rules.slo_ttft_s, "itl_threshold_s": rules.slo_itl_s,
            "share_that_matters": rules.slo_share,
            "ttft_p95_window_s": _f(m.levels.ttft_window),
            "ttft_p95_baseline_s": _f(m.levels.ttft_baseline),
            "itl_p95_window_s": _f(m.levels.itl_window),
            "itl_p95_baseline_s": _f(m.levels.itl_baseline),
        },
        "correlations": {
            "itl_vs_concurrency": _correlation(m.itl_vs_concurrency),
            "ttft_vs_concurrency": _correlation(m.ttft_vs_concurrency),
            "ttft_vs_prompt_tokens_in_window": _correlation(m.ttft_vs_prompt),
        },
    }
    if m.ttft_adj is None:
        out["ttft_at_equal_prompt_missing"] = {
            "coverage": finite(relative.coverage), "strata": relative.strata,
            "reason": "the baseline has too few requests at the window's prompt lengths",
        }
    return out


def _f(value: float | None) -> float | None:
    return None if value is None else finite(value)


def _proxy_vs_engine(w_timed: list[Observation],
                     engine: EngineSignals | None) -> dict[str, Any] | None:
    """The proxy's TTFT beside the engine's over the window (no baseline needed)."""
    if engine is None or engine.ttft_mean_s is None:
        return None
    ttfts = sorted(o.ttft_s for o in w_timed if o.ttft_s is not None)
    if not ttfts:
        return None
    proxy_mean = math.fsum(ttfts) / len(ttfts)
    proxy_p50 = percentile(ttfts, 0.5)
    return {
        "proxy_mean_s": finite(proxy_mean), "engine_mean_s": finite(engine.ttft_mean_s),
        "gap_mean_s": finite(proxy_mean - engine.ttft_mean_s),
        "proxy_p50_s": None if proxy_p50 is None else finite(proxy_p50),
        "engine_p50_s": None if engine.ttft_p50_s is None else finite(engine.ttft_p50_s),
        "note": "the gap is network + proxy + the engine frontend before its own clock",
    }


def diagnose(
    window: Sample, baseline: Sample, engine: EngineSignals | None = None,
    rules: Rules | None = None,
) -> Finding:
    rules = rules or Rules()
    w_timed, b_timed = _timed(window), _timed(baseline)
    evidence: dict[str, Any] = {
        "method": METHOD,
        "rules": asdict(rules),
        "samples": {"window": _sample_evidence(window, len(w_timed)),
                    "baseline": _sample_evidence(baseline, len(b_timed))},
        "engine": _engine_evidence(engine),
        "ttft_proxy_vs_engine": _proxy_vs_engine(w_timed, engine),
    }
    w_ttfts = sorted(o.ttft_s for o in w_timed if o.ttft_s is not None)
    queue = engine_queue(engine, percentile(w_ttfts, 0.5) if w_ttfts else None,
                         rules.queue_negligible_share)
    if len(w_timed) >= rules.min_samples > len(b_timed):
        alone = _baseline_free(w_timed, engine, queue, rules, evidence)
        if alone is not None:
            return alone
    if len(w_timed) < rules.min_samples or len(b_timed) < rules.min_samples:
        parts = []
        for name, sample, timed in (("window", window, w_timed), ("baseline", baseline, b_timed)):
            seen = len(sample.observations)
            failed = sum(1 for o in sample.observations if not o.ok)
            parts.append(f"{name}: {len(timed)} timed requests of {sample.requests}"
                         + (f", {failed} failed" if failed else "")
                         + (" (all failed)" if seen and failed == seen else ""))
        evidence["checks"] = {"enough_samples": False}
        return Finding(
            Verdict.INSUFFICIENT_DATA, 0.0,
            f"Insufficient data: need {rules.min_samples} timed requests on each side; "
            + "; ".join(parts) + ".",
            evidence,
        )

    measures = _measure(window, baseline, w_timed, b_timed, rules)
    decision = _decide(measures, engine, queue, rules)
    evidence.update(_comparisons(measures, window, baseline, w_timed, engine, rules))
    evidence["checks"] = decision.checks
    evidence["notes"] = decision.notes
    return Finding(
        decision.verdict, decision.confidence,
        _summary(decision.verdict, measures, decision.judged, engine, decision.notes),
        evidence,
    )


def _baseline_free(w_timed: list[Observation], engine: EngineSignals | None,
                   queue: EngineQueue, rules: Rules, evidence: dict[str, Any]) -> Finding | None:
    """The window judged on its own (too few baseline requests): None when neither an SLO nor
    the engine's figures can judge it."""
    lv = _levels(w_timed, [], rules)
    m = misses(lv.ttft_window, lv.itl_window, rules.slo_ttft_s, rules.slo_itl_s)
    alone = judge_alone(m, queue, None if engine is None else engine.running_mean)
    if alone is None:
        return None
    evidence["slo"] = {
        "ttft_threshold_s": rules.slo_ttft_s, "itl_threshold_s": rules.slo_itl_s,
        "share_that_matters": rules.slo_share,
        "ttft_p95_window_s": _f(lv.ttft_window), "itl_p95_window_s": _f(lv.itl_window),
        "ttft_p95_baseline_s": None, "itl_p95_baseline_s": None,
    }
    evidence["checks"] = {
        "enough_samples": False, "baseline_free": True,
        "window_meets_slo": _meets(lv.ttft_window, lv.itl_window, rules),
        "engine_queue_empty": None if queue is EngineQueue.UNKNOWN else (
            queue is EngineQueue.EMPTY),
    }
    notes = [f"No baseline yet (fewer than {rules.min_samples} timed requests before the "
             "window): judged from the window, the SLO and the engine alone, at lower "
             "confidence.", *alone.notes]
    evidence["notes"] = notes
    levels = [f"TTFT p95 {_ms(lv.ttft_window)}" if lv.ttft_window is not None else None,
              f"ITL p95 {_ms(lv.itl_window)}" if lv.itl_window is not None else None]
    slos = [f"{_ms(v)}" for v in (rules.slo_ttft_s, rules.slo_itl_s) if v is not None]
    batch = _engine_batch(engine)
    summary = (f"{_HEAD[alone.verdict]} (no baseline): "
               + ", ".join(x for x in levels if x is not None)
               + (f" against SLO thresholds {' / '.join(slos)}" if slos else "")
               + (f"; {batch}" if batch else "")
               + "." + "".join(" " + n for n in notes))
    return Finding(alone.verdict, round(alone.confidence, 4), summary, evidence)


_HEAD = {
    Verdict.HEALTHY: "Healthy",
    Verdict.QUEUEING: "Queueing",
    Verdict.DECODE_SATURATION: "Decode saturation",
    Verdict.OUT_OF_CAPACITY: "Out of capacity",
    Verdict.PREFILL_BOUND: "Prefill-bound",
    Verdict.INTERFERENCE: "Interference",
    Verdict.KV_PRESSURE: "KV-cache pressure",
    Verdict.UNEXPLAINED: "Unexplained",
    Verdict.INSUFFICIENT_DATA: "Insufficient data",
}


def _summary(
    verdict: Verdict, m: Measures, judged: Shift | None, engine: EngineSignals | None,
    notes: list[str],
) -> str:
    ttft, itl, prompt, concurrency, stalls = m.ttft, m.itl, m.prompt, m.concurrency, m.stalls
    head = _HEAD[verdict]
    parts = [_shift_text("TTFT", ttft), _shift_text("ITL", itl)]
    if judged is not None and judged is not ttft:
        parts.insert(1, f"at equal prompt length and pace {judged.ratio:.2f}x")
    if prompt is not None:
        parts.append(_shift_text("prompt tokens", prompt, "count"))
    if concurrency is not None:
        parts.append(f"in flight {concurrency.window - 1:.1f} vs {concurrency.baseline - 1:.1f}")
    if m.queue is not None and m.queue.past:
        parts.append(f"{m.queue.past} of {m.queue.waiting} requests waiting now are past the "
                     f"baseline's TTFT p99 ({_ms(m.queue.threshold_s)}), the oldest for "
                     f"{_ms(m.queue.oldest_s or 0.0)}")
    if stalls is not None and (stalls.spikes_window or verdict is Verdict.INTERFERENCE):
        parts.append(f"stalls in {stalls.share_window:.0%} of streams vs "
                     f"{stalls.share_baseline:.0%} ({stalls.spikes_overlapped} of "
                     f"{stalls.spikes_window} during long prefills)")
    if engine is not None and verdict is Verdict.KV_PRESSURE:
        parts.insert(0, f"engine KV cache up to {100 * (engine.kv_usage_max or 0):.0f}%, "
                        f"{engine.preemptions or 0:.0f} preemptions")
    batch = _engine_batch(engine)
    if batch:
        parts.append(batch)
    return f"{head}: " + "; ".join(parts) + "." + "".join(" " + n for n in notes)


def _engine_batch(engine: EngineSignals | None) -> str | None:
    """The engine's batch and queue over the window, as every summary states them."""
    if engine is None or engine.running_mean is None or engine.waiting_mean is None:
        return None
    text = (f"engine: {engine.running_mean:.1f} running and {engine.waiting_mean:.1f} waiting "
            f"on average (at most {engine.running_max or 0:.0f} and "
            f"{engine.waiting_max or 0:.0f})")
    if engine.queue_time_mean_s is not None:
        text += f", queue time {_ms(engine.queue_time_mean_s)} a request"
    return text
