"""The shell around the pure diagnosis: it reads, runs the core off the event loop, keeps the
schedule, the history and the gauges. The only module of the package that does I/O.

`DiagnosisService.diagnose` answers one model for one window and baseline (the API calls it, in any
process); it reads only the database (the requests, the engine scrapes the leader stored, and every
process's fresh live snapshot of its requests in flight), so every worker and replica answers the
same question the same. `run` is the schedule, run by the leading process only
(app/phasewatch/store/leader.py): every `diagnosis_interval_s` it judges the active models
(`_to_judge`: at most `max_model_labels`, only names the upstream served; a model gone quiet loses
its gauges) (`_round`: the recent window when it holds enough requests; the frozen healthy reference
as baseline while an incident is held or pending; hysteresis, app/phasewatch/diagnosis/hold.py),
sets `phasewatch_diagnosis_verdict` / `_confidence` to the verdict it holds, stores each change of
it with its evidence, and replaces each model's latest round (`diagnosis_latest`: the report and the
state between rounds); when it stops (the process no longer leads) it withdraws its gauges.
`current` is the default question's answer in every process: that latest round while it is fresh, so
the endpoint, the gauge, the history and the alert say one verdict; else a round judged on demand as
the schedule would judge it, from its last stored state. Any fault (database, engine, evaluation) is
logged and counted and the schedule goes on; nothing here touches the relay.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from phasewatch.core.live import InFlight
from phasewatch.core.settings import Settings
from phasewatch.diagnosis.diagnose import Finding, Rules, diagnose
from phasewatch.diagnosis.hold import (
    BaselineKind,
    Held,
    HoldRules,
    Round,
    Span,
    baseline_for,
    held_as_json,
    held_from_json,
    step,
)
from phasewatch.diagnosis.metrics import DiagnosisMetrics
from phasewatch.diagnosis.observations import Observation, Sample, traffic_span_s
from phasewatch.diagnosis.verdicts import ACTIONS, MEANING, Verdict
from phasewatch.engine.codec import snapshot_from_json
from phasewatch.engine.window import EngineWindow, summarize
from phasewatch.store.diagnoses import (
    RequestSpan,
    active_models,
    add_diagnosis,
    drop_latest,
    latest_verdicts,
    put_latest,
    read_latest,
    read_observations,
    run_request_count,
    still_served,
)
from phasewatch.store.engine_scrapes import read_scrapes
from phasewatch.store.live_snapshots import StoredSnapshot, read_fresh

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PreviousSpan:
    """The `seconds` right before the window."""

    seconds: float


@dataclass(frozen=True, slots=True)
class TimeRange:
    since: datetime
    until: datetime


@dataclass(frozen=True, slots=True)
class RunBaseline:
    """The requests a stored run sent through phasewatch (`x-phasewatch-run-id`)."""

    run_id: str


Baseline = PreviousSpan | TimeRange | RunBaseline


class UnknownRun(LookupError):
    """No stored request carries this run id."""


def to_observation(row: tuple[Any, ...]) -> Observation:
    """An `phasewatch.store.diagnoses.OBSERVATION_COLUMNS` row as the core's input."""
    (started_s, outcome, ttft_s, e2e_s, itl_count, itl_p50_s, itl_max_s, prompt_tokens,
     in_flight) = row
    # Positional, in the fields' order: a round builds up to twice `diagnosis_max_samples`.
    return Observation(started_s, outcome == "ok", ttft_s, e2e_s, itl_count or 0, itl_p50_s,
                       itl_max_s, prompt_tokens, in_flight or 0)


def _sample(span: RequestSpan, seconds: float, until: datetime,
            in_flight: list[InFlight] | None = None) -> Sample:
    """A span's requests; its rate over the part of it that had traffic (traffic_span_s)."""
    first = None if span.first is None else span.first.timestamp()
    return Sample([to_observation(row) for row in span.rows],
                  traffic_span_s(seconds, first, until.timestamp(), span.total), span.total,
                  in_flight or [])


def _run_sample(span: RequestSpan, seconds: float) -> Sample:
    """A benchmark run's requests, over the run's own span."""
    return Sample([to_observation(row) for row in span.rows], seconds, span.total)


def _judge(current: Callable[[], Sample], reference: Callable[[], Sample],
           engine: EngineWindow | None, rules: Rules) -> Finding:
    """Build both samples and diagnose: run in a worker thread."""
    return diagnose(current(), reference(), engine, rules)


def _run_seconds(span: RequestSpan) -> float:
    """A run's span for its request rate: first to last arrival, widened by one mean gap
    (n arrivals mark n - 1 gaps)."""
    if span.first is None or span.last is None or span.total < 2:
        return 0.0
    covered = (span.last - span.first).total_seconds()
    return covered * span.total / (span.total - 1)


def _word(value: Any) -> str:
    """A check's value as the docs write it."""
    return "unknown" if value is None else str(value).lower()


def _iso(moment: datetime | None) -> str | None:
    return None if moment is None else moment.astimezone(UTC).isoformat()


async def read_engine(
    session: AsyncSession, url: str, since: datetime, until: datetime, model: str
) -> tuple[EngineWindow | None, bool | None]:
    """The engine's figures for `model` over [since, until] from the stored scrapes, and
    whether the last scrape at or before `until` worked (None: none stored)."""
    span = await read_scrapes(session, url, since, until)
    stored = ([span.before] if span.before is not None else []) + span.inside
    history = [(at.timestamp(), snapshot_from_json(data)) for at, data in stored]
    return summarize(history, since.timestamp(), until.timestamp(), model), span.last_ok


def _baseline_label(described: dict[str, Any]) -> str:
    """How a stored verdict change names its baseline."""
    if described.get("schedule_kind", "previous") == "previous":
        return f"previous {described['seconds']:g}s"
    return f"{described['schedule_kind']} {described['since']}/{described['until']}"


class DiagnosisService:
    def __init__(
        self, sessionmaker: async_sessionmaker[AsyncSession], settings: Settings,
        metrics: DiagnosisMetrics | None = None,
        fresh_engine: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.sessionmaker = sessionmaker
        # Called before each scheduled round: returns once the engine's state at that moment
        # is stored, so a round never reads the engine's queue from before a change of load
        # that the requests in flight already show (app/phasewatch/engine/scraper.py, `fresh`).
        self.fresh_engine = fresh_engine
        self.settings = settings
        self.engine_url = settings.engine_metrics_target  # None: the engine is not scraped
        self.metrics = metrics
        self.rules = Rules(min_samples=settings.diagnosis_min_samples,
                           slo_ttft_s=settings.slo_ttft_s, slo_itl_s=settings.slo_itl_s)
        self._stored: dict[str, str] | None = None  # last stored verdict per model
        self._exported: list[str] = []  # models whose verdict the gauges hold
        self._held: dict[str, Held] = {}  # the schedule's state per model (hold.py)
        self._resume: dict[str, Held] = {}  # the stored state a new leader starts from
        # Per model, the checks of the last round that agreed with the held verdict: what a
        # change of verdict is compared with (`what_changed`).
        self._agreed: dict[str, dict[str, Any]] = {}
        self.hold_rules = HoldRules(settings.diagnosis_hold_rounds,
                                    settings.diagnosis_switch_confidence,
                                    settings.diagnosis_baseline_s)

    async def models(self, until: datetime, window: timedelta, baseline: Baseline) -> list[str]:
        """Models with requests in the window or a previous-span baseline, busiest first."""
        since = until - window
        if isinstance(baseline, PreviousSpan):
            since -= timedelta(seconds=baseline.seconds)
        async with self.sessionmaker() as session:
            return await active_models(session, since, until, self.settings.max_model_labels)

    async def diagnose(
        self, model: str, until: datetime, window: timedelta, baseline: Baseline,
        min_samples: int | None = None, live: bool = True,
        fresh: list[StoredSnapshot] | None = None,
    ) -> dict[str, Any]:
        """One model's diagnosis as a JSON-ready report. Raises UnknownRun for a run baseline
        no stored request carries. `live`: also read the requests in flight (a question about
        the present; each process keeps only its latest snapshot, so a question about a moment
        already past is answered from finished records alone, the same by every process).
        `fresh`: those snapshots, already read for `until` (`_read_fresh`), by a caller that
        asks several questions about one moment."""
        since = until - window
        limit = self.settings.diagnosis_max_samples
        async with self.sessionmaker() as session:
            current = await read_observations(session, model=model, since=since, until=until,
                                              limit=limit)
            if isinstance(baseline, PreviousSpan):
                b_since = since - timedelta(seconds=baseline.seconds)
                span = await read_observations(session, model=model, since=b_since,
                                               until=since, limit=limit)
                reference = partial(_sample, span, baseline.seconds, since)
                described: dict[str, Any] = {
                    "kind": "previous", "since": _iso(b_since), "until": _iso(since),
                    "seconds": baseline.seconds}
            elif isinstance(baseline, TimeRange):
                span = await read_observations(session, model=model, since=baseline.since,
                                               until=baseline.until, limit=limit)
                seconds = (baseline.until - baseline.since).total_seconds()
                reference = partial(_sample, span, seconds, baseline.until)
                described = {"kind": "range", "since": _iso(baseline.since),
                             "until": _iso(baseline.until), "seconds": seconds}
            else:
                if await run_request_count(session, baseline.run_id) == 0:
                    raise UnknownRun(f"no stored request carries run id {baseline.run_id!r}")
                span = await read_observations(session, model=model, run_id=baseline.run_id,
                                               limit=limit)
                run_s = _run_seconds(span)
                reference = partial(_run_sample, span, run_s)
                described = {"kind": "run", "run_id": baseline.run_id,
                             "since": _iso(span.first), "until": _iso(span.last),
                             "seconds": run_s}
            engine, engine_up = (None, None) if self.engine_url is None else (
                await read_engine(session, self.engine_url, since, until, model))
            if not live:
                fresh = []
            elif fresh is None:
                fresh = await self._read_fresh(session, until)
        rules = self.rules if min_samples is None else replace(self.rules,
                                                                min_samples=min_samples)
        in_flight = [r for snapshot in fresh for r in snapshot.requests if r.model == model]
        # The samples are built off the event loop too: thousands of rows at once would hold
        # every stream's chunks back for tens of milliseconds.
        finding: Finding = await asyncio.to_thread(
            _judge, partial(_sample, current, window.total_seconds(), until, in_flight),
            reference, engine, rules)
        return {
            "model": model,
            "window": {"since": _iso(since), "until": _iso(until),
                       "seconds": window.total_seconds()},
            "baseline": described,
            "live": {"snapshots": len(fresh), "requests": len(in_flight),
                     "max_age_s": self.settings.diagnosis_live_max_age_s,
                     "oldest_snapshot": _iso(min((f.taken_at for f in fresh), default=None))},
            **finding.as_dict(),
            "engine_metrics": None if self.engine_url is None else {
                "url": self.engine_url, "up": engine_up, "in_window": engine is not None},
        }

    async def _read_fresh(self, session: AsyncSession, until: datetime) -> list[StoredSnapshot]:
        """Every process's live snapshot fresh at `until`. For the present, a snapshot
        published while a round ran (after `until`) is the freshest there is: it replaced the
        one before it."""
        return await read_fresh(
            session, until - timedelta(seconds=self.settings.diagnosis_live_max_age_s),
            max(until, datetime.now(UTC)))

    async def run(self) -> None:
        """The schedule: evaluate, then wait `diagnosis_interval_s`, until cancelled. Each run
        starts afresh (another process may have led, and stored changes, in between) and
        withdraws the gauges when it ends, so only the process that runs it exports them."""
        self._stored, self._exported, self._held, self._resume = None, [], {}, {}
        self._agreed = {}
        try:
            while True:
                try:
                    if self.fresh_engine is not None:
                        await self.fresh_engine()
                    await self.evaluate_all()
                except Exception as exc:
                    log.warning("diagnosis round failed (%s: %s)", type(exc).__name__,
                                str(exc)[:200])
                    if self.metrics is not None:
                        self.metrics.failures.inc()
                await asyncio.sleep(self.settings.diagnosis_interval_s)
        finally:
            if self.metrics is not None:
                self.metrics.withdraw()

    async def evaluate_all(self, now: datetime | None = None) -> dict[str, str]:
        """One round over the models to judge (`_to_judge`) with the default window and
        baseline; the gauges of models no longer judged are removed. Returns model -> verdict
        for the models judged."""
        now = now or datetime.now(UTC)
        models = await self._to_judge(now)
        gone = [model for model in self._exported if model not in models]
        for model in gone:
            self._held.pop(model, None)
            self._agreed.pop(model, None)
            if self.metrics is not None:
                self.metrics.remove(model)
        if gone:
            async with self.sessionmaker() as session:
                await drop_latest(session, gone)
        self._exported = models
        if self._stored is None:
            async with self.sessionmaker() as session:
                self._stored = await latest_verdicts(session)
                self._resume = {model: held_from_json(latest.held)
                                for model, latest in (await read_latest(session)).items()}
        judged: dict[str, str] = {}
        for model in models:
            if model not in self._held:
                # A new leader resumes the stored state, or at least holds the stored verdict.
                stored = self._stored.get(model)
                resumed = self._resume.pop(model, None)
                self._held[model] = resumed or Held(None if stored is None else Verdict(stored))
            try:
                report = await self._round(model, now)
            except Exception as exc:
                log.warning("diagnosis of %r failed (%s: %s)", model, type(exc).__name__,
                            str(exc)[:200])
                if self.metrics is not None:
                    self.metrics.failures.inc()
                continue
            verdict, confidence = report["verdict"], report["confidence"]
            judged[model] = verdict
            if self.metrics is not None:
                self.metrics.evaluations.inc()
                self.metrics.set(model, Verdict(verdict), confidence)
            if self._stored.get(model) != verdict:
                await self._store_change(model, now, report)
            await self._store_latest(model, now, report)
        return judged

    @property
    def fresh_s(self) -> float:
        """How old the latest stored round may be and still be the schedule's current view:
        three rounds (a slow round, a missed one) and a little."""
        return 3 * self.settings.diagnosis_interval_s + 5.0

    async def current(self, model: str, now: datetime) -> dict[str, Any]:
        """The schedule's verdict on `model` now (the default `GET /api/diagnosis`): its
        latest round while fresh, else one judged now as the schedule would, from its last
        stored state (`source` says which; neither is stored)."""
        async with self.sessionmaker() as session:
            latest = (await read_latest(session, [model])).get(model)
        if (latest is not None and self.settings.diagnosis_interval_s > 0
                and (now - latest.at).total_seconds() <= self.fresh_s):
            return {**latest.report, "source": "schedule", "judged_at": _iso(latest.at)}
        held = Held() if latest is None else held_from_json(latest.held)
        report, _ = await self._judge_round(held, model, now)
        return {**report, "source": "on_demand", "judged_at": _iso(now)}

    async def reference(self, model: str, now: datetime, window: timedelta) -> Baseline:
        """What the schedule would compare a window ending `now` with: the span before it,
        or, while it holds an incident, its frozen reference."""
        async with self.sessionmaker() as session:
            latest = (await read_latest(session, [model])).get(model)
        start = (now - window).timestamp()
        previous = Span(start - self.settings.diagnosis_baseline_s, start)
        span, kind = baseline_for(Held() if latest is None else held_from_json(latest.held),
                                  previous)
        if kind is BaselineKind.PREVIOUS:
            return PreviousSpan(self.settings.diagnosis_baseline_s)
        return TimeRange(datetime.fromtimestamp(span.since_s, UTC),
                         datetime.fromtimestamp(span.until_s, UTC))

    async def _store_latest(self, model: str, now: datetime, report: dict[str, Any]) -> None:
        try:
            async with self.sessionmaker() as session:
                await put_latest(session, model=model, at=now, verdict=report["verdict"],
                                 confidence=report["confidence"], report=report,
                                 held=held_as_json(self._held[model]))
        except Exception as exc:  # the next round replaces it
            log.warning("storing the latest diagnosis of %r failed (%s: %s)", model,
                        type(exc).__name__, str(exc)[:200])
            if self.metrics is not None:
                self.metrics.failures.inc()

    async def _to_judge(self, now: datetime) -> list[str]:
        """At most `max_model_labels` models the upstream served within the window and the
        baseline before it: those already exported first (so labels do not churn when more
        models are active than the limit), then the others the upstream served, busiest
        first. A model with no served request in that span has gone quiet and drops out.

        Counting the served models of the whole span is a scan of every request in it (at a
        steady 200 requests/s, 780,000 rows and a third of a second of CPU on SQLite), so
        that is done only while nothing is exported (a new leader's first round). Otherwise
        each exported model is looked up on its own (`still_served`), and the others are
        counted over the window alone: a model served only in the baseline and not exported
        then (one that was over the label limit) waits until it is served again."""
        limit = self.settings.max_model_labels
        window = timedelta(seconds=self.settings.diagnosis_window_s)
        since = now - window - timedelta(seconds=self.settings.diagnosis_baseline_s)
        async with self.sessionmaker() as session:
            if not self._exported:
                return await active_models(session, since, now, limit)
            kept = await still_served(session, self._exported, since, now)
            # Enough to fill the places left whichever of them are among the kept.
            recent = await active_models(session, now - window, now, limit + len(kept))
        held = set(kept)
        return (kept + [m for m in recent if m not in held])[:limit]

    async def _round(self, model: str, now: datetime) -> dict[str, Any]:
        """One model's round of the schedule, its state kept for the next. A change from one
        verdict to another says what changed since the last round that agreed with the old
        one (`schedule.what_changed`, and the summary's first sentence)."""
        before = self._held[model]
        report, new = await self._judge_round(before, model, now)
        self._held[model] = new
        checks = report["evidence"].get("checks", {})
        agreed = self._agreed.get(model)
        if new.verdict is not before.verdict and before.verdict is not None:
            what = [] if agreed is None else [
                f"{key}: {_word(agreed[key])} -> {_word(value)}"
                for key, value in checks.items() if key in agreed and agreed[key] != value]
            report["evidence"]["schedule"]["what_changed"] = what
            if what:
                report["summary"] = (f"Changed from {before.verdict.value}: "
                                     f"{'; '.join(what)}. {report['summary']}")
        if new.verdict is not None and report["round_verdict"] == new.verdict.value:
            self._agreed[model] = checks
        return report

    async def _judge_round(self, held: Held, model: str,
                           now: datetime) -> tuple[dict[str, Any], Held]:
        """One model's round from state `held`: the recent window if it holds enough requests, else
        the whole window; against the span before it, or, while an incident is held or pending, the
        frozen reference (app/phasewatch/diagnosis/hold.py). Returns the report with the held
        verdict and the schedule's evidence (`schedule`), and the new state."""
        full_s = self.settings.diagnosis_window_s
        tries: list[tuple[timedelta, Baseline, BaselineKind]] = []
        for seconds in sorted({min(self.settings.diagnosis_recent_s, full_s), full_s}):
            window = timedelta(seconds=seconds)
            previous = Span((now - window).timestamp() - self.settings.diagnosis_baseline_s,
                            (now - window).timestamp())
            span, kind = baseline_for(held, previous)
            if kind is not BaselineKind.PREVIOUS:
                tries.append((window, TimeRange(datetime.fromtimestamp(span.since_s, UTC),
                                                datetime.fromtimestamp(span.until_s, UTC)),
                              kind))
            # The span before the window: the default, and the fallback of a frozen baseline
            # that turns out too thin to judge with.
            tries.append((window, PreviousSpan(self.settings.diagnosis_baseline_s),
                          BaselineKind.PREVIOUS))
        report: dict[str, Any] = {}
        kind = BaselineKind.PREVIOUS
        # The tries ask about one moment: the snapshots of the requests in flight are read
        # once (a thousand requests each, parsed, at every try otherwise).
        async with self.sessionmaker() as session:
            fresh = await self._read_fresh(session, now)
        # The first try that judges both phases; else the first that judges at all. A recent
        # window with enough first tokens but too few token gaps (long decode steps, streams
        # still running) would read a TTFT rise alone, and flip with the rounds that can
        # compare ITL.
        # (A window that judged moves on to the next window, never to its own fallback
        # baseline: that is for a frozen baseline too thin to judge with.)
        usable: tuple[dict[str, Any], BaselineKind] | None = None
        judged: timedelta | None = None
        for window, baseline, tried in tries:
            if window == judged:
                continue
            report, kind = await self.diagnose(model, now, window, baseline, fresh=fresh), tried
            if report["verdict"] == Verdict.INSUFFICIENT_DATA.value:
                continue
            usable, judged = usable or (report, kind), window
            evidence = report["evidence"]
            if evidence.get("itl") is not None or evidence.get("itl_in_flight") is not None:
                usable = (report, kind)
                break
        if usable is not None:
            report, kind = usable
        report["baseline"]["schedule_kind"] = kind.value
        report["baseline"]["known_healthy"] = kind is BaselineKind.HEALTHY_REFERENCE
        w, b = report["window"], report["baseline"]
        checks = report["evidence"].get("checks", {})
        new, moved = step(held, Round(
            Verdict(report["verdict"]), report["confidence"], now.timestamp(),
            Span(datetime.fromisoformat(w["since"]).timestamp(), now.timestamp()),
            Span(datetime.fromisoformat(b["since"]).timestamp(),
                 datetime.fromisoformat(b["until"]).timestamp()),
            checks.get("window_meets_slo"), kind), self.hold_rules)
        if kind is BaselineKind.FROZEN_AT_ONSET:
            report["summary"] += (" No known-healthy baseline: compared with the span before "
                                  "the incident began, which was never judged healthy.")
        assert new.verdict is not None
        report["evidence"]["schedule"] = moved
        report["round_verdict"] = report["verdict"]
        if new.verdict.value != report["verdict"]:
            # The report speaks for the verdict held; the round's own reading follows it.
            report["summary"] = (f"Held: {new.verdict.value} ({moved['because']}); this "
                                 f"round: {report['summary']}")
            report["meaning"] = MEANING[new.verdict]
            report["actions"] = [a.as_dict() for a in ACTIONS[new.verdict]]
        report["verdict"], report["confidence"] = new.verdict.value, new.confidence
        return report, new

    async def _store_change(self, model: str, now: datetime, report: dict[str, Any]) -> None:
        assert self._stored is not None
        previous = self._stored.get(model)
        try:
            async with self.sessionmaker() as session:
                await add_diagnosis(
                    session, at=now, model=model, window_s=report["window"]["seconds"],
                    baseline=_baseline_label(report["baseline"]),
                    verdict=report["verdict"], confidence=report["confidence"],
                    evidence=report,
                )
        except Exception as exc:  # retried on the next round: _stored is left as it was
            log.warning("storing the diagnosis of %r failed (%s: %s)", model,
                        type(exc).__name__, str(exc)[:200])
            if self.metrics is not None:
                self.metrics.failures.inc()
            return
        self._stored[model] = report["verdict"]
        log.info("diagnosis of %r: %s -> %s (confidence %.2f): %s", model, previous or "none",
                 report["verdict"], report["confidence"], report["summary"])
