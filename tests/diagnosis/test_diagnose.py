"""The diagnosis core on hand-made observations: every verdict, and the edges (one sample,
identical values, all errors, no traffic, no prompt lengths, engine corroboration)."""

from __future__ import annotations

import json
import random
from collections.abc import Callable

import pytest

from phasewatch.diagnosis.diagnose import Finding, Rules, diagnose
from phasewatch.diagnosis.observations import Observation, Sample
from phasewatch.diagnosis.verdicts import ACTIONS, Verdict
from phasewatch.engine.window import EngineWindow

SPAN = 10.0  # seconds each hand-made sample covers


def traffic(
    n: int, seed: int, *, start: float = 0.0, ttft: Callable[[int], float] | None = None,
    itl: float = 0.010, prompt: tuple[int, int] = (100, 400), in_flight: tuple[int, int] = (0, 3),
    noise: float = 0.08, gaps: int = 31, ok: bool = True,
) -> list[Observation]:
    """n requests spread over SPAN seconds; TTFT = 30 ms + 0.1 ms per prompt token unless
    `ttft` maps the prompt length to it; a few percent of noise everywhere."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p = rng.randint(*prompt)
        base = ttft(p) if ttft else 0.030 + 1e-4 * p
        t = base * rng.lognormvariate(0, noise)
        pace = itl * rng.lognormvariate(0, noise / 4)
        out.append(Observation(
            started_s=start + SPAN * i / n, ok=ok, ttft_s=t if ok else None,
            e2e_s=t + gaps * pace, itl_count=gaps if ok else 0, itl_p50_s=pace if ok else None,
            itl_max_s=pace * rng.uniform(1.0, 2.0) if ok else None, prompt_tokens=p,
            in_flight=rng.randint(*in_flight),
        ))
    return out


def sample(observations: list[Observation], requests: int | None = None) -> Sample:
    return Sample(observations, SPAN, len(observations) if requests is None else requests)


BASE = sample(traffic(60, 1))


def check(finding: Finding, verdict: Verdict) -> None:
    assert finding.verdict is verdict, finding.summary
    text = json.dumps(finding.as_dict(), allow_nan=False)  # JSON-ready, no NaN or infinity
    assert verdict.value in text
    assert finding.as_dict()["actions"] == [a.as_dict() for a in ACTIONS[verdict]]
    assert 0.0 <= finding.confidence <= 1.0


def test_same_traffic_is_healthy() -> None:
    finding = diagnose(sample(traffic(60, 2, start=SPAN)), BASE)
    check(finding, Verdict.HEALTHY)
    assert finding.confidence > 0.9
    assert finding.evidence["checks"]["ttft_rising"] is False


def test_healthy_over_many_independent_draws() -> None:
    """No false alarm: 30 windows of unchanged traffic against one baseline."""
    verdicts = {diagnose(sample(traffic(40, seed, start=SPAN)), BASE).verdict
                for seed in range(100, 130)}
    assert verdicts == {Verdict.HEALTHY}


def test_a_small_drift_is_not_material() -> None:
    """TTFT 20% and ITL 10% up, significant with these samples, but below the thresholds."""
    window = traffic(200, 3, start=SPAN, ttft=lambda p: 1.2 * (0.030 + 1e-4 * p), itl=0.011)
    finding = diagnose(sample(window), sample(traffic(200, 4)))
    check(finding, Verdict.HEALTHY)
    assert finding.evidence["ttft"]["significant"] is True
    assert finding.evidence["ttft"]["material"] is False


def test_waiting_at_equal_prompt_length_is_queueing() -> None:
    window = traffic(120, 5, start=SPAN, ttft=lambda p: 0.4 + 1e-4 * p, in_flight=(8, 16))
    finding = diagnose(sample(window), BASE)
    check(finding, Verdict.QUEUEING)
    assert finding.evidence["ttft_at_equal_prompt"]["ratio"] > 3
    assert finding.evidence["checks"]["itl_rising"] is False
    assert finding.evidence["correlations"]["ttft_vs_concurrency"]["rho"] > 0.5
    assert "Queueing" in finding.summary


def test_slower_steps_raise_ttft_too_but_that_is_decode_saturation() -> None:
    """Every step twice as long: ITL doubles and TTFT (a step away) nearly so; measured in
    steps, TTFT held."""
    window = traffic(120, 6, start=SPAN, itl=0.020, ttft=lambda p: 1.9 * (0.030 + 1e-4 * p),
                     in_flight=(20, 30))
    finding = diagnose(sample(window), BASE)
    check(finding, Verdict.DECODE_SATURATION)
    assert finding.evidence["ttft"]["ratio"] > 1.5  # raw TTFT did rise
    assert finding.evidence["ttft_at_equal_prompt"]["by_decode_pace"] is True
    assert finding.evidence["checks"]["concurrency_rising"] is True


def test_decode_slower_without_more_load_says_so() -> None:
    window = traffic(60, 7, start=SPAN, itl=0.020, ttft=lambda p: 2 * (0.030 + 1e-4 * p))
    finding = diagnose(sample(window), BASE)
    check(finding, Verdict.DECODE_SATURATION)
    assert "without more requests in flight" in finding.summary


def test_both_rising_is_out_of_capacity() -> None:
    window = traffic(150, 8, start=SPAN, itl=0.018, ttft=lambda p: 1.5 + 1e-4 * p,
                     in_flight=(30, 60))
    check(diagnose(sample(window), BASE), Verdict.OUT_OF_CAPACITY)


def test_longer_prompts_at_the_same_load_are_prefill_not_queueing() -> None:
    window = traffic(60, 9, start=SPAN, prompt=(1500, 3000), in_flight=(1, 5))
    finding = diagnose(sample(window), BASE)
    check(finding, Verdict.PREFILL_BOUND)
    assert finding.evidence["ttft"]["ratio"] > 3
    assert finding.evidence["checks"]["prompts_longer"] is True
    assert finding.evidence["checks"]["request_rate_rising"] is False
    # The baseline never saw such prompts: TTFT at equal length cannot be judged.
    assert finding.evidence["ttft_at_equal_prompt"] is None


def test_long_prompts_with_more_requests_and_waiting_is_queueing() -> None:
    """Prompts grew, but so did the request rate, and short prompts wait too: load."""
    long = traffic(80, 10, start=SPAN, prompt=(1500, 3000), ttft=lambda p: 0.6 + 1e-4 * p)
    short = traffic(80, 11, start=SPAN, ttft=lambda p: 0.6 + 1e-4 * p)
    finding = diagnose(sample(long + short), BASE)
    check(finding, Verdict.QUEUEING)


def interference_window(seed: int, stall_s: float) -> list[Observation]:
    """Short streams every 0.1 s; a 3000-token prompt every half second whose 0.35 s prefill
    stalls every stream decoding meanwhile by `stall_s`."""
    rng = random.Random(seed)
    longs = [(SPAN + k / 2 + 0.25, 0.35) for k in range(20)]
    out = []
    for k, (start, ttft) in enumerate(longs):
        out.append(Observation(start, True, ttft, ttft + 0.31, 31, 0.010, 0.012, 3000 + k, 3))
    for i in range(100):
        start = SPAN + i * 0.1
        ttft = 0.06 * rng.lognormvariate(0, 0.05)
        first, end = start + ttft, start + ttft + 0.31
        overlapped = any(s < end and s + t > first for s, t in longs)
        worst = stall_s if overlapped else 0.010 * rng.uniform(1.0, 2.0)
        out.append(Observation(start, True, ttft, end - start, 31, 0.010, worst,
                               rng.randint(100, 400), 2))
    return out


def test_stalls_during_long_prefills_are_interference() -> None:
    finding = diagnose(sample(interference_window(12, stall_s=0.3)), BASE)
    check(finding, Verdict.INTERFERENCE)
    stalls = finding.evidence["stalls"]
    assert stalls["with_long_prefills"] is True
    assert stalls["spikes_overlapping_long_prefills"] == stalls["window"]["spikes"]


def test_short_bumps_with_long_prompts_are_prefill_bound() -> None:
    """Chunked prefill with a small budget: bumps of twice the gap, not stalls."""
    finding = diagnose(sample(interference_window(13, stall_s=0.02)), BASE)
    check(finding, Verdict.PREFILL_BOUND)


def test_stalls_without_long_prefills_are_not_interference() -> None:
    window = traffic(60, 14, start=SPAN)
    stalled = [Observation(o.started_s, True, o.ttft_s, o.e2e_s, o.itl_count, o.itl_p50_s,
                           0.5 if i % 2 else o.itl_max_s, o.prompt_tokens, o.in_flight)
               for i, o in enumerate(window)]
    finding = diagnose(sample(stalled), BASE)
    check(finding, Verdict.HEALTHY)  # no verdict explains them, and the finding says so
    assert finding.evidence["checks"]["stalls_rising"] is True
    assert finding.evidence["checks"]["stalls_with_long_prefills"] is False
    assert finding.confidence < 0.1
    assert "not during long prefills" in finding.summary


def engine(**figures: float) -> EngineWindow:
    return EngineWindow(scrapes=10, **figures)  # type: ignore[arg-type]


def test_kv_cache_full_and_preempting_is_kv_pressure() -> None:
    window = traffic(60, 15, start=SPAN, ttft=lambda p: 0.3 + 1e-4 * p)
    signals = engine(kv_usage_max=0.99, kv_usage_mean=0.95, preemptions=7.0,
                     waiting_max=4.0, waiting_mean=2.0)
    finding = diagnose(sample(window), BASE, signals)
    check(finding, Verdict.KV_PRESSURE)
    assert finding.confidence > 0.9
    assert finding.evidence["engine"]["preemptions"] == 7.0
    # Full without preemptions is not (yet) pressure; nor is a cache that never filled.
    full_quiet = engine(kv_usage_max=0.99, kv_usage_mean=0.9, preemptions=0.0)
    assert diagnose(sample(window), BASE, full_quiet).verdict is Verdict.QUEUEING
    roomy = engine(kv_usage_max=0.5, kv_usage_mean=0.4, preemptions=3.0)
    assert diagnose(sample(window), BASE, roomy).verdict is Verdict.QUEUEING


def test_the_engine_queue_corroborates_queueing() -> None:
    window = sample(traffic(30, 16, start=SPAN, ttft=lambda p: 0.12 + 1e-4 * p))
    alone = diagnose(window, BASE)
    backed = diagnose(window, BASE, engine(waiting_max=5.0, waiting_mean=2.0))
    contradicted = diagnose(window, BASE, engine(waiting_max=0.0, waiting_mean=0.0))
    assert alone.verdict is backed.verdict is Verdict.QUEUEING
    assert alone.confidence <= backed.confidence
    assert "queue agrees" in backed.summary
    # Nothing waited in the engine: the wait is not a queue for its slots.
    check(contradicted, Verdict.UNEXPLAINED)
    assert contradicted.confidence < alone.confidence
    assert "in front of it" in contradicted.summary
    assert contradicted.evidence["checks"]["engine_queue_empty"] is True
    # Nor when the engine's queue time, which covers every request, is negligible.
    short_waits = engine(waiting_max=0.0, waiting_mean=0.0, queue_time_mean_s=0.001)
    assert diagnose(window, BASE, short_waits).verdict is Verdict.UNEXPLAINED
    long_waits = engine(waiting_max=0.0, waiting_mean=0.0, queue_time_mean_s=0.1)
    assert diagnose(window, BASE, long_waits).verdict is Verdict.QUEUEING
    # A request seen waiting at one scrape (between its arrival and the next step) beside a
    # negligible queue time is no queue: seen on a starved machine, where it flipped the
    # verdict between unexplained and queueing round by round.
    blip = engine(waiting_max=1.0, waiting_mean=0.1, queue_time_mean_s=0.0035)
    assert diagnose(window, BASE, blip).verdict is Verdict.UNEXPLAINED
    # A queue still building (requests waiting on average over the scrapes, not yet in the
    # queue-time histogram, which counts them once scheduled) is one.
    building = engine(waiting_max=6.0, waiting_mean=3.0, queue_time_mean_s=0.0035)
    assert diagnose(window, BASE, building).verdict is Verdict.QUEUEING


def test_ttft_rising_with_itl_and_nothing_waiting_in_the_engine_is_decode_saturation() -> None:
    """The real-vLLM case: the decode batch grew under the cap, each step is much longer, and
    first tokens wait behind those steps (TTFT up too), while the engine reports nothing
    waiting. Without the engine's figures that reads out_of_capacity; with them, decode
    saturation, whatever the poll."""
    window = sample(traffic(150, 8, start=SPAN, itl=0.018, ttft=lambda p: 1.5 + 1e-4 * p,
                           in_flight=(30, 60)))
    assert diagnose(window, BASE).verdict is Verdict.OUT_OF_CAPACITY
    idle_queue = engine(waiting_max=0.0, waiting_mean=0.0, running_mean=40.0, running_max=60.0)
    finding = diagnose(window, BASE, idle_queue)
    check(finding, Verdict.DECODE_SATURATION)
    assert "behind longer decode steps" in finding.summary
    assert finding.evidence["engine"]["running_mean"] == 40.0
    # The engine's batch and queue are in every summary that has them.
    assert "engine: 40.0 running and 0.0 waiting on average (at most 60 and 0)" in (
        finding.summary)


def test_proxy_and_engine_ttft_side_by_side() -> None:
    finding = diagnose(sample(traffic(60, 17, start=SPAN)), BASE,
                       engine(ttft_mean_s=0.040, ttft_p50_s=0.04, ttft_count=60.0))
    gap = finding.evidence["ttft_proxy_vs_engine"]
    assert gap["gap_mean_s"] == pytest.approx(gap["proxy_mean_s"] - 0.040, abs=1e-6)


@pytest.mark.parametrize(
    ("window", "says"),
    [
        ([], "window: 0 timed requests of 0"),  # no traffic at all
        (traffic(1, 18, start=SPAN), "window: 1 timed requests of 1"),  # one sample
        (traffic(40, 19, start=SPAN, ok=False), "(all failed)"),
    ],
)
def test_too_little_is_insufficient_data(window: list[Observation], says: str) -> None:
    finding = diagnose(sample(window), BASE)
    check(finding, Verdict.INSUFFICIENT_DATA)
    assert finding.confidence == 0.0
    assert says in finding.summary


def test_an_empty_baseline_is_insufficient_data() -> None:
    finding = diagnose(sample(traffic(60, 20, start=SPAN)), sample([]))
    check(finding, Verdict.INSUFFICIENT_DATA)
    assert "baseline: 0 timed" in finding.summary


def test_identical_values_everywhere() -> None:
    same = [Observation(float(i), True, 0.05, 0.36, 31, 0.01, 0.01, 256, 2) for i in range(30)]
    finding = diagnose(sample(same), sample(same))
    check(finding, Verdict.HEALTHY)
    assert finding.evidence["ttft"]["p_value"] == 1.0
    assert finding.evidence["correlations"]["itl_vs_concurrency"] is None


def test_without_prompt_lengths_ttft_is_judged_as_is() -> None:
    def blind(obs: list[Observation]) -> list[Observation]:
        return [Observation(o.started_s, o.ok, o.ttft_s, o.e2e_s, o.itl_count, o.itl_p50_s,
                            o.itl_max_s, None, o.in_flight) for o in obs]

    window = blind(traffic(60, 21, start=SPAN, ttft=lambda p: 0.4))
    finding = diagnose(sample(window), sample(blind(traffic(60, 1))))
    check(finding, Verdict.QUEUEING)
    assert finding.evidence["prompt_tokens"] is None


def test_without_token_gaps_only_ttft_is_judged() -> None:
    """One-token outputs: no ITL, no stalls, TTFT alone."""
    window = traffic(40, 22, start=SPAN, gaps=0, ttft=lambda p: 0.4)
    finding = diagnose(sample(window), sample(traffic(40, 23, gaps=0)))
    check(finding, Verdict.QUEUEING)
    assert finding.evidence["itl"] is None and finding.evidence["stalls"] is None


def test_rates_come_from_the_request_count_not_the_thinned_rows() -> None:
    window = sample(traffic(60, 24, start=SPAN), requests=600)
    finding = diagnose(window, BASE)
    assert finding.evidence["request_rate"]["window_rps"] == 60.0
    assert finding.evidence["request_rate"]["rising"] is True


def test_same_input_same_finding() -> None:
    window = sample(traffic(60, 25, start=SPAN, ttft=lambda p: 0.2))
    assert diagnose(window, BASE) == diagnose(window, BASE)


def test_min_samples_is_a_rule() -> None:
    window = sample(traffic(12, 26, start=SPAN))
    assert diagnose(window, BASE).verdict is Verdict.INSUFFICIENT_DATA
    assert diagnose(window, BASE, rules=Rules(min_samples=10)).verdict is Verdict.HEALTHY
