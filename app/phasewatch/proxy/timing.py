"""Timing state of one streamed response, observed as it happens, and the figures derived.

Clock: every timestamp is `time.perf_counter_ns()` read by the proxy at the moment a read from
the upstream returned, just before those bytes are forwarded to the client. Intervals:

- arrival:  the proxy has the request: its first bytes were read from the client's socket
            (under another ASGI server: the app was called).
- TTFT:     arrival -> the read that completed the first event carrying a token. With exact
            token counts (below) that is the first event whose running completion-token count
            is above zero, even if its text is empty (a partial UTF-8 character); otherwise the
            first event carrying output (text, content, reasoning or a tool-call delta). A
            role-only chunk is neither. Observed into the TTFT histogram at that moment.
- ITL:      the gap between two consecutive token-carrying events, divided evenly over the
            tokens the later event carries; so a gap before a k-token event yields k samples
            of gap/k.
            Exact counts: the request asks one choice and the upstream sends running usage on
            its events (`continuous_usage_stats`, which phasewatch asks vLLM for). Each
            event's tokens are the rise of that count, and its samples are observed into the
            ITL histogram when it arrives (chunks the native leg relayed: when they are
            replayed, `exact_events`, at most one live pass later, each with its own time).
            An event that does not raise the count carries no token; its gap folds into the
            next token's. A stream of n tokens whose first event carries one has exactly
            n - 1 samples.
            Otherwise (no running usage, or n > 1, where vLLM counts each choice apart) the
            tokens per event are only known from the final usage: when the stream ends, that
            count is spread over the events in proportion to their characters (at least one
            each; one each when there is no final count) and the samples are observed then.
            At most `PENDING_LIMIT` events wait for that; a longer stream's later events
            count one token each, observed as they arrive.
- E2E:      arrival -> the last read of the response (for a stream, the one with `[DONE]`).
- TPOT:     (E2E - TTFT) / (output_tokens - 1), the definition vLLM and vllm bench use.
E2E, TPOT and token counts are observed when the request ends.

A stream's own ITL figures for its record (count, mean, p50, p95, max) are kept in bounded
memory (`gap_summary.py`, exact up to 2,048 gaps). `StreamTiming` is filled on the hot path;
`settle()` apportions what waited for the final usage; `figures()` is the pure arithmetic.
"""

from __future__ import annotations

import logging
from array import array
from dataclasses import dataclass, field
from enum import Enum

from phasewatch.core.log_throttle import LogThrottle
from phasewatch.core.metrics import Exemplar, Observe, ObserveCounts
from phasewatch.proxy._native import replay_exact
from phasewatch.proxy.gap_summary import GapSummary, Summary

log = logging.getLogger(__name__)
# A metrics fault would recur on every token of every stream: logged once a minute.
_OBSERVE_FAULTS = LogThrottle()

NS = 1_000_000_000
PENDING_LIMIT = 8192  # events that may wait for the final usage (16 bytes each)

# Where TTFT and ITL go (`Observe`, app/phasewatch/core/metrics.py): the exemplar (the request's id)
# goes with a TTFT and with each gap that is the largest of its stream so far, so a bucket's
# exemplar names a request whose worst gap fell in it (a few per stream, not one per token).


def _nowhere(_: float, __: Exemplar | None = None) -> None:
    pass


def _nowhere_counts(_: list[tuple[int, int]], __: float, ___: list[tuple[int, float]],
                    ____: Exemplar | None) -> None:
    pass


class Counting(Enum):
    """How the tokens of a stream's events are counted; decided at its first token."""

    PENDING = "pending"  # no token yet
    EXACT = "exact"  # from the upstream's running usage, event by event
    ESTIMATED = "estimated"  # apportioned from the final usage when the stream ends


@dataclass(slots=True)
class StreamTiming:
    arrival_ns: int
    single_choice: bool = True  # the request asked one choice (n absent or 1)
    # Where TTFT and ITL samples go as they are measured (the relay binds the histograms).
    observe_ttft: Observe = _nowhere
    observe_itl: Observe = _nowhere
    observe_itl_counts: ObserveCounts = _nowhere_counts  # the ITL histogram, many at once
    # The ITL histogram's upper bounds, for `observe_itl_counts` (none: nothing observed).
    itl_bounds: array[float] = field(default_factory=lambda: array("d"))
    exemplar: Exemplar | None = None  # None: no exemplars
    counting: Counting = Counting.PENDING
    first_output_ns: int | None = None
    last_output_ns: int | None = None  # the last event that carried tokens
    end_ns: int | None = None
    tokens_seen: int = 0  # exact: the running completion-token count at the last token event
    gaps: GapSummary = field(default_factory=GapSummary)
    # Estimated: the first event's characters, then per later event the gap before it and its
    # characters, until the final usage says how many tokens they carried.
    first_chars: int = 0
    pending_gaps: array[int] | None = None  # made when the stream turns out estimated
    pending_chars: array[int] | None = None
    overflow: int = 0  # events past PENDING_LIMIT, counted one token each
    events: int = 0  # estimated: the events that carried output
    # Totals from the last usage the upstream sent.
    prompt_tokens: int | None = None
    completion_tokens: int | None = None

    def event(self, now_ns: int, cumulative: int | None, chars: int) -> None:
        """An event that may carry tokens: its running completion count (None: it had no
        usage) and its characters of output."""
        if self.counting is Counting.EXACT:
            if cumulative is None:
                return  # its tokens are counted at the next event with usage
            self.tokens_seen, self.last_output_ns = self._observe(
                array("q", (now_ns, cumulative, -1)), self.tokens_seen, self.last_output_ns)
        elif self.counting is Counting.PENDING:
            self._first(now_ns, cumulative, chars)
        else:
            last, self.last_output_ns = self.last_output_ns, now_ns
            assert last is not None
            self.events += 1
            gaps, chars_of = self.pending_gaps, self.pending_chars
            assert gaps is not None and chars_of is not None
            if len(gaps) < PENDING_LIMIT:
                gaps.append(now_ns - last)
                chars_of.append(chars)
            else:
                self.overflow += 1
                self._observe_gaps([now_ns - last], [1])

    def exact_events(self, logged: array[int] | memoryview) -> None:
        """Events of an exactly counted stream as (read time, completion tokens, prompt tokens
        or -1) triples (the native leg's log, native.py; int64s, as an array or a memoryview
        cast to them): what `event()` on each in turn with its usage would do, in one pass: the
        ITL samples observed together as counts per bucket."""
        if self.counting is Counting.PENDING:
            # Taken before its first token (native.py): the first events, up to the first
            # token, one by one as `event()` has them; the rest, counted exactly, in one pass.
            i = 0
            while i < len(logged) and self.counting is Counting.PENDING:
                self.completion_tokens = logged[i + 1]
                self.prompt_tokens = logged[i + 2] if logged[i + 2] >= 0 else None
                self.event(logged[i], logged[i + 1], 0)
                i += 3
            logged = logged[i:]
        if self.counting is not Counting.EXACT:
            for i in range(0, len(logged), 3):
                self.completion_tokens = logged[i + 1]
                self.prompt_tokens = logged[i + 2] if logged[i + 2] >= 0 else None
                self.event(logged[i], logged[i + 1], 0)
            return
        if not logged:
            return
        self.tokens_seen, self.last_output_ns = self._observe(
            logged, self.tokens_seen, self.last_output_ns)
        self.completion_tokens = logged[-2]
        self.prompt_tokens = logged[-1] if logged[-1] >= 0 else None

    def _observe(self, events: array[int] | memoryview, seen: int,
                 last: int | None) -> tuple[int, int]:
        """The token gaps of `events` (triples) after a running count of `seen` that last rose
        at `last`, by the one ITL arithmetic (csrc/itl.c): into the stream's gaps and the ITL
        histogram, the exemplar with each gap that is the stream's largest so far. Returns the
        running count and the time it last rose."""
        assert last is not None
        gaps, exemplar = self.gaps, self.exemplar
        largest_before = gaps.largest
        event_gaps, tokens, counts, sample_sum, marked, seen, last, total, largest = (
            replay_exact(events, seen, last, largest_before, gaps.total, self.itl_bounds,
                         exemplar is not None))
        gaps.extend(event_gaps, tokens, total, largest)
        try:
            if counts is not None:
                self.observe_itl_counts(counts, sample_sum, marked, exemplar)
            elif not self.itl_bounds and event_gaps:
                # No histogram bound (its bounds unset): one call per token, to whatever
                # listens; a gap that is the stream's largest yet carries the exemplar.
                self._observe_each(event_gaps, tokens, largest_before)
        except Exception:  # metrics must never break a stream
            _OBSERVE_FAULTS.exception(log, "could not observe an ITL")
        return seen, last

    def _observe_each(self, event_gaps: bytes, tokens: bytes | None, largest: float) -> None:
        runs = memoryview(tokens).cast("q") if tokens is not None else None
        for i, gap in enumerate(memoryview(event_gaps).cast("d")):
            marked = self.exemplar if gap > largest else None
            largest = max(largest, gap)
            self.observe_itl(gap, marked)
            for _ in range((1 if runs is None else runs[i]) - 1):
                self.observe_itl(gap, None)

    def _observe_gaps(self, gaps_ns: list[int] | array[int], tokens: list[int]) -> None:
        """Gaps known apart from any count (estimated counting): each of `gaps_ns[i]` spread
        over `tokens[i]` tokens, by the same arithmetic as running counts (`_observe`)."""
        events = array("q")
        elapsed = count = 0
        for gap_ns, k in zip(gaps_ns, tokens, strict=True):
            elapsed += gap_ns
            count += k
            events.extend((elapsed, count, -1))
        self._observe(events, 0, 0)

    def _first(self, now_ns: int, cumulative: int | None, chars: int) -> None:
        if cumulative is not None and self.single_choice:
            if cumulative <= 0 and not chars:
                return  # no token yet (an empty chunk whose count has not moved)
            self.counting = Counting.EXACT
            self.tokens_seen = cumulative
        else:
            self.counting = Counting.ESTIMATED
            self.first_chars = chars
            self.events = 1
            self.pending_gaps, self.pending_chars = array("q"), array("q")
        self.first_output_ns = self.last_output_ns = now_ns
        try:
            self.observe_ttft((now_ns - self.arrival_ns) / NS, self.exemplar)
        except Exception:  # metrics must never break a stream
            _OBSERVE_FAULTS.exception(log, "could not observe a TTFT")

    def settle(self) -> None:
        """The stream has ended: apportion what waited for the final usage (estimated only)."""
        gaps, chars_of = self.pending_gaps, self.pending_chars
        self.pending_gaps = self.pending_chars = None
        if gaps is None or chars_of is None or not (gaps or self.overflow):
            return
        events = 1 + len(gaps)
        total = self.completion_tokens
        share = None if total is None else total - self.overflow
        if share is None or share <= events:
            tokens = [1] * events
        else:
            tokens = _spread(share, [self.first_chars, *chars_of])
        if gaps:
            self._observe_gaps(gaps, tokens[1:])

    @property
    def tokens_exact(self) -> bool:
        """The output token count and the tokens behind each ITL sample are known, not
        estimated."""
        if self.counting is Counting.EXACT:
            return self.completion_tokens is None or self.completion_tokens == self.tokens_seen
        if self.counting is Counting.PENDING:
            return True
        # One token per event, confirmed by the final count.
        return self.completion_tokens == self.events

    @property
    def output_tokens(self) -> int | None:
        if self.completion_tokens is not None:
            return self.completion_tokens
        if self.counting is Counting.EXACT:
            return self.tokens_seen
        if self.counting is Counting.ESTIMATED:
            return self.events
        return None


@dataclass(slots=True)  # one per request: not frozen, as `RequestPlan` (request_plan.py)
class Figures:
    ttft_s: float | None
    e2e_s: float | None
    tpot_s: float | None
    itl: Summary  # count, mean, p50, p95, max of the token gaps
    output_tokens: int | None
    prompt_tokens: int | None
    tokens_exact: bool


def figures(t: StreamTiming) -> Figures:
    """The request's figures; after `settle()`."""
    e2e = (t.end_ns - t.arrival_ns) / NS if t.end_ns is not None else None
    output_tokens = t.output_tokens
    if t.first_output_ns is None:
        return Figures(None, e2e, None, t.gaps.summary(), output_tokens, t.prompt_tokens, True)
    ttft = (t.first_output_ns - t.arrival_ns) / NS
    tpot = None
    if e2e is not None and output_tokens is not None and output_tokens > 1:
        tpot = (e2e - ttft) / (output_tokens - 1)
    return Figures(ttft, e2e, tpot, t.gaps.summary(), output_tokens, t.prompt_tokens,
                   t.tokens_exact)


def _spread(total: int, weights: list[int]) -> list[int]:
    """Split `total` tokens over events in proportion to their characters, at least one each."""
    weight_sum = sum(weights)
    if weight_sum <= 0:
        weights, weight_sum = [1] * len(weights), len(weights)
    shares = [total * w / weight_sum for w in weights]
    counts = [max(1, int(share)) for share in shares]
    remainders = [share - int(share) for share in shares]
    by_remainder = sorted(range(len(shares)), key=remainders.__getitem__, reverse=True)
    diff = total - sum(counts)
    for i in by_remainder[:max(0, diff)]:  # hand out what rounding down left over
        counts[i] += 1
    for i in reversed(by_remainder):  # or take back what the at-least-one floor added
        if diff >= 0:
            break
        if counts[i] > 1:
            counts[i] -= 1
            diff += 1
    return counts
