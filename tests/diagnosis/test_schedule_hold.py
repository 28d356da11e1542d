"""The schedule over a long incident, on stored records and explicit round times: the verdict
is named, holds for the whole incident (its baseline frozen at the last healthy span), changes
only after the rounds hysteresis asks, and each stored change carries why; and what one round
reads."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from sqlalchemy.ext.asyncio import AsyncSession

from phasewatch.core.db import create_engine, create_sessionmaker
from phasewatch.core.live import InFlight
from phasewatch.core.settings import load_settings
from phasewatch.diagnosis import service as service_module
from phasewatch.diagnosis.metrics import DiagnosisMetrics
from phasewatch.diagnosis.service import DiagnosisService, PreviousSpan
from phasewatch.store.diagnoses import list_diagnoses
from phasewatch.store.live_snapshots import put_snapshot, read_fresh
from phasewatch.store.migrate import upgrade
from tests.diagnosis.test_api import insert, rows

T0 = datetime(2026, 11, 30, 8, 0, 0, tzinfo=UTC)
INCIDENT_S, HEALTHY_S = 1800, 600  # the incident lasts six baselines


async def test_a_long_incident_stays_named_and_its_baseline_is_not_absorbed(
        sqlite_url: str) -> None:
    await asyncio.to_thread(upgrade, sqlite_url)
    await asyncio.to_thread(insert, sqlite_url, [
        *rows("m", T0, HEALTHY_S, HEALTHY_S, seed=1),
        *rows("m", T0 + timedelta(seconds=HEALTHY_S), INCIDENT_S, INCIDENT_S, ttft=2.0, seed=2),
        *rows("m", T0 + timedelta(seconds=HEALTHY_S + INCIDENT_S), 300, 300, seed=3),
    ])
    settings = load_settings(database_url=sqlite_url, diagnosis_window_s=60,
                             diagnosis_recent_s=60, diagnosis_baseline_s=300,
                             diagnosis_hold_rounds=2, diagnosis_switch_confidence=0.95,
                             engine_metrics_enabled=False)
    engine = create_engine(sqlite_url)
    service = DiagnosisService(create_sessionmaker(engine), settings)
    held: list[tuple[int, str]] = []
    try:
        for second in range(360, HEALTHY_S + INCIDENT_S + 300, 30):
            judged = await service.evaluate_all(now=T0 + timedelta(seconds=second))
            held.append((second - HEALTHY_S, judged["m"]))
        during = [v for t, v in held if 60 <= t <= INCIDENT_S]
        assert set(during) == {"queueing"}, held
        assert [v for t, v in held if t < 0] == ["healthy"] * len([t for t, _ in held if t < 0])
        # Onset at 0: the first round after it sees a 30x TTFT, overwhelming evidence.
        first = min(t for t, v in held if v == "queueing")
        assert first == 30, held
        # After the incident the verdict returns to healthy, again after two rounds.
        assert held[-1][1] == "healthy", held
        # Without the frozen baseline the last minutes of the incident show no change: the
        # span before the window was all incident by then. No cause is named, but the window
        # misses the SLO, so it is not healthy either.
        late = T0 + timedelta(seconds=HEALTHY_S + INCIDENT_S - 10)
        plain = await service.diagnose("m", late, timedelta(seconds=60), PreviousSpan(300))
        assert plain["verdict"] == "unexplained"
        assert plain["evidence"]["checks"]["ttft_rising"] is False
        assert plain["evidence"]["checks"]["window_meets_slo"] is False
        async with service.sessionmaker() as session:
            stored, _ = await list_diagnoses(session, "m", 10, None)
        assert [d.verdict for d in reversed(stored)] == ["healthy", "queueing", "healthy"]
        onset = stored[1].evidence
        assert onset["round_verdict"] == "queueing"
        assert onset["evidence"]["schedule"]["because"].startswith("overwhelming")
        # The change says what changed since the last round that agreed with healthy.
        changed = onset["evidence"]["schedule"]["what_changed"]
        assert "ttft_rising: false -> true" in changed
        assert "window_meets_slo: true -> false" in changed
        assert onset["summary"].startswith("Changed from healthy: ")
        # The return to healthy waits the two rounds, however confident the first.
        assert stored[0].evidence["evidence"]["schedule"]["because"] == "held 2 round(s)"
        assert onset["baseline"]["schedule_kind"] == "previous"  # the round that first saw it
        # Every round after it compared with the frozen healthy span, the last one too.
        end = stored[0].evidence
        assert end["baseline"]["schedule_kind"] == "healthy_reference"
        assert end["baseline"]["known_healthy"] is True
        assert stored[0].baseline.startswith("healthy_reference ")
        assert end["baseline"]["until"] <= (T0 + timedelta(seconds=HEALTHY_S + 30)).isoformat()
    finally:
        await engine.dispose()


async def test_a_round_reads_the_requests_in_flight_once_for_all_its_tries(
        sqlite_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With too few requests for the recent window, a round tries the whole window too; both
    tries judge one moment, so the live snapshots (a thousand requests each to parse) are read
    once, and each try has them."""
    await asyncio.to_thread(upgrade, sqlite_url)
    now = T0 + timedelta(seconds=600)
    await asyncio.to_thread(insert, sqlite_url, rows("m", T0 + timedelta(seconds=590), 5, 3))
    settings = load_settings(database_url=sqlite_url, diagnosis_window_s=300,
                             diagnosis_recent_s=60, diagnosis_baseline_s=300,
                             engine_metrics_enabled=False)
    engine = create_engine(sqlite_url)
    service = DiagnosisService(create_sessionmaker(engine), settings)
    waiting = InFlight(model="m", started_s=now.timestamp() - 2, age_s=2.0, ttft_s=None,
                       silent_s=2.0, itl_count=0, itl_p50_s=None, itl_max_s=None,
                       prompt_tokens=None, in_flight=4)
    reads: list[datetime] = []

    async def counted(session: AsyncSession, since: datetime, until: datetime) -> Any:
        reads.append(until)
        return await read_fresh(session, since, until)

    monkeypatch.setattr(service_module, "read_fresh", counted)
    reports: list[dict[str, Any]] = []
    diagnose = service.diagnose

    async def kept(*args: Any, **kwargs: Any) -> dict[str, Any]:
        reports.append(await diagnose(*args, **kwargs))
        return reports[-1]

    monkeypatch.setattr(service, "diagnose", kept)
    try:
        async with service.sessionmaker() as session:
            await put_snapshot(session, "p1", now - timedelta(seconds=1), [waiting] * 3,
                               stale_before=now - timedelta(seconds=60))
        assert await service.evaluate_all(now=now) == {"m": "insufficient_data"}
        assert len(reports) == 2  # the recent window, then the whole one
        assert [r["window"]["seconds"] for r in reports] == [60.0, 300.0]
        assert [r["live"]["requests"] for r in reports] == [3, 3]
        assert len(reads) == 1
    finally:
        await engine.dispose()


async def test_every_default_surface_says_one_verdict_through_a_long_incident(
        sqlite_url: str) -> None:
    """A 30-minute incident, a round every 30 s: after each, the default question (what
    `GET /api/diagnosis` answers, here and in another process), the verdict gauge and the last
    stored change say the same verdict, and from its first detection to its end it is never
    healthy. A process with no fresh round to read (the schedule off) judges the moment as the
    schedule would, from the stored state: not healthy either."""
    await asyncio.to_thread(upgrade, sqlite_url)
    await asyncio.to_thread(insert, sqlite_url, [
        *rows("m", T0, HEALTHY_S, HEALTHY_S, seed=1),
        *rows("m", T0 + timedelta(seconds=HEALTHY_S), INCIDENT_S, INCIDENT_S, ttft=2.0, seed=2),
        *rows("m", T0 + timedelta(seconds=HEALTHY_S + INCIDENT_S), 300, 300, seed=3),
    ])
    common = {"database_url": sqlite_url, "diagnosis_window_s": 60, "diagnosis_recent_s": 60,
              "diagnosis_baseline_s": 300, "engine_metrics_enabled": False}
    settings = load_settings(diagnosis_interval_s=30, **common)
    engine = create_engine(sqlite_url)
    registry = CollectorRegistry()
    sessionmaker = create_sessionmaker(engine)
    service = DiagnosisService(sessionmaker, settings, DiagnosisMetrics(registry))
    elsewhere = DiagnosisService(sessionmaker, settings)  # another worker: no schedule
    unscheduled = DiagnosisService(sessionmaker, load_settings(diagnosis_interval_s=0, **common))
    seen: list[tuple[int, str]] = []
    try:
        for second in range(360, HEALTHY_S + INCIDENT_S + 300, 30):
            now = T0 + timedelta(seconds=second)
            held = (await service.evaluate_all(now=now))["m"]
            here, there = await service.current("m", now), await elsewhere.current("m", now)
            assert here["verdict"] == there["verdict"] == held, second
            assert here["source"] == there["source"] == "schedule"
            assert registry.get_sample_value(
                "phasewatch_diagnosis_verdict", {"model": "m", "verdict": held}) == 1
            async with sessionmaker() as session:
                last, _ = await list_diagnoses(session, "m", 1, None)
            assert last[0].verdict == held
            seen.append((second - HEALTHY_S, held))
            if 60 <= second - HEALTHY_S <= INCIDENT_S:
                alone = await unscheduled.current("m", now)
                assert alone["source"] == "on_demand"
                assert alone["verdict"] != "healthy", (second, alone["summary"])
        first = min(t for t, v in seen if v != "healthy")
        assert all(v != "healthy" for t, v in seen if first <= t <= INCIDENT_S), seen
        assert seen[-1][1] == "healthy"
    finally:
        await engine.dispose()


async def test_a_round_judges_both_phases_where_it_can(sqlite_url: str) -> None:
    """The last minute has first tokens but no token gaps yet (long decode steps): a TTFT rise
    alone there. The whole window compares both phases, so the round reads it, not a
    queueing the next round's ITL would contradict."""
    await asyncio.to_thread(upgrade, sqlite_url)
    gapless = rows("m", T0 + timedelta(seconds=540), 60, 60, ttft=2.0, itl=0.03, seed=3)
    for row in gapless:
        row.itl_count, row.itl_p50_s = 1, None
    await asyncio.to_thread(insert, sqlite_url, [
        *rows("m", T0, 480, 480, seed=1),
        *rows("m", T0 + timedelta(seconds=480), 60, 60, ttft=2.0, itl=0.03, seed=2),
        *gapless,
    ])
    settings = load_settings(database_url=sqlite_url, diagnosis_window_s=120,
                             diagnosis_recent_s=60, diagnosis_baseline_s=300,
                             engine_metrics_enabled=False)
    engine = create_engine(sqlite_url)
    service = DiagnosisService(create_sessionmaker(engine), settings)
    now = T0 + timedelta(seconds=600)
    try:
        recent = await service.diagnose("m", now, timedelta(seconds=60), PreviousSpan(300))
        assert recent["verdict"] == "queueing" and recent["evidence"]["itl"] is None
        assert await service.evaluate_all(now=now) == {"m": "out_of_capacity"}
        report = await service.current("m", now)
        assert report["window"]["seconds"] == 120.0
        assert report["evidence"]["checks"]["itl_rising"] is True
    finally:
        await engine.dispose()
