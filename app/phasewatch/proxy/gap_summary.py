"""One stream's token gaps in bounded memory: count, mean, p50, p95 and max for its record.

The gaps are kept as they are up to `EXACT_LIMIT` samples (16 KB); past that, all of them are
folded into logarithmic buckets 2% wide, and the stream goes on in those. So:
- count, mean and max are exact whatever the length;
- p50 and p95 are the nearest-rank values exactly up to `EXACT_LIMIT` token gaps, and past it
  within 1% of them (a bucket reads as the value within 1% of every gap in it; gaps of 0,
  tokens read at once, keep a bucket of their own and read as 0).
The metrics never depend on this: every gap is observed into the ITL histogram as it is.
"""

from __future__ import annotations

import math
from array import array
from itertools import repeat

from phasewatch.proxy._native import nearest_ranks

EXACT_LIMIT = 2048
_GAMMA = 1.02
_LOG_GAMMA = math.log(_GAMMA)
_CENTRE = 2 * _GAMMA / (1 + _GAMMA)  # bucket k spans (g^k, g^(k+1)]; it reads as this x g^k
_ZERO = -(1 << 30)  # the bucket of zero gaps

Summary = tuple[int, float | None, float | None, float | None, float | None]


class GapSummary:
    __slots__ = ("_buckets", "_exact", "count", "largest", "total")

    def __init__(self) -> None:
        self.count = 0
        self.total = 0.0
        self.largest = 0.0
        self._exact: array[float] | None = array("d")
        self._buckets: dict[int, int] = {}

    def add(self, gap_s: float, times: int = 1) -> None:
        """`times` token gaps of `gap_s` seconds each."""
        self.count += times
        self.total += gap_s * times
        if gap_s > self.largest:
            self.largest = gap_s
        exact = self._exact
        if exact is not None:
            if len(exact) + times <= EXACT_LIMIT:
                if times == 1:
                    exact.append(gap_s)
                else:
                    exact.extend([gap_s] * times)
                return
            self._exact = None
            for gap in exact:
                self._count_in_bucket(gap, 1)
        self._count_in_bucket(gap_s, times)

    def extend(self, gaps: bytes, tokens: bytes | None, total: float, largest: float) -> None:
        """Token-carrying events, as the replay gives them (csrc/itl.c): each one's gap, in
        order, as the bytes of native doubles, and the tokens each carried as the bytes of
        int64s (None: one each). What `add(gap, k)` on each in turn leaves. `total` is the
        running total that reaches, summed by the caller as `add` sums (`self.total` plus each
        event's gap x its tokens), so the mean is the same to the bit; `largest`, the largest
        gap of the stream with them. The work goes with the events, not the tokens, once the
        gaps are past `EXACT_LIMIT`."""
        if not gaps:
            return
        runs = None if tokens is None else memoryview(tokens).cast("q")
        added = len(gaps) // 8 if runs is None else sum(runs)
        self.count += added
        self.total = total
        if largest > self.largest:
            self.largest = largest
        exact = self._exact
        if exact is not None:
            if len(exact) + added <= EXACT_LIMIT:
                if runs is None:
                    exact.frombytes(gaps)
                else:
                    for gap, k in zip(memoryview(gaps).cast("d"), runs, strict=True):
                        exact.extend(repeat(gap, k))
                return
            self._exact = None
            for gap in exact:
                self._count_in_bucket(gap, 1)
        if runs is None:
            for gap in memoryview(gaps).cast("d"):
                self._count_in_bucket(gap, 1)
        else:
            for gap, k in zip(memoryview(gaps).cast("d"), runs, strict=True):
                self._count_in_bucket(gap, k)

    def _count_in_bucket(self, gap_s: float, times: int) -> None:
        key = math.ceil(math.log(gap_s) / _LOG_GAMMA) - 1 if gap_s > 0 else _ZERO
        self._buckets[key] = self._buckets.get(key, 0) + times

    @property
    def exact(self) -> bool:
        """The percentiles are exact (at most `EXACT_LIMIT` gaps)."""
        return self._exact is not None

    def summary(self) -> Summary:
        """count, mean, p50, p95, max (nearest-rank percentiles)."""
        if not self.count:
            return 0, None, None, None, None
        mean = self.total / self.count
        if self._exact is not None:  # their order is of no account: sorted in place
            p50, p95 = nearest_ranks(self._exact, 0.5, 0.95)
            return self.count, mean, p50, p95, self.largest
        return self.count, mean, self._quantile(0.5), self._quantile(0.95), self.largest

    def _quantile(self, q: float) -> float:
        rank = max(1, math.ceil(q * self.count))
        seen = 0
        for key in sorted(self._buckets):
            seen += self._buckets[key]
            if seen >= rank:
                return 0.0 if key == _ZERO else min(_GAMMA ** key * _CENTRE, self.largest)
        return self.largest
