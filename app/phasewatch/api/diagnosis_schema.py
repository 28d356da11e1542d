"""What `GET /api/diagnosis` and `GET /api/diagnosis/history` answer, declared for the OpenAPI
document.

Declarations only: the diagnosis service builds the report as a dict
(app/phasewatch/diagnosis/service.py) and the route encodes it with orjson
(app/phasewatch/api/encoding.py). The evidence is app/phasewatch/api/evidence_schema.py; the method,
docs/diagnosis.md.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field

from phasewatch.api.evidence_schema import Evidence
from phasewatch.diagnosis.verdicts import Verdict


class DiagnosisWindow(BaseModel):
    """The span judged: requests that arrived in [`since`, `until`)."""

    since: datetime = Field(description="Its start, UTC.")
    until: datetime = Field(description="Its end, UTC.")
    seconds: float = Field(description="Its length, seconds.")


class DiagnosisBaseline(BaseModel):
    """What the window was compared with."""

    kind: Literal["previous", "range", "run"] = Field(
        description="`previous`: the span right before the window; `range`: an explicit "
        "range; `run`: the requests a stored run sent (`baseline=run:<id>`).")
    since: datetime | None = Field(description="Its start, UTC (a run's: its first request's "
                                   "arrival; null when it sent this model none).")
    until: datetime | None = Field(description="Its end, UTC (a run's: its last request's "
                                   "arrival).")
    seconds: float = Field(description="Its length, seconds (a run's: first to last arrival, "
                           "widened by one mean gap).")
    run_id: str | None = Field(None, description="The run; present when `kind` is `run`.")
    schedule_kind: Literal["previous", "healthy_reference", "frozen_at_onset"] | None = Field(
        None, description="In the schedule's rounds: the span before the window "
        "(`previous`), the last span judged healthy, frozen during an incident "
        "(`healthy_reference`), or, with none known, the baseline when the incident began "
        "(`frozen_at_onset`).")
    known_healthy: bool | None = Field(None, description="In the schedule's rounds: whether "
                                       "the baseline was judged healthy.")


class LiveState(BaseModel):
    """The requests in flight the window counted, from every process's live snapshot."""

    snapshots: int = Field(description="Fresh snapshots read, one per process (count); 0 when "
                           "`until` was given (a past moment has no live state).")
    requests: int = Field(description="This model's requests in flight in them (count).")
    max_age_s: float = Field(description="A snapshot counts when taken at most this long "
                             "before `until`, seconds (`PHASEWATCH_DIAGNOSIS_LIVE_MAX_AGE_S`).")
    oldest_snapshot: datetime | None = Field(description="When the oldest snapshot read was "
                                             "taken, UTC; null when none was.")


class DiagnosisAction(BaseModel):
    """One thing to change, from the article's "Dial it in"."""

    knob: str = Field(description="The knob: a vLLM flag, replicas, prompts, ...")
    change: str = Field(description="Which way to move it.")
    why: str = Field(description="Why that helps.")


class EngineMetricsState(BaseModel):
    """Whether the engine's `/metrics` was scraped for the window."""

    url: str = Field(description="The engine's metrics URL.")
    up: bool | None = Field(description="Whether the last scrape at or before the window's end "
                            "worked; null when none is stored.")
    in_window: bool = Field(description="Whether any scrape fell in the window.")


class DiagnosisReport(BaseModel):
    """One model's verdict over the window against its baseline, with its evidence."""

    model: str = Field(description="The model judged.")
    window: DiagnosisWindow = Field(description="The span judged.")
    baseline: DiagnosisBaseline = Field(description="What it was compared with.")
    live: LiveState = Field(description="The requests in flight counted.")
    verdict: Verdict = Field(description="Which phase is broken (docs/diagnosis.md, "
                             "\"Verdicts and what to do\").")
    confidence: float = Field(description="How sure, 0-1 (0 for `insufficient_data`).")
    summary: str = Field(description="One paragraph with the numbers.")
    meaning: str = Field(description="What the verdict means.")
    actions: list[DiagnosisAction] = Field(description="What to change, most useful first.")
    evidence: Evidence = Field(description="Every comparison behind the verdict.")
    engine_metrics: EngineMetricsState | None = Field(description="The engine scrape's state; "
                                                      "null when the engine is not scraped.")
    source: Literal["schedule", "on_demand", "ad_hoc"] = Field(
        description="`schedule`: the schedule's latest round, the verdict the gauge, the "
        "history and the alerts carry (the default question); `on_demand`: the default "
        "question with no fresh round stored (the schedule is off or not yet run), judged now "
        "as the schedule would; `ad_hoc`: a question with `window`, `baseline`, `until` or "
        "`min_samples`.")
    judged_at: str = Field(description="When it was judged (ISO 8601, UTC).")
    round_verdict: Verdict | None = Field(None, description="The round's own verdict, where "
                                          "the schedule holds another one until it has been "
                                          "seen for its rounds; absent for `ad_hoc`.")


class DiagnosisReports(BaseModel):
    """Without `model`: one report per model with requests in the window or its baseline."""

    items: list[DiagnosisReport] = Field(description="One per model, busiest first.")


class VerdictChange(BaseModel):
    """A change of verdict the schedule stored, with the report of that round. Fields read from
    the stored report are null when it lacks them."""

    id: int = Field(description="The change's key; pages are cut by it (`cursor`).")
    at: datetime = Field(description="When the schedule judged it, UTC.")
    model: str = Field(description="The model judged.")
    window_s: float = Field(description="The window judged, seconds.")
    baseline: str = Field(description="The baseline, named: `previous <seconds>s`, or "
                          "`<schedule_kind> <since>/<until>`.")
    verdict: Verdict = Field(description="The verdict the schedule now holds.")
    confidence: float = Field(description="Its confidence, 0-1.")
    summary: str | None = Field(description="One paragraph with the numbers.")
    meaning: str | None = Field(description="What the verdict means.")
    actions: list[DiagnosisAction] | None = Field(description="What to change.")
    window: DiagnosisWindow | None = Field(description="The span judged.")
    evidence: Evidence | None = Field(description="The round's evidence, with `schedule`.")


class VerdictChangePage(BaseModel):
    """Stored changes of verdict, newest first."""

    items: list[VerdictChange] = Field(description="At most `limit` changes, newest first.")
    next_cursor: int | None = Field(description="Pass as `cursor` for the next page; null on "
                                    "the last one.")
