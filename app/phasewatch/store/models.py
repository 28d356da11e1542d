"""The schema, as SQLAlchemy 2 typed models. Alembic migrations under `app/phasewatch/migrations/`
build it.

No prompt or completion text has a column here. Times are stored with their time zone (UTC).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.types import TypeDecorator

# Constraint names are stable across SQLite and Postgres, so migrations can refer to them.
NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# SQLite's ROWID alias must be INTEGER; Postgres gets a 64-bit key.
BigId = BigInteger().with_variant(Integer, "sqlite")


class UTCDateTime(TypeDecorator[datetime]):
    """A timezone-aware UTC datetime on every backend (SQLite keeps no zone: restore it)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime: phasewatch stores UTC times with their zone")
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)
    type_annotation_map = {datetime: UTCDateTime, dict[str, Any]: JSON}  # noqa: RUF012


class RequestRow(Base):
    """One proxied inference request, with every figure the proxy measured."""

    __tablename__ = "requests"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    request_id: Mapped[str] = mapped_column(String(128))
    started_at: Mapped[datetime]
    endpoint: Mapped[str] = mapped_column(String(32))
    model: Mapped[str | None] = mapped_column(String(255))
    upstream: Mapped[str] = mapped_column(String(255))
    stream: Mapped[bool] = mapped_column(Boolean)
    outcome: Mapped[str] = mapped_column(String(16))
    http_status: Mapped[int | None] = mapped_column(Integer)
    in_flight_at_arrival: Mapped[int] = mapped_column(Integer)
    ttft_s: Mapped[float | None] = mapped_column(Float)
    e2e_s: Mapped[float | None] = mapped_column(Float)
    tpot_s: Mapped[float | None] = mapped_column(Float)
    itl_count: Mapped[int] = mapped_column(Integer)
    itl_mean_s: Mapped[float | None] = mapped_column(Float)
    itl_p50_s: Mapped[float | None] = mapped_column(Float)
    itl_p95_s: Mapped[float | None] = mapped_column(Float)
    itl_max_s: Mapped[float | None] = mapped_column(Float)
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    output_tokens: Mapped[int | None] = mapped_column(Integer)
    tokens_exact: Mapped[bool] = mapped_column(Boolean)
    # A run id sent by the client (`x-phasewatch-run-id`); not a foreign key, since the proxy
    # must store a request whatever id it carries.
    run_id: Mapped[str | None] = mapped_column(String(64))
    error: Mapped[str | None] = mapped_column(String(200))

    __table_args__ = (
        Index("ix_requests_started_at", "started_at"),
        Index("ix_requests_model_started_at", "model", "started_at"),
        Index("ix_requests_run_id", "run_id"),
        Index("ix_requests_request_id", "request_id"),
    )


class RequestRollup(Base):
    """Requests summed per minute, model, endpoint and outcome; kept after raw rows expire."""

    __tablename__ = "request_rollups"

    minute: Mapped[datetime] = mapped_column(primary_key=True)
    model: Mapped[str] = mapped_column(String(255), primary_key=True)  # "" when unknown
    endpoint: Mapped[str] = mapped_column(String(32), primary_key=True)
    outcome: Mapped[str] = mapped_column(String(16), primary_key=True)
    requests: Mapped[int] = mapped_column(Integer)
    ttft_count: Mapped[int] = mapped_column(Integer)
    ttft_sum_s: Mapped[float] = mapped_column(Float)
    e2e_sum_s: Mapped[float] = mapped_column(Float)
    itl_count: Mapped[int] = mapped_column(BigInteger)  # token gaps
    itl_sum_s: Mapped[float] = mapped_column(Float)  # their total time
    prompt_tokens: Mapped[int] = mapped_column(BigInteger)
    output_tokens: Mapped[int] = mapped_column(BigInteger)
    # Counts per bucket of the proxy's TTFT histogram edges (last: above the top edge), so
    # long-range percentiles can be read from rollups.
    ttft_buckets: Mapped[list[int]] = mapped_column(JSON)

    __table_args__ = (Index("ix_request_rollups_model_minute", "model", "minute"),)


class Run(Base):
    """A named benchmark or experiment against one target."""

    __tablename__ = "runs"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    kind: Mapped[str] = mapped_column(String(32))
    target: Mapped[str] = mapped_column(String(500))
    status: Mapped[str] = mapped_column(String(16))  # running, finished, failed
    parameters: Mapped[dict[str, Any]]
    engine: Mapped[dict[str, Any]]  # flags and version, where the server tells them
    started_at: Mapped[datetime]
    finished_at: Mapped[datetime | None]
    summary: Mapped[dict[str, Any] | None]

    points: Mapped[list[RunPoint]] = relationship(
        back_populates="run", cascade="all, delete-orphan", order_by="RunPoint.step"
    )

    __table_args__ = (Index("ix_runs_started_at", "started_at"),)


class RunPoint(Base):
    """One step of a run's sweep: the x value and the figures measured there."""

    __tablename__ = "run_points"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Integer)
    x_name: Mapped[str] = mapped_column(String(32))  # prompt_tokens, concurrency, rate, ...
    x_value: Mapped[float] = mapped_column(Float)
    requests: Mapped[int] = mapped_column(Integer)
    errors: Mapped[int] = mapped_column(Integer)
    concurrency: Mapped[float | None] = mapped_column(Float)  # achieved, not asked for
    ttft_p50_s: Mapped[float | None] = mapped_column(Float)
    ttft_p90_s: Mapped[float | None] = mapped_column(Float)
    ttft_p95_s: Mapped[float | None] = mapped_column(Float)
    ttft_p99_s: Mapped[float | None] = mapped_column(Float)
    itl_p50_s: Mapped[float | None] = mapped_column(Float)
    itl_p90_s: Mapped[float | None] = mapped_column(Float)
    itl_p95_s: Mapped[float | None] = mapped_column(Float)
    itl_p99_s: Mapped[float | None] = mapped_column(Float)
    output_throughput_tps: Mapped[float | None] = mapped_column(Float)
    total_throughput_tps: Mapped[float | None] = mapped_column(Float)
    goodput_rps: Mapped[float | None] = mapped_column(Float)
    extra: Mapped[dict[str, Any] | None]

    run: Mapped[Run] = relationship(back_populates="points")

    __table_args__ = (Index("ix_run_points_run_id_step", "run_id", "step"),)


class Diagnosis(Base):
    """A verdict on one model's traffic over a window, with the evidence behind it."""

    __tablename__ = "diagnoses"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    at: Mapped[datetime]
    model: Mapped[str] = mapped_column(String(255))
    window_s: Mapped[float] = mapped_column(Float)
    baseline: Mapped[str] = mapped_column(String(200))
    verdict: Mapped[str] = mapped_column(String(32))
    confidence: Mapped[float] = mapped_column(Float)
    evidence: Mapped[dict[str, Any]]

    __table_args__ = (Index("ix_diagnoses_model_at", "model", "at"),)


class DiagnosisLatest(Base):
    """The schedule's latest round for one model: the verdict it holds, the report behind it and its
    state between rounds (app/phasewatch/diagnosis/hold.py), replaced every round. What the default
    `GET /api/diagnosis` answers in every process, and what a new leader resumes from."""

    __tablename__ = "diagnosis_latest"

    model: Mapped[str] = mapped_column(String(255), primary_key=True)
    at: Mapped[datetime]
    verdict: Mapped[str] = mapped_column(String(32))
    confidence: Mapped[float] = mapped_column(Float)
    report: Mapped[dict[str, Any]]
    held: Mapped[dict[str, Any]]


class EngineScrape(Base):
    """One scrape of the engine's `/metrics` by the leading process
    (app/phasewatch/store/leader.py), so every worker and replica diagnoses from the same
    scrapes."""

    __tablename__ = "engine_scrapes"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    at: Mapped[datetime]  # wall clock when the response arrived, as requests' started_at
    url: Mapped[str] = mapped_column(String(500))
    # What diagnosis reads of it (app/phasewatch/engine/codec.py); None when the scrape failed.
    snapshot: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))

    __table_args__ = (Index("ix_engine_scrapes_url_at", "url", "at"),)


class LiveSnapshot(Base):
    """One process's latest view of its requests still in flight (app/phasewatch/core/live.py), so
    every worker and replica diagnoses from the same live state. One row per process, replaced at
    each publication; rows of processes that stopped publishing are deleted once stale."""

    __tablename__ = "live_snapshots"

    process: Mapped[str] = mapped_column(String(100), primary_key=True)  # host:pid:start
    taken_at: Mapped[datetime]  # wall clock when the snapshot was taken, as requests' started_at
    # `InFlight.as_dict()` of each request, at most `live_snapshot_max_requests` of them.
    items: Mapped[list[dict[str, Any]]] = mapped_column(JSON)

    __table_args__ = (Index("ix_live_snapshots_taken_at", "taken_at"),)
