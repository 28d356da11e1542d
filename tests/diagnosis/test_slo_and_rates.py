"""Rises judged against the SLO as well as the baseline; a baseline that misses the SLO said to
be unclean; request rates over the part of a span that had traffic."""

from __future__ import annotations

from phasewatch.diagnosis.diagnose import Rules, diagnose
from phasewatch.diagnosis.observations import Sample, traffic_span_s
from phasewatch.diagnosis.verdicts import Verdict
from phasewatch.engine.window import EngineWindow
from tests.diagnosis.test_diagnose import SPAN, sample, traffic

SLO = Rules(slo_ttft_s=0.5, slo_itl_s=0.040)


def queue(p: int) -> float:
    return 8 * (0.030 + 1e-4 * p)  # TTFT 8x: a queue, up to ~0.56 s


def test_a_small_itl_rise_under_its_slo_does_not_make_queueing_out_of_capacity() -> None:
    """Issue 13's real-vLLM case: TTFT queues while ITL goes 17 -> 22 ms (x1.29) under a 40 ms
    objective. Without the SLO that reads out_of_capacity; with it, queueing, the ITL rise
    reported and not counted."""
    base = sample(traffic(200, 1, itl=0.017))
    window = sample(traffic(200, 2, start=SPAN, ttft=queue, itl=0.022))
    blind = diagnose(window, base)
    assert blind.verdict is Verdict.OUT_OF_CAPACITY
    finding = diagnose(window, base, rules=SLO)
    assert finding.verdict is Verdict.QUEUEING, finding.summary
    assert finding.confidence > 0.9
    checks = finding.evidence["checks"]
    assert checks["itl_rising"] is True and checks["itl_rise_matters"] is False
    assert checks["ttft_rise_matters"] is True
    assert "ITL rose" in finding.summary and "not counted" in finding.summary
    assert finding.evidence["slo"]["itl_p95_window_s"] < 0.75 * 0.040


def test_a_large_rise_matters_whatever_the_slo() -> None:
    """ITL 10 -> 21 ms (2.1x: a doubling) stays under 30 ms = 75% of the SLO, yet is decode
    saturation (the simulator's decode-saturation scenario looks like this)."""
    base = sample(traffic(100, 3, in_flight=(0, 3)))
    window = sample(traffic(100, 4, start=SPAN, itl=0.021, in_flight=(6, 12)))
    finding = diagnose(window, base, rules=SLO)
    assert finding.verdict is Verdict.DECODE_SATURATION, finding.summary
    assert finding.evidence["checks"]["itl_rise_matters"] is True


def test_a_rise_close_to_the_slo_matters() -> None:
    """ITL 25 -> 35 ms (1.4x) under a 40 ms objective: close to it, so it counts."""
    base = sample(traffic(100, 5, itl=0.025, in_flight=(0, 3)))
    window = sample(traffic(100, 6, start=SPAN, itl=0.035, in_flight=(6, 12)))
    finding = diagnose(window, base, rules=SLO)
    assert finding.verdict is Verdict.DECODE_SATURATION, finding.summary


def test_an_unchanged_present_that_misses_the_slo_is_not_called_normal() -> None:
    """Baseline and window both queue at ~2-4 s (an overload the baseline already had): no
    change names a cause, but a window that misses the SLO is never healthy: unexplained,
    saying the baseline missed it too, at low confidence; with the engine's figures, the
    cause they name."""
    def slow(p: int) -> float:
        return 100 * (0.030 + 1e-4 * p)

    base = sample(traffic(100, 7, ttft=slow))
    window = sample(traffic(100, 8, start=SPAN, ttft=slow))
    finding = diagnose(window, base, rules=SLO)
    assert finding.verdict is Verdict.UNEXPLAINED
    assert finding.confidence <= 0.5
    checks = finding.evidence["checks"]
    assert checks["baseline_meets_slo"] is False and checks["window_meets_slo"] is False
    assert checks["ttft_rising"] is False
    assert "misses the SLO (so did the baseline)" in finding.summary
    queued = EngineWindow(scrapes=10, waiting_max=12.0, waiting_mean=8.0)
    assert diagnose(window, base, queued, rules=SLO).verdict is Verdict.QUEUEING
    clean = diagnose(sample(traffic(100, 9, start=SPAN)), sample(traffic(100, 10)), rules=SLO)
    assert clean.evidence["checks"]["baseline_meets_slo"] is True
    assert clean.confidence > 0.9 and "No clean baseline" not in clean.summary


def test_the_traffic_span_starts_at_the_first_arrival() -> None:
    # 61 arrivals one second apart, the first 600 s into an hour's span ending at 3660 s.
    assert traffic_span_s(3600, 3600.0, 3660.0, 61) == 61.0
    # Traffic all along: the nominal span.
    assert traffic_span_s(3600, 0.5, 3600.0, 3600) == 3600
    # Nothing to go on: the nominal span.
    assert traffic_span_s(3600, None, 3600.0, 0) == 3600
    assert traffic_span_s(3600, 10.0, 3600.0, 1) == 3600


def test_steady_traffic_after_a_start_is_no_rate_rise() -> None:
    """Issue 13: in the first hour after a start, a baseline hour that holds 10 s of traffic
    read a 'rise' of several times. Over the span that had traffic, the rate is the same."""
    base_obs = traffic(60, 11)  # 60 requests over the last 10 s of an hour
    window = sample(traffic(60, 12, start=SPAN))
    nominal = Sample(base_obs, 3600.0, 60)
    assert diagnose(window, nominal).evidence["checks"]["request_rate_rising"] is True
    spanned = Sample(base_obs, traffic_span_s(3600.0, base_obs[0].started_s, SPAN, 60), 60)
    finding = diagnose(window, spanned)
    assert finding.evidence["checks"]["request_rate_rising"] is False
    assert 0.8 < finding.evidence["request_rate"]["ratio"] < 1.25
