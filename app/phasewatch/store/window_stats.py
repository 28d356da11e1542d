"""Windowed aggregates of the stored requests (`GET /api/stats`), bounded whatever the window holds.

The API shares the relay's event loop and, through the GIL, its CPU, so the rows of a window
must never come to Python: the database computes every figure and the loop reads a handful of
result rows per group. Measured over a million rows with 32 streams: reading just a 20,000-row
sample into Python and ranking it in a worker thread took the relay's chunk-lag p99 from about
2 ms to 12-15 ms; ranked by the database, the calls leave it within 1-2 ms
(tests/faults/test_admin_api_load.py).

- Totals (requests, errors, token sums, the token-weighted ITL mean, in flight at arrival) are
  exact: one GROUP BY over the window.
- Percentiles (nearest rank, as app/phasewatch/core/quantiles.py defines them) are ranked by the
  database
  with window functions over at most `max_rows` rows: the whole window when it holds no more,
  else a uniform sample of it (`sample_key`), so what is sorted stays bounded too.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Literal

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Float,
    Integer,
    Select,
    SQLColumnExpression,
    and_,
    bindparam,
    case,
    cast,
    func,
    literal,
    literal_column,
    null,
    or_,
    select,
    true,
    union_all,
)
from sqlalchemy.ext.asyncio import AsyncSession

from phasewatch.store.models import RequestRow

GroupBy = Literal["model", "endpoint", "none"]
# Percentiles reported, as whole percents: ceil(p * n / 100) is then exact integer arithmetic.
PERCENTS = (50, 90, 95, 99)
# More groups than this (client-chosen model names can be countless) and only the busiest are
# answered: the reply and its work stay bounded.
MAX_GROUPS = 1000

# A row is in the sample when the golden-ratio hash of its id falls below a cut (a Weyl
# sequence: any run of ids, and any subset of them that repeats with a period, is hit in the
# same proportion). Every k-th id would alias with traffic that repeats: a round-robin over 3
# models with k = 3 samples one model only. The same window gives the same sample each time.
# (id mod 2**31) * HASH_MULTIPLIER stays below 2**62: no overflow in SQLite's or Postgres' BIGINT.
HASH_MODULUS = 2**31
HASH_MULTIPLIER = 1_327_217_885  # round(2**31 * (sqrt(5) - 1) / 2), odd


def sample_key() -> ColumnElement[int]:
    """The id's hash in [0, 2**31): rows with `sample_key() < cut` are a cut / 2**31 sample."""
    modulus = literal(HASH_MODULUS, BigInteger())
    return (RequestRow.id % modulus) * HASH_MULTIPLIER % modulus


def sample_cut(rows: int, max_rows: int) -> int | None:
    """The hash cut that keeps about `max_rows` of `rows` (a few more at most: the sample query
    stops at `max_rows`); None when all of them fit."""
    return None if rows <= max_rows else HASH_MODULUS * max_rows // rows


@dataclass(frozen=True, slots=True)
class Totals:
    """One group's exact sums over the window, from the database."""

    group: str | None
    requests: int
    ok: int
    output_ok: int  # output tokens of ok requests
    prompt_ok: int
    gaps: int  # token gaps of requests with an ITL mean
    gap_time_s: float  # their total time
    in_flight_mean: float | None
    in_flight_max: int | None


@dataclass(frozen=True, slots=True)
class Ranked:
    """One group's percentiles as the database ranked them: how many values each figure has,
    and the value at each rank asked for."""

    counts: dict[str, int] = field(default_factory=dict)
    at_rank: dict[tuple[str, int], float] = field(default_factory=dict)

    @property
    def sampled(self) -> int:
        """Rows the percentiles come from."""
        return self.counts.get("rows", 0)

    def named(self, figure: str) -> dict[str, float | None]:
        n = self.counts.get(figure, 0)
        return {f"p{p}": self.at_rank.get((figure, nearest_rank(p, n))) for p in PERCENTS}


def nearest_rank(percent: int, n: int) -> int:
    """ceil(percent / 100 * n), the rank app/phasewatch/core/quantiles.py reads (0 when n is 0)."""
    return (percent * n + 99) // 100


@dataclass(frozen=True, slots=True)
class GroupStats:
    """Aggregates of one group's requests over a window. Definitions in the README."""

    group: str | None
    requests: int
    errors: int
    request_rate_rps: float
    ttft_s: dict[str, float | None]  # p50, p90, p95, p99 over requests with a first token
    itl_mean_s: float | None  # token-weighted: total gap time / token gaps
    itl_p50_s: dict[str, float | None]  # percentiles across requests of each request's ITL p50
    itl_p95_s: dict[str, float | None]  # ... and of each request's ITL p95
    tpot_p50_s: float | None
    e2e_p50_s: float | None
    prompt_tokens_p50: float | None
    output_throughput_tps: float  # output tokens of ok requests / window
    prompt_throughput_tps: float
    in_flight_mean: float | None  # requests in flight when each request arrived
    in_flight_max: int | None
    sampled: int  # rows the percentiles come from: `requests`, or this group's part of a sample


@dataclass(frozen=True, slots=True)
class WindowStats:
    groups: list[GroupStats]  # by group name
    requests: int  # in the window (in the groups answered)
    sampled: int  # rows the percentiles come from: `requests`, or about `max_rows`
    groups_left_off: bool  # more than MAX_GROUPS groups: only the busiest are answered


def _group_key(by: GroupBy) -> SQLColumnExpression[Any]:
    if by == "model":
        return RequestRow.model
    if by == "endpoint":
        return RequestRow.endpoint
    return null()


def _where(model: bool, run_id: bool) -> list[ColumnElement[bool]]:
    """The window, and the filters asked for; their values are bound at each call."""
    where = [RequestRow.started_at >= bindparam("since"),
             RequestRow.started_at < bindparam("until")]
    if model:
        where.append(RequestRow.model == bindparam("model"))
    if run_id:
        where.append(RequestRow.run_id == bindparam("run_id"))
    return where


@functools.cache
def _totals_query(by: GroupBy, model: bool, run_id: bool) -> Select[*tuple[Any, ...]]:
    """Each group's exact sums, the busiest MAX_GROUPS + 1 groups. Built once per shape of call
    (building a statement costs the loop milliseconds, running it again next to nothing)."""
    ok = RequestRow.outcome == "ok"
    timed = and_(RequestRow.itl_count > 0, RequestRow.itl_mean_s.is_not(None))
    key = _group_key(by)
    query = select(
        key,
        func.count(),
        func.coalesce(func.sum(case((ok, 1), else_=0)), 0),
        func.coalesce(func.sum(case((ok, func.coalesce(RequestRow.output_tokens, 0)))), 0),
        func.coalesce(func.sum(case((ok, func.coalesce(RequestRow.prompt_tokens, 0)))), 0),
        func.coalesce(func.sum(case((timed, RequestRow.itl_count))), 0),
        func.coalesce(func.sum(case((timed, RequestRow.itl_mean_s * RequestRow.itl_count))),
                      0.0),
        func.avg(RequestRow.in_flight_at_arrival),
        func.max(RequestRow.in_flight_at_arrival),
    ).where(*_where(model, run_id))
    if by == "none":
        return query
    return query.group_by(key).order_by(func.count().desc(), key).limit(MAX_GROUPS + 1)


@functools.cache
def _ranks_query(by: GroupBy, model: bool, run_id: bool,
                 sampled: bool) -> Select[*tuple[Any, ...]]:
    """Built once per shape of call, as `_totals_query`."""
    return ranks_query(_group_key(by), _where(model, run_id), sampled)


def ranks_query(key: SQLColumnExpression[Any], where: Sequence[ColumnElement[bool]],
                sampled: bool) -> Select[*tuple[Any, ...]]:
    """(group, figure, value, rank, n) of each figure's values at the percentiles' ranks, per
    group, from the window's rows, or their sample (`sampled`: the rows with a `sample_key()`
    below `cut`, at most `max_rows` of them); the n of figure "rows" is the rows read."""
    sample: Select[*tuple[Any, ...]] = select(
        key.label("grp"), RequestRow.outcome, RequestRow.ttft_s, RequestRow.itl_count,
        RequestRow.itl_mean_s, RequestRow.itl_p50_s, RequestRow.itl_p95_s, RequestRow.tpot_s,
        RequestRow.e2e_s, RequestRow.prompt_tokens,
    ).where(*where)
    if sampled:
        sample = (sample.where(sample_key() < bindparam("cut", type_=BigInteger()))
                  .limit(bindparam("max_rows", type_=Integer())))
    s = sample.cte("sample")
    ok = s.c.outcome == "ok"
    timed = and_(s.c.itl_count > 0, s.c.itl_mean_s.is_not(None))
    # Which requests each figure is over: the same as the README says of /api/stats.
    figures: dict[str, tuple[ColumnElement[Any], ColumnElement[bool]]] = {
        "rows": (literal_column("0"), true()),
        "ttft_s": (s.c.ttft_s, s.c.ttft_s.is_not(None)),
        "itl_p50_s": (s.c.itl_p50_s, and_(timed, s.c.itl_p50_s.is_not(None))),
        "itl_p95_s": (s.c.itl_p95_s, and_(timed, s.c.itl_p95_s.is_not(None))),
        "tpot_s": (s.c.tpot_s, and_(ok, s.c.tpot_s.is_not(None))),
        "e2e_s": (s.c.e2e_s, and_(ok, s.c.e2e_s.is_not(None))),
        "prompt_tokens": (cast(s.c.prompt_tokens, Float), s.c.prompt_tokens.is_not(None)),
    }
    values = union_all(*(
        select(s.c.grp, literal_column(f"'{name}'").label("figure"), value.label("v"))
        .where(which) for name, (value, which) in figures.items()
    )).subquery("figure_values")
    by = (values.c.grp, values.c.figure)
    ranked = select(
        values.c.grp, values.c.figure, values.c.v,
        func.row_number().over(partition_by=by, order_by=values.c.v).label("rank"),
        func.count().over(partition_by=by).label("n"),
    ).subquery("ranked")
    wanted = [(ranked.c.n * p + 99) // 100 for p in PERCENTS]  # nearest_rank, in SQL
    return select(ranked.c.grp, ranked.c.figure, ranked.c.v, ranked.c.rank,
                  ranked.c.n).where(ranked.c.rank.in_(wanted))


async def window_stats(
    session: AsyncSession, until: datetime, window: timedelta, by: GroupBy, max_rows: int,
    model: str | None = None, run_id: str | None = None,
) -> WindowStats:
    """Requests that arrived in [until - window, until), per `by`."""
    shape = (by, model is not None, run_id is not None)
    params: dict[str, Any] = {"since": until - window, "until": until, "model": model,
                              "run_id": run_id}
    totals = [
        Totals(group, int(n), int(ok), int(out), int(prompt), int(gaps), float(gap_time),
               None if mean is None else float(mean), flight_max)
        for group, n, ok, out, prompt, gaps, gap_time, mean, flight_max
        in await session.execute(_totals_query(*shape), params)
        if n
    ]
    requests = sum(t.requests for t in totals[:MAX_GROUPS])
    cut = sample_cut(requests, max_rows)
    params.update(cut=cut, max_rows=max_rows)
    query = _ranks_query(*shape, sampled=cut is not None)
    left_off = len(totals) > MAX_GROUPS
    if left_off:  # rank the groups answered only
        totals = totals[:MAX_GROUPS]
        key = _group_key(by)
        names = [t.group for t in totals if t.group is not None]
        kept = key.in_(names)
        query = ranks_query(key, [*_where(*shape[1:]),
                                  or_(kept, key.is_(None)) if len(names) < len(totals) else kept],
                            sampled=cut is not None)
    ranks: dict[str | None, Ranked] = {}
    if totals:
        ranks = collect_ranks(tuple(row) for row in await session.execute(query, params))
    seconds = window.total_seconds()
    groups = [aggregate(t, ranks.get(t.group, Ranked()), seconds)
              for t in sorted(totals, key=lambda t: t.group or "")]
    return WindowStats(groups, requests, sum(g.sampled for g in groups), left_off)


def collect_ranks(rows: Any) -> dict[str | None, Ranked]:
    """Pure: the ranks query's rows (group, figure, value, rank, n), per group."""
    counts: dict[str | None, dict[str, int]] = defaultdict(dict)
    at_rank: dict[str | None, dict[tuple[str, int], float]] = defaultdict(dict)
    for group, figure, value, rank, n in rows:
        counts[group][figure] = int(n)
        at_rank[group][(figure, int(rank))] = value
    return {group: Ranked(found, at_rank[group]) for group, found in counts.items()}


def aggregate(totals: Totals, ranks: Ranked, seconds: float) -> GroupStats:
    """Pure: one group's stats from its totals and its ranked percentiles."""

    def p50(figure: str) -> float | None:
        return ranks.named(figure)["p50"]

    return GroupStats(
        group=totals.group,
        requests=totals.requests,
        errors=totals.requests - totals.ok,
        request_rate_rps=totals.requests / seconds,
        ttft_s=ranks.named("ttft_s"),
        itl_mean_s=totals.gap_time_s / totals.gaps if totals.gaps else None,
        itl_p50_s=ranks.named("itl_p50_s"),
        itl_p95_s=ranks.named("itl_p95_s"),
        tpot_p50_s=p50("tpot_s"),
        e2e_p50_s=p50("e2e_s"),
        prompt_tokens_p50=p50("prompt_tokens"),
        output_throughput_tps=totals.output_ok / seconds,
        prompt_throughput_tps=totals.prompt_ok / seconds,
        in_flight_mean=totals.in_flight_mean,
        in_flight_max=totals.in_flight_max,
        sampled=ranks.sampled,
    )
