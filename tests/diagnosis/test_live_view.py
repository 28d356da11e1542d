"""The diagnosis core on requests still in flight: a waiting request's censored TTFT, a decoding
request's pace so far, a request counted once when it is both in a snapshot and finished."""

from __future__ import annotations

import pytest

from phasewatch.core.live import InFlight
from phasewatch.diagnosis.diagnose import diagnose
from phasewatch.diagnosis.live_view import live_observations, queue_evidence
from phasewatch.diagnosis.observations import Observation, Sample, Stage
from phasewatch.diagnosis.statistics import binomial_greater
from phasewatch.diagnosis.verdicts import Verdict
from tests.diagnosis.test_diagnose import BASE, SPAN, traffic


def waiting(started_s: float, age_s: float) -> InFlight:
    return InFlight(model="m", started_s=started_s, age_s=age_s, ttft_s=None, silent_s=age_s,
                    itl_count=0, itl_p50_s=None, itl_max_s=None, prompt_tokens=None,
                    in_flight=8)


def decoding(started_s: float, ttft_s: float, pace_s: float, gaps: int = 20) -> InFlight:
    return InFlight(model="m", started_s=started_s, age_s=ttft_s + gaps * pace_s,
                    ttft_s=ttft_s, silent_s=pace_s, itl_count=gaps, itl_p50_s=pace_s,
                    itl_max_s=pace_s * 1.5, prompt_tokens=200, in_flight=8)


def test_binomial_tail_is_exact() -> None:
    assert binomial_greater(0, 10, 0.3) == 1.0
    assert binomial_greater(11, 10, 0.3) == 0.0
    assert binomial_greater(10, 10, 0.5) == pytest.approx(0.5 ** 10)
    assert binomial_greater(1, 3, 0.5) == pytest.approx(1 - 0.125)


def test_in_flight_requests_become_observations_once() -> None:
    finished = traffic(5, 1, start=SPAN)
    live = [waiting(100.0, 4.0), decoding(101.0, 0.05, 0.02),
            waiting(finished[2].started_s + 0.0004, 1.0)]  # finished since the snapshot
    out = live_observations(live, finished)
    assert [o.stage for o in out] == [Stage.WAITING, Stage.DECODING]
    assert out[0].ttft_s == 4.0 and out[0].e2e_s is None  # censored: at least its age
    assert out[1].ttft_s == 0.05 and out[1].itl_p50_s == 0.02


def test_requests_waiting_past_the_baseline_p99_are_a_queue() -> None:
    base = [0.05 + 0.001 * i for i in range(100)]  # p99 about 0.149 s
    window = live_observations([waiting(float(i), 2.0) for i in range(4)], [])
    evidence = queue_evidence(window, base, alpha=0.01)
    assert evidence is not None and evidence.rising
    assert evidence.past == 4 and evidence.waiting == 4 and evidence.oldest_s == 2.0
    # Young waiting requests (under the baseline's p99) are no evidence of a queue.
    young = live_observations([waiting(float(i), 0.1) for i in range(4)], [])
    assert queue_evidence(young, base, alpha=0.01).rising is False  # type: ignore[union-attr]
    assert queue_evidence([], base, alpha=0.01) is None


def test_a_queue_is_named_before_the_waiting_requests_end() -> None:
    """The finished records are the baseline's traffic; eight requests have waited 3 s for a
    first token (TTFT is ~50 ms): queueing, from the live state alone."""
    window = Sample(traffic(40, 2, start=SPAN), SPAN, 48,
                    in_flight=[waiting(SPAN + 9.01 - i * 0.3, 3.0 - i * 0.1) for i in range(8)])
    finding = diagnose(window, BASE)
    assert finding.verdict is Verdict.QUEUEING, finding.summary
    assert finding.confidence >= 0.5
    checks = finding.evidence["checks"]
    assert checks["ttft_rising_live"] is True
    assert finding.evidence["live_queue"]["waiting_past_baseline_p99"] == 8
    assert finding.evidence["samples"]["window"]["in_flight_waiting"] == 8
    # The same window without its live requests reads healthy: the live state decided it.
    quiet = diagnose(Sample(window.observations, SPAN, 40), BASE)
    assert quiet.verdict is Verdict.HEALTHY


def test_decoding_requests_bring_their_pace_so_far() -> None:
    """Too few finished requests to judge; the streams still decoding, at 3x the baseline's
    token gap, make the sample and show decode saturation."""
    finished = traffic(10, 3, start=SPAN, itl=0.030)
    live = [decoding(SPAN + 0.0377 + 0.2 * i, 0.05, 0.030 * (1 + 0.01 * i)) for i in range(30)]
    alone = diagnose(Sample(finished, SPAN, 10), BASE)
    assert alone.verdict is Verdict.INSUFFICIENT_DATA
    finding = diagnose(Sample(finished, SPAN, 40, in_flight=live), BASE)
    assert finding.verdict is Verdict.DECODE_SATURATION, finding.summary
    assert finding.evidence["samples"]["window"]["timed"] == 40


def test_the_streams_decoding_now_show_a_bigger_batch_before_the_window_does() -> None:
    """Issue 13's case: the window is still mostly requests from before the change (ITL 10 ms),
    its TTFT already queueing; the 20 streams decoding now pace at 22 ms. That is out of
    capacity, not queueing; without them, the window alone reads queueing."""
    def queue(p: int) -> float:
        return 40 * (0.030 + 1e-4 * p)

    finished = traffic(40, 4, start=SPAN) + traffic(20, 5, start=SPAN + 0.0031, ttft=queue)
    live = [decoding(SPAN + 0.0413 + 0.3 * i, 1.5, 0.022 * (1 + 0.002 * i)) for i in range(20)]
    alone = diagnose(Sample(finished, SPAN, 60), BASE)
    assert alone.verdict is Verdict.QUEUEING, alone.summary
    finding = diagnose(Sample(finished, SPAN, 80, in_flight=live), BASE)
    assert finding.verdict is Verdict.OUT_OF_CAPACITY, finding.summary
    checks = finding.evidence["checks"]
    assert checks["itl_rising_live"] is True and checks["itl_rise_matters"] is True
    assert finding.evidence["itl_in_flight"]["ratio"] > 2
    assert finding.evidence["itl"]["rising"] is False  # the window's median has not moved


def test_the_batch_at_the_snapshot_counts_even_when_it_has_ended_since() -> None:
    """Short streams end between a snapshot and the round: their records are the finished
    ones (counted once in the window), yet as the snapshot's batch they still show its pace."""
    def queue(p: int) -> float:
        return 40 * (0.030 + 1e-4 * p)

    batch = [decoding(SPAN + 0.0413 + 0.3 * i, 1.5, 0.022) for i in range(20)]
    ended = [Observation(started_s=r.started_s, ok=True, ttft_s=1.5, e2e_s=2.5, itl_count=25,
                         itl_p50_s=0.022, itl_max_s=0.03, prompt_tokens=200, in_flight=30)
             for r in batch[:15]]
    finished = traffic(60, 4, start=SPAN) + traffic(20, 5, start=SPAN + 0.0031, ttft=queue)
    finished += ended
    finding = diagnose(Sample(finished, SPAN, 95, in_flight=batch), BASE)
    assert finding.evidence["samples"]["window"]["timed"] == 100  # 95 finished + 5 still open
    assert finding.evidence["itl_in_flight"]["window"]["n"] == 20
    assert finding.evidence["checks"]["itl_rising_live"] is True
    assert finding.verdict is Verdict.OUT_OF_CAPACITY, finding.summary
