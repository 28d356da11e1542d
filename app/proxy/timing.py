"""Timing state of one streamed response, and the figures derived from it.

Clock: every timestamp is `time.perf_counter_ns()` read by the proxy at the moment a read from
the upstream returned, just before those bytes are forwarded to the client. Intervals:

- arrival:  the proxy has the request (its headers parsed), before the body is read.
- TTFT:     arrival -> the read that completed the first event carrying output (text, content,
            reasoning or a tool-call delta). A role-only chunk is not output.
- ITL:      the gap between two consecutive output-carrying events, divided evenly over the
            tokens the later event carries; so a gap before a k-token event yields k samples
            of gap/k. Tokens per event come from the upstream's running `usage`
            (`continuous_usage_stats`); without it they are estimated from the final usage
            count spread over events in proportion to their characters.
- E2E:      arrival -> the last read of the response (for a stream, the one with `[DONE]`).
- TPOT:     (E2E - TTFT) / (output_tokens - 1), the definition vLLM and vllm bench use.

`StreamTiming` is a plain record filled on the hot path; `figures()` is the pure arithmetic.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from app.core.quantiles import percentile

NS = 1_000_000_000


@dataclass(slots=True)
class StreamTiming:
    arrival_ns: int
    first_output_ns: int | None = None
    last_output_ns: int | None = None
    end_ns: int | None = None
    # Per output-carrying event after the first: the gap before it, its cumulative completion
    # token count when the upstream sent one, and its characters of output.
    gaps_ns: list[int] = field(default_factory=list)
    cumulative: list[int | None] = field(default_factory=list)
    chars: list[int] = field(default_factory=list)
    first_cumulative: int | None = None
    first_chars: int = 0
    # Totals from the last usage the upstream sent.
    prompt_tokens: int | None = None
    completion_tokens: int | None = None

    def output(self, now_ns: int, cumulative: int | None, chars: int) -> None:
        if self.last_output_ns is None:
            self.first_output_ns = now_ns
            self.first_cumulative = cumulative
            self.first_chars = chars
        else:
            self.gaps_ns.append(now_ns - self.last_output_ns)
            self.cumulative.append(cumulative)
            self.chars.append(chars)
        self.last_output_ns = now_ns


@dataclass(slots=True, frozen=True)
class Figures:
    ttft_s: float | None
    e2e_s: float | None
    tpot_s: float | None
    itl_s: list[float]  # one sample per token gap, in arrival order
    output_tokens: int | None
    prompt_tokens: int | None
    tokens_exact: bool  # per-event token counts came from the upstream, not an estimate


def figures(t: StreamTiming) -> Figures:
    e2e = (t.end_ns - t.arrival_ns) / NS if t.end_ns is not None else None
    if t.first_output_ns is None:
        return Figures(None, e2e, None, [], t.completion_tokens, t.prompt_tokens, True)
    ttft = (t.first_output_ns - t.arrival_ns) / NS
    tokens, exact = _tokens_per_event(t)
    itl: list[float] = []
    carried = 0
    for gap, k in zip(t.gaps_ns, tokens[1:], strict=True):
        carried += gap
        if k <= 0:
            continue  # usage did not move: fold this gap into the next token's
        itl.extend([carried / k / NS] * k)
        carried = 0
    output_tokens = t.completion_tokens if t.completion_tokens is not None else sum(tokens)
    tpot = None
    if e2e is not None and output_tokens > 1:
        tpot = (e2e - ttft) / (output_tokens - 1)
    return Figures(ttft, e2e, tpot, itl, output_tokens, t.prompt_tokens, exact)


def _tokens_per_event(t: StreamTiming) -> tuple[list[int], bool]:
    """Tokens carried by each output event, exact from running usage or else estimated."""
    cumulative = [t.first_cumulative, *t.cumulative]
    if all(c is not None for c in cumulative):
        known = [c or 0 for c in cumulative]
        steps = [b - a for a, b in itertools.pairwise(known)]
        # With n > 1, vLLM's running usage counts each choice apart: it can go down between
        # chunks, and it ends below the final usage (all choices). Then it does not say what
        # each event carried, and the estimate below is used.
        agrees = t.completion_tokens is None or known[-1] == t.completion_tokens
        if agrees and all(step >= 0 for step in steps):
            return [known[0], *steps], True
    events = len(cumulative)
    total = t.completion_tokens
    if total is None or total <= events:
        return [1] * events, total == events
    return _spread(total, [t.first_chars, *t.chars]), False


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


Summary = tuple[int, float | None, float | None, float | None, float | None]


def summarize(samples: list[float]) -> Summary:
    """count, mean, p50, p95, max of ITL samples (nearest-rank percentiles)."""
    if not samples:
        return 0, None, None, None, None
    ordered = sorted(samples)
    n = len(ordered)
    return n, sum(ordered) / n, percentile(ordered, 0.50), percentile(ordered, 0.95), ordered[-1]
