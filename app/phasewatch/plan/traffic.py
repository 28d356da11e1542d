"""The observed requests a calibration reads, and the load each one ran under.

Invariants: pure (no I/O, no clock); a request's load is reconstructed from the requests
themselves, as the proxy saw them, on the clock of their stored arrival times: the number of
requests decoding at once and the context they held, averaged over the request's own decode
phase (first token to end), and the requests decoding when it arrived.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class Request:
    """One finished, streamed request as stored (times in seconds)."""

    started_s: float
    ttft_s: float
    e2e_s: float
    prompt_tokens: int
    output_tokens: int
    itl_p50_s: float  # its median token gap: a typical step it decoded in

    @property
    def decode_s(self) -> float:
        return self.e2e_s - self.ttft_s

    @property
    def itl_s(self) -> float:
        """The mean gap between its tokens (TPOT): its decode time over its gaps."""
        return self.decode_s / (self.output_tokens - 1)


@dataclass(frozen=True, slots=True)
class Load:
    """What one request ran under."""

    batch: float  # requests decoding at once, time-averaged over its decode phase (itself in)
    context: float  # tokens those requests held (prompt + generated), time-averaged
    batch_at_arrival: int  # requests decoding when it arrived (not itself)
    in_flight_at_arrival: int  # requests in flight when it arrived, waiting or decoding


def loads(requests: Sequence[Request]) -> list[Load]:
    """Each request's `Load`, from every request's decode interval: O(n log n + n k), where k
    is the requests overlapping one (the batch)."""
    n = len(requests)
    if n == 0:
        return []
    start = np.array([r.started_s for r in requests])
    first = start + np.array([r.ttft_s for r in requests])
    end = start + np.array([r.e2e_s for r in requests])
    prompt = np.array([r.prompt_tokens for r in requests], dtype=np.float64)
    output = np.array([r.output_tokens for r in requests], dtype=np.float64)
    by_first = np.argsort(first, kind="stable")
    first_sorted = first[by_first]
    out: list[Load] = []
    for i in range(n):
        lo, hi = first[i], end[i]
        span = hi - lo
        # The requests whose decode overlaps [lo, hi]: started decoding before hi, ended after lo.
        candidates = by_first[: np.searchsorted(first_sorted, hi, side="right")]
        overlap = candidates[end[candidates] > lo]
        a = np.maximum(first[overlap], lo)
        b = np.minimum(end[overlap], hi)
        share = (b - a) / span if span > 0 else np.ones(overlap.size)
        # Context of each: its prompt plus the tokens it had made at the overlap's midpoint.
        made = output[overlap] * ((a + b) / 2 - first[overlap]) / np.maximum(
            end[overlap] - first[overlap], 1e-9)
        context = prompt[overlap] + made
        decoding = int(np.count_nonzero((first <= start[i]) & (end > start[i])))
        in_flight = int(np.count_nonzero((start < start[i]) & (end > start[i])))
        out.append(Load(float(share.sum()), float((share * context).sum()), decoding,
                        in_flight))
    return out
