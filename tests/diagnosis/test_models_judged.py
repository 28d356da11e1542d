"""Which models each round of the schedule judges, on stored records and explicit round times.

A new leader's first round counts the served models over the whole window + baseline; later
rounds look each exported model up on its own and count the others over the window alone. The
set judged is the same either way: an exported model is kept while it has a served request
anywhere in the span, a model served in the window joins, a name only answered with errors
never does, and the label limit keeps the exported ones first."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

from phasewatch.core.db import create_engine, create_sessionmaker
from phasewatch.core.settings import load_settings
from phasewatch.diagnosis.service import DiagnosisService
from phasewatch.store.diagnoses import still_served
from phasewatch.store.migrate import upgrade
from phasewatch.store.models import RequestRow
from tests.diagnosis.test_api import insert, rows

T0 = datetime(2026, 11, 30, 8, 0, 0, tzinfo=UTC)
WINDOW_S, BASELINE_S = 60, 300


def failed(model: str, start: datetime, n: int) -> list[RequestRow]:
    out = rows(model, start, 30, n, seed=7)
    for row in out:
        row.outcome, row.http_status = "http_error", 503
    return out


async def test_exported_models_stay_while_served_and_the_window_brings_new_ones(
        sqlite_url: str) -> None:
    await asyncio.to_thread(upgrade, sqlite_url)
    at = T0.__add__
    await asyncio.to_thread(insert, sqlite_url, [
        *rows("old", at(timedelta(seconds=0)), 30, 40, seed=1),  # in the baseline only
        *rows("a", at(timedelta(seconds=300)), 60, 30, seed=2),
        *failed("broken", at(timedelta(seconds=300)), 50),  # the busiest name, never served
        *rows("late", at(timedelta(seconds=400)), 20, 20, seed=3),
    ])
    settings = load_settings(database_url=sqlite_url, diagnosis_window_s=WINDOW_S,
                             diagnosis_recent_s=WINDOW_S, diagnosis_baseline_s=BASELINE_S,
                             max_model_labels=2, engine_metrics_enabled=False)
    engine = create_engine(sqlite_url)
    service = DiagnosisService(create_sessionmaker(engine), settings)
    try:
        first = await service.evaluate_all(now=at(timedelta(seconds=361)))
        # The first round: the whole span, busiest first ("old" 40, "a" 30); "broken" never.
        assert list(first) == ["old", "a"]
        # "old" is still in the span (its requests until 29 s; the span starts at 2 s).
        assert list(await service.evaluate_all(now=at(timedelta(seconds=362)))) == ["old", "a"]
        # "old" has left the span; "late", served in the window, takes its place.
        assert list(await service.evaluate_all(now=at(timedelta(seconds=425)))) == ["a", "late"]
        # "a" and "late" keep their places while served anywhere in the span.
        assert list(await service.evaluate_all(now=at(timedelta(seconds=700)))) == ["a", "late"]
        # Nothing served in the span: nothing judged.
        assert await service.evaluate_all(now=at(timedelta(seconds=1200))) == {}
        # With nothing exported, the whole span is counted again: a model served only in the
        # baseline is found.
        await asyncio.to_thread(insert, sqlite_url, rows("quiet", at(timedelta(seconds=1000)),
                                                         20, 20, seed=4))
        assert list(await service.evaluate_all(now=at(timedelta(seconds=1300)))) == ["quiet"]
        async with create_sessionmaker(engine)() as session:
            assert await still_served(session, ["late", "broken", "a"], at(timedelta(0)),
                                      at(timedelta(seconds=1000))) == ["late", "a"]
    finally:
        await engine.dispose()
