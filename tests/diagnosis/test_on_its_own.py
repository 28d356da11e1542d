"""A window judged without a baseline (a cold start): by the SLO and the engine's own queue and
batch, marked baseline-free and at most half sure; with neither, still insufficient data."""

from __future__ import annotations

from phasewatch.diagnosis.diagnose import Rules, diagnose
from phasewatch.diagnosis.on_its_own import BASELINE_FREE_CONFIDENCE
from phasewatch.diagnosis.verdicts import Verdict
from phasewatch.engine.window import EngineWindow
from tests.diagnosis.test_diagnose import SPAN, check, sample, traffic

SLO = Rules(slo_ttft_s=0.5, slo_itl_s=0.040)
NONE = sample([])  # nothing before the window


def queued(p: int) -> float:
    return 1.5 + 1e-4 * p  # TTFT p95 ~1.6 s against a 0.5 s objective


def test_within_the_slo_is_healthy_without_a_baseline() -> None:
    finding = diagnose(sample(traffic(60, 1, start=SPAN)), NONE, rules=SLO)
    check(finding, Verdict.HEALTHY)
    assert finding.confidence == BASELINE_FREE_CONFIDENCE
    assert finding.evidence["checks"]["baseline_free"] is True
    assert finding.evidence["checks"]["window_meets_slo"] is True
    assert "no baseline" in finding.summary


def test_a_miss_with_requests_waiting_in_the_engine_is_queueing() -> None:
    window = sample(traffic(60, 2, start=SPAN, ttft=queued))
    waiting = EngineWindow(scrapes=6, waiting_max=9.0, waiting_mean=6.0, running_mean=8.0)
    finding = diagnose(window, NONE, waiting, rules=SLO)
    check(finding, Verdict.QUEUEING)
    assert 0 < finding.confidence <= BASELINE_FREE_CONFIDENCE
    assert finding.evidence["checks"]["engine_queue_empty"] is False
    # ITL over its objective as well: out of capacity.
    both = sample(traffic(60, 3, start=SPAN, ttft=queued, itl=0.060))
    check(diagnose(both, NONE, waiting, rules=SLO), Verdict.OUT_OF_CAPACITY)


def test_slow_steps_of_a_full_batch_with_nothing_waiting_are_decode_saturation() -> None:
    window = sample(traffic(60, 4, start=SPAN, itl=0.060, ttft=queued))
    batch = EngineWindow(scrapes=6, waiting_max=0.0, waiting_mean=0.0, running_mean=48.0,
                         queue_time_mean_s=0.002)
    finding = diagnose(window, NONE, batch, rules=SLO)
    check(finding, Verdict.DECODE_SATURATION)
    assert "48.0 requests decoding" in finding.summary
    assert finding.evidence["checks"]["engine_queue_empty"] is True


def test_a_miss_the_evidence_cannot_place_says_so() -> None:
    window = sample(traffic(60, 5, start=SPAN, ttft=queued))
    finding = diagnose(window, NONE, rules=SLO)  # the engine is not scraped
    check(finding, Verdict.UNEXPLAINED)
    assert "not scraped" in finding.summary
    assert finding.evidence["slo"]["ttft_p95_window_s"] > 0.5
    # Nothing waiting in the engine and a batch of one: not a queue, not the batch.
    alone = EngineWindow(scrapes=6, waiting_max=0.0, waiting_mean=0.0, running_mean=1.0)
    finding = diagnose(window, NONE, alone, rules=SLO)
    check(finding, Verdict.UNEXPLAINED)
    assert "in front of it" in finding.summary


def test_with_no_slo_and_no_engine_nothing_is_judged_without_a_baseline() -> None:
    finding = diagnose(sample(traffic(60, 6, start=SPAN, ttft=queued)), NONE)
    check(finding, Verdict.INSUFFICIENT_DATA)
    # Too few requests in the window itself: insufficient, whatever the SLO.
    check(diagnose(sample(traffic(5, 7, start=SPAN, ttft=queued)), NONE, rules=SLO),
          Verdict.INSUFFICIENT_DATA)
