"""The SLO file's contents, validated: what each objective is and for which models.

`parse_spec(data)` takes the file's parsed mapping (no YAML here, no file access) and returns
an `SloSpec`, or raises `SloError` with one sentence per problem. A threshold must be an edge
of the proxy's histogram buckets (`app/phasewatch/core/metrics.py`): a latency SLI is
`bucket{le="T"} / count`, and without an edge at exactly T there is no such bucket to read.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from phasewatch.core.metrics import ITL_BUCKETS, TTFT_BUCKETS

SloName = Literal["ttft", "itl"]
SLO_NAMES: tuple[SloName, ...] = ("ttft", "itl")

# What each SLO measures: the proxy's histogram and the bucket edges it always has.
HISTOGRAMS: dict[SloName, str] = {
    "ttft": "phasewatch_time_to_first_token_seconds",
    "itl": "phasewatch_inter_token_latency_seconds",
}
BUCKETS: dict[SloName, tuple[float, ...]] = {"ttft": TTFT_BUCKETS, "itl": ITL_BUCKETS}
BUCKET_CONSTANTS: dict[SloName, str] = {"ttft": "TTFT_BUCKETS", "itl": "ITL_BUCKETS"}

# The fastest burn alert fires at 14.4x the budget: an objective below 1 - 1/14.4 (93.06%)
# has a budget so large that 14.4x of it exceeds 100% errors, and the page could never fire.
FASTEST_BURN = 14.4
_DURATION = re.compile(r"^[0-9]+(ms|s|m|h|d|w|y)$")


class SloError(ValueError):
    """The SLO file is invalid; the message says where and why, for a human."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Objective(_Strict):
    """One SLO: `objective` of events at or under `threshold_s`."""

    threshold_s: float = Field(gt=0)
    objective: float = Field(gt=0, lt=1)
    # Events (requests for TTFT, tokens for ITL) the long window of a burn alert must hold
    # before it may fire: with a handful of requests one slow one is a large error ratio.
    min_events: int = Field(default=0, ge=0)

    @property
    def budget(self) -> float:
        """The error budget: the fraction of events allowed over the threshold."""
        return round(1.0 - self.objective, 12)

    @field_validator("objective")
    @classmethod
    def _page_can_fire(cls, value: float) -> float:
        if (1.0 - value) * FASTEST_BURN >= 1.0:
            raise ValueError(
                f"{value:g} leaves a budget so large that the {FASTEST_BURN:g}x page could "
                f"never fire (it needs an objective above {1 - 1 / FASTEST_BURN:.4f})"
            )
        return value


class _ObjectiveOverride(_Strict):
    threshold_s: float | None = Field(default=None, gt=0)
    objective: float | None = Field(default=None, gt=0, lt=1)
    min_events: int | None = Field(default=None, ge=0)


class _ModelOverride(_Strict):
    model: str = Field(min_length=1)
    ttft: _ObjectiveOverride | None = None
    itl: _ObjectiveOverride | None = None


class _Objectives(_Strict):
    ttft: Objective
    itl: Objective


class _Diagnosis(_Strict):
    # How long a verdict other than healthy must hold before its alert fires.
    for_: str = Field(default="10m", alias="for")
    # Verdicts below this confidence do not alert.
    min_confidence: float = Field(default=0.5, ge=0, le=1)

    @field_validator("for_")
    @classmethod
    def _duration(cls, value: str) -> str:
        if not _DURATION.match(value):
            raise ValueError("must be a Prometheus duration such as 10m")
        return value


class _SloFile(_Strict):
    job: str = Field(default="phasewatch", min_length=1)
    diagnosis_url: str = "http://phasewatch:8080/api/diagnosis"
    objectives: _Objectives
    models: list[_ModelOverride] = Field(default_factory=list)
    diagnosis: _Diagnosis = Field(default_factory=_Diagnosis)


@dataclass(frozen=True, slots=True)
class Target:
    """The objectives that hold for a set of models.

    The default target has `models == ()` and covers every model not named by an override.
    """

    models: tuple[str, ...]
    ttft: Objective
    itl: Objective

    def objective(self, slo: SloName) -> Objective:
        return self.ttft if slo == "ttft" else self.itl


@dataclass(frozen=True, slots=True)
class SloSpec:
    job: str  # the Prometheus job that scrapes phasewatch
    diagnosis_url: str
    default: Target
    overrides: tuple[Target, ...]
    diagnosis_for: str
    diagnosis_min_confidence: float

    @property
    def targets(self) -> tuple[Target, ...]:
        return (self.default, *self.overrides)

    @property
    def overridden_models(self) -> tuple[str, ...]:
        return tuple(model for target in self.overrides for model in target.models)


def _where(loc: tuple[int | str, ...]) -> str:
    return ".".join(str(part) for part in loc) or "(top level)"


def _edge_problems(slo: SloName, objective: Objective, where: str) -> list[str]:
    edges = BUCKETS[slo]
    if objective.threshold_s in edges:
        return []
    below = [edge for edge in edges if edge < objective.threshold_s]
    above = [edge for edge in edges if edge > objective.threshold_s]
    nearest = " and ".join(f"{edge:g}" for edge in (below[-1:] + above[:1]))
    return [
        f"{where}.threshold_s {objective.threshold_s:g} is not a bucket edge of "
        f"{HISTOGRAMS[slo]} ({BUCKET_CONSTANTS[slo]} in phasewatch.core.metrics), so no bucket "
        f"counts the events under it; the nearest edges are {nearest}"
    ]


def parse_spec(data: Mapping[str, Any]) -> SloSpec:
    """Validate the SLO file's parsed contents, or raise SloError saying every problem."""
    try:
        parsed = _SloFile.model_validate(data)
    except ValidationError as exc:
        messages = [f"{_where(error['loc'])}: {error['msg']}" for error in exc.errors()]
        raise SloError("; ".join(messages)) from None

    default = Target((), parsed.objectives.ttft, parsed.objectives.itl)
    problems: list[str] = []
    for slo in SLO_NAMES:
        problems += _edge_problems(slo, default.objective(slo), f"objectives.{slo}")
    overrides: list[Target] = []
    seen: set[str] = set()
    for index, override in enumerate(parsed.models):
        if override.model in seen:
            problems.append(f"models.{index}: model {override.model!r} is listed twice")
        seen.add(override.model)
        merged: dict[SloName, Objective] = {}
        for slo in SLO_NAMES:
            changes = getattr(override, slo)
            fields = changes.model_dump(exclude_none=True) if changes is not None else {}
            try:
                merged[slo] = Objective.model_validate(
                    {**default.objective(slo).model_dump(), **fields}
                )
            except ValidationError as exc:
                problems += [f"models.{index}.{slo}.{_where(e['loc'])}: {e['msg']}"
                             for e in exc.errors()]
                continue
            problems += _edge_problems(slo, merged[slo], f"models.{index}.{slo}")
        if len(merged) == len(SLO_NAMES):
            overrides.append(Target((override.model,), merged["ttft"], merged["itl"]))
    if problems:
        raise SloError("; ".join(problems))
    return SloSpec(
        job=parsed.job,
        diagnosis_url=parsed.diagnosis_url,
        default=default,
        overrides=tuple(overrides),
        diagnosis_for=parsed.diagnosis.for_,
        diagnosis_min_confidence=parsed.diagnosis.min_confidence,
    )
