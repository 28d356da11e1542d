"""The arithmetic of replaying a native stream's logged events (timing.py `exact_events`).

The native leg logs each running token chunk as (read time, completion tokens, prompt tokens);
the replay turns a batch of them into token gaps, as `StreamTiming.event` would have one event
at a time. This is the per-chunk part of the replay, so it runs in the extension (`_native.c`
`replay_exact`) where that is built; `replay_py` is the same arithmetic in Python, the
reference the tests hold the extension to, and what runs where the extension is not built.

Both return, for events of an exactly counted stream whose running count stood at `seen` and
last rose at `last` (ns), with the stream's largest gap and gap total so far:
- `gaps`: the gap of each event that carried tokens, in order (seconds; an event of k tokens
  has a gap of its time since the last / k, for each of its k tokens), as the bytes of native
  doubles (`GapSummary.extend` takes them in one copy: no float object per token);
- `tokens`: the tokens each of those events carried, as the bytes of int64s; None when each
  carried one (the usual: `gaps` is then one per token as it stands). One value per event, not
  per token, so the replay's work and memory go with what the upstream sent, not with a count
  it claims;
- `counts`: (bucket index, count) of the samples (one per token) for each bucket of the ITL
  histogram (`bounds`, its upper bounds) that one fell in, in the buckets' order; None when
  there are no samples or no bounds;
- `sample_sum`: the samples' sum: each event's gap x its tokens, added in order;
- `marked`: (bucket index, gap) for each bucket whose exemplar these samples set (only when
  `exemplars`): the last gap in it that was the stream's largest so far when it came. A
  stream's exemplar goes with each such gap (timing.py), and of several in one bucket the last
  is the one a scrape would see;
- the running count, the time it last rose, the new gap total (summed as `GapSummary.add`
  sums, gap x tokens per event), and the stream's largest gap so far.
A count past `MAX_TOKEN_COUNT` is not one (events.py): its event carries no token.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections.abc import Callable
from importlib import import_module

from phasewatch.core.events import MAX_TOKEN_COUNT

NS = 1_000_000_000

Replayed = tuple[bytes, bytes | None, list[tuple[int, int]] | None, float,
                 list[tuple[int, float]], int, int, float, float]
Replay = Callable[["array[int] | memoryview", int, int, float, float, "array[float]", bool],
                  Replayed]


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
        if tokens <= 0 or completion > MAX_TOKEN_COUNT:
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


try:
    replay_exact = import_module("phasewatch.proxy._native").replay_exact
except ImportError:  # not built here: the same arithmetic in Python
    replay_exact = replay_py
