"""`GET /api/diagnosis` and `GET /api/diagnosis/history`: thin routers over the diagnosis
service and its stored verdict changes. Method: docs/diagnosis.md; the answers' shapes:
app/phasewatch/api/diagnosis_schema.py.

Without `window`, `baseline`, `until` and `min_samples` the question is the schedule's: the
verdict it holds now (`DiagnosisService.current`), the one the gauge, the history and the
alerts carry. Any of them makes it an ad-hoc question (`source: ad_hoc`); without `baseline`
it still compares with what the schedule would (its frozen reference during an incident).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import JSONResponse
from sqlalchemy.ext.asyncio import AsyncSession

from phasewatch.api.budget import BudgetedRoute
from phasewatch.api.deps import ADMIN_AUTH, db_session, parse_duration, row_dict, utc
from phasewatch.api.diagnosis_schema import DiagnosisReport, DiagnosisReports, VerdictChangePage
from phasewatch.api.encoding import json_response
from phasewatch.api.errors import ERROR_RESPONSES, error_response
from phasewatch.diagnosis.service import (
    Baseline,
    DiagnosisService,
    PreviousSpan,
    RunBaseline,
    TimeRange,
    UnknownRun,
)
from phasewatch.store.diagnoses import list_diagnoses

router = APIRouter(route_class=BudgetedRoute, dependencies=ADMIN_AUTH,
                   responses=ERROR_RESPONSES)

BASELINE_FORMS = ("a duration right before the window (1h), an ISO 8601 range "
                  "(2026-01-01T10:00:00Z/2026-01-01T11:00:00Z), or run:<run id>")


def _moment(text: str) -> datetime:
    moment = utc(datetime.fromisoformat(text.strip().replace("Z", "+00:00")))
    assert moment is not None
    return moment


def parse_baseline(text: str | None, default_s: float) -> Baseline:
    """The `baseline` parameter; ValueError naming the accepted forms otherwise."""
    if text is None or text.strip() in ("", "previous"):
        return PreviousSpan(default_s)
    text = text.strip()
    if text.startswith("run:"):
        if not text[4:]:
            raise ValueError("run: needs a run id")
        return RunBaseline(text[4:])
    if "/" in text:
        start, end = text.split("/", 1)
        try:
            since, until = _moment(start), _moment(end)
        except ValueError:
            raise ValueError(BASELINE_FORMS) from None
        if since >= until:
            raise ValueError("the range must start before it ends")
        return TimeRange(since, until)
    try:
        return PreviousSpan(parse_duration(text).total_seconds())
    except ValueError:
        raise ValueError(BASELINE_FORMS) from None


def _invalid(param: str, problem: str, value: str | None) -> JSONResponse:
    return error_response(422, f"invalid parameters: {param}: {problem} (got {value!r})",
                          "invalid_request_error", param)


@router.get("/api/diagnosis", response_model=DiagnosisReport | DiagnosisReports,
            operation_id="getDiagnosis")
async def diagnosis(
    request: Request,
    model: Annotated[str | None, Query(description="The model to judge; without it, every "
                                       "model with requests in the window or its "
                                       "baseline.")] = None,
    window: Annotated[str | None, Query(description="The window's length: `30s`, `5m`, `1h`; "
                                        "default the schedule's "
                                        "(`PHASEWATCH_DIAGNOSIS_WINDOW_S`).")] = None,
    baseline: Annotated[str | None, Query(description="What to compare with: "
                                          + BASELINE_FORMS + "; default what the schedule "
                                          "compares with: the "
                                          "`PHASEWATCH_DIAGNOSIS_BASELINE_S` before the "
                                          "window, or during an incident the last span "
                                          "judged healthy.")] = None,
    until: Annotated[datetime | None, Query(description="The window's end (ISO 8601; no zone "
                                            "means UTC); default now, when requests in "
                                            "flight count too.")] = None,
    min_samples: Annotated[int | None, Query(
        ge=5, le=1_000_000, description="Timed requests each side needs; default "
        "`PHASEWATCH_DIAGNOSIS_MIN_SAMPLES`.")] = None,
) -> Response:
    """One model's verdict (`model` given), or `{"items": [...]}` for every model with
    requests in the window or its baseline. Without `window`, `baseline`, `until` and
    `min_samples`: the verdict the schedule holds now."""
    service: DiagnosisService = request.app.state.diagnosis
    settings = service.settings
    try:
        span = (timedelta(seconds=settings.diagnosis_window_s) if window is None
                else parse_duration(window))
    except ValueError as exc:
        return _invalid("window", str(exc), window)
    try:
        spec = None if baseline is None else parse_baseline(baseline,
                                                            settings.diagnosis_baseline_s)
    except ValueError as exc:
        return _invalid("baseline", str(exc), baseline)
    end = utc(until) or datetime.now(UTC)
    live = until is None  # requests in flight are known for the present only
    scheduled = window is None and baseline is None and until is None and min_samples is None

    async def one(name: str) -> dict[str, Any]:
        if scheduled:
            return await service.current(name, end)
        # A past moment has no schedule state to read: the span before the window.
        reference = spec if spec is not None else (
            await service.reference(name, end, span) if until is None
            else PreviousSpan(settings.diagnosis_baseline_s))
        report = await service.diagnose(name, end, span, reference, min_samples, live)
        return {**report, "source": "ad_hoc", "judged_at": _iso(end)}

    try:
        if model is not None:
            answer: dict[str, Any] = await one(model)
        else:
            models = await service.models(
                end, span, spec or PreviousSpan(settings.diagnosis_baseline_s))
            answer = {"items": [await one(m) for m in models]}
    except UnknownRun as exc:
        return _invalid("baseline", str(exc), baseline)
    return json_response(answer)


def _iso(moment: datetime) -> str:
    return moment.astimezone(UTC).isoformat()


@router.get("/api/diagnosis/history", response_model=VerdictChangePage,
            operation_id="listVerdictChanges")
async def history(
    session: Annotated[AsyncSession, Depends(db_session)],
    model: Annotated[str | None, Query(description="Only this model.")] = None,
    limit: Annotated[int, Query(ge=1, le=1000, description="Changes per page.")] = 100,
    cursor: Annotated[int | None, Query(
        ge=1, description="The previous page's `next_cursor`.")] = None,
) -> Response:
    """Stored changes of verdict (from the schedule), newest first, each with its evidence."""
    rows, next_cursor = await list_diagnoses(session, model, limit, cursor)
    items = []
    for row in rows:
        item = row_dict(row)
        report = item.pop("evidence") or {}
        item.update({key: report.get(key) for key in
                     ("summary", "meaning", "actions", "window", "evidence")})
        items.append(item)
    return json_response({"items": items, "next_cursor": next_cursor})
