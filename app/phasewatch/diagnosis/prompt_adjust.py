"""TTFT at equal prompt length and decode pace: the part of TTFT that is neither prefill work
nor slower steps, i.e. waiting.

Each request's TTFT is divided by the baseline's median TTFT for prompts of the same length
(the same octave: 128-255 tokens, 256-511, ...), and by its own decode pace relative to the
baseline's (its median token gap over the baseline's median of those).

- Prompt length: prefill work grows with the prompt, so a window that simply received longer
  prompts has a higher TTFT with nothing wrong with the server (that is prefill-bound, not
  queueing).
- Decode pace: a request's first token comes out of an engine step, and when the decode batch
  grows every step is longer, TTFT included, by the same factor as ITL (decode saturation, not
  queueing). Dividing by the pace leaves TTFT in units of steps: queueing adds steps.

The baseline's own ratios centre on 1; the window's show what changed beyond prompt length and
pace. A prompt length the baseline never saw (fewer than `min_stratum` requests in its octave)
cannot be judged; the share of window requests that could is `coverage`. Pace is used only
when nearly every request has token gaps (streams of one token have none).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from phasewatch.core.quantiles import percentile
from phasewatch.diagnosis.compare import Shift, compare
from phasewatch.diagnosis.observations import Observation

PACE_COVERAGE = 0.8  # share of requests with a decode pace needed to use it


def stratum(prompt_tokens: int) -> int:
    """The prompt's octave: floor(log2(tokens))."""
    return max(0, prompt_tokens).bit_length() - 1


@dataclass(frozen=True, slots=True)
class Adjusted:
    """Relative TTFT per request: 1 is the baseline's typical TTFT at that prompt length."""

    window: list[float]  # window requests whose octave the baseline has
    baseline: list[float]
    coverage: float  # share of the window's requests (with a prompt length) judged
    strata: int  # octaves with a baseline median
    by_pace: bool  # divided by each request's decode pace too


def _pace(o: Observation, min_gaps: int) -> float | None:
    if o.itl_count < min_gaps or o.itl_p50_s is None or o.itl_p50_s <= 0:
        return None
    return o.itl_p50_s


def relative_ttft(
    window: Sequence[Observation], baseline: Sequence[Observation], min_stratum: int,
    min_gaps: int,
) -> Adjusted:
    by_stratum: dict[int, list[float]] = defaultdict(list)
    for o in baseline:
        if o.ttft_s is not None and o.prompt_tokens is not None:
            by_stratum[stratum(o.prompt_tokens)].append(o.ttft_s)
    medians: dict[int, float] = {}
    for key, values in by_stratum.items():
        if len(values) >= min_stratum:
            middle = percentile(sorted(values), 0.5)
            if middle is not None and middle > 0:
                medians[key] = middle

    paces_b = sorted(p for o in baseline if (p := _pace(o, min_gaps)) is not None)
    by_pace = (
        bool(paces_b) and len(paces_b) >= PACE_COVERAGE * len(baseline)
        and sum(1 for o in window if _pace(o, min_gaps) is not None)
        >= PACE_COVERAGE * len(window)
    )
    base_pace = percentile(paces_b, 0.5) if by_pace else None

    def relative(sample: Sequence[Observation]) -> tuple[list[float], int]:
        out: list[float] = []
        known = 0
        for o in sample:
            if o.ttft_s is None or o.prompt_tokens is None:
                continue
            known += 1
            middle = medians.get(stratum(o.prompt_tokens))
            if middle is None:
                continue
            value = o.ttft_s / middle
            if base_pace is not None:
                pace = _pace(o, min_gaps)
                if pace is None:
                    continue
                value /= pace / base_pace
            out.append(value)
        return out, known

    rw, known_w = relative(window)
    rb, _ = relative(baseline)
    return Adjusted(rw, rb, len(rw) / known_w if known_w else 0.0, len(medians),
                    base_pace is not None)


def adjusted_shift(
    adjusted: Adjusted, *, min_samples: int, min_coverage: float, threshold: float,
    alpha: float, rng: np.random.Generator, rounds: int,
) -> Shift | None:
    """The window-vs-baseline comparison of relative TTFT; None when too little of the window
    has a baseline to compare with."""
    enough = max(5, math.ceil(min_samples / 2))
    if (adjusted.coverage < min_coverage or len(adjusted.window) < enough
            or len(adjusted.baseline) < enough):
        return None
    return compare(adjusted.window, adjusted.baseline, threshold=threshold, alpha=alpha,
                   rng=rng, rounds=rounds)
