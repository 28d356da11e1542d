"""Test oracles: the replay arithmetic and the nearest-rank percentiles, in plain Python.

`replay_py` is what `phasewatch.proxy._native.replay_exact` (app/phasewatch/proxy/csrc/itl.c) must
return for the same arguments, every double equal: for events of an exactly counted stream whose
running count stood at `seen` and last rose at `last` (ns), with the stream's largest gap and gap
total so far, it returns
- `gaps`: the gap of each event that carried tokens, in order (seconds: an event of k tokens
  has a gap of its time since the last / k, for each of its k tokens), as native doubles' bytes;
- `tokens`: the tokens each of those events carried, as int64s' bytes; None when each carried one;
- `counts`: (bucket index, count) of the samples (one per token) for each bucket of the ITL
  histogram (`bounds`, its upper bounds, the last +Inf) that one fell in; None when there are
  no samples or no bounds;
- `sample_sum`: the samples' sum, each event's gap x its tokens, added in order;
- `marked`: (bucket index, gap) for each bucket whose exemplar these samples set (only when
  `exemplars`): the last gap in it that was the stream's largest so far when it came;
- the running count, the time it last rose, the new gap total, and the largest gap so far. A count
  past `MAX_TOKEN_COUNT` (or below 0) is not one (events.py): its event carries no token.
  `nearest_ranks_py` is what `_native.nearest_ranks` returns (app/phasewatch/core/quantiles.py's
  rule).
"""

from __future__ import annotations

from array import array
from bisect import bisect_left

from phasewatch.core.events import MAX_TOKEN_COUNT
from phasewatch.core.quantiles import percentile

NS = 1_000_000_000

Replayed = tuple[bytes, bytes | None, list[tuple[int, int]] | None, float,
                 list[tuple[int, float]], int, int, float, float]

def replay_py(events: array[int] | memoryview, seen: int, last: int, largest: float,
              total: float, bounds: array[float], exemplars: bool) -> Replayed:
    gaps = array("d")
    tokens_of = array("q")
    counts = [0] * len(bounds)
    marks: dict[int, float] = {}
    sample_sum = 0.0
    for i in range(0, len(events), 3):
        completion = events[i + 1]
        tokens = completion - seen
        if tokens <= 0 or completion > MAX_TOKEN_COUNT or completion < 0:
            continue
        now_ns = events[i]
        gap_s = (now_ns - last) / NS / tokens
        seen, last = completion, now_ns
        total += gap_s * tokens
        gaps.append(gap_s)
        tokens_of.append(tokens)
        largest_yet = gap_s > largest
        if largest_yet:
            largest = gap_s
        if not bounds:
            continue
        bucket = bisect_left(bounds, gap_s)
        counts[bucket] += tokens
        sample_sum += gap_s * tokens
        if largest_yet and exemplars:
            marks[bucket] = gap_s
    several = tokens_of.tobytes() if any(k > 1 for k in tokens_of) else None
    if not gaps or not bounds:
        return gaps.tobytes(), several, None, 0.0, [], seen, last, total, largest
    tallied = [(index, count) for index, count in enumerate(counts) if count]
    return (gaps.tobytes(), several, tallied, sample_sum, sorted(marks.items()), seen, last,
            total, largest)




def nearest_ranks_py(values: array[float], q1: float, q2: float) -> tuple[float | None,
                                                                         float | None]:
    ordered = sorted(values)
    return percentile(ordered, q1), percentile(ordered, q2)
