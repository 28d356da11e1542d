"""initial schema

Revision ID: 0001
Revises: (none)
Create Date: 2026-11-30 05:01:26.169135
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:

    op.create_table(
        "diagnoses",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("model", sa.String(length=255), nullable=False),
        sa.Column("window_s", sa.Float(), nullable=False),
        sa.Column("baseline", sa.String(length=200), nullable=False),
        sa.Column("verdict", sa.String(length=32), nullable=False),
        sa.Column("confidence", sa.Float(), nullable=False),
        sa.Column("evidence", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_diagnoses")),
    )
    with op.batch_alter_table("diagnoses", schema=None) as batch_op:
        batch_op.create_index("ix_diagnoses_model_at", ["model", "at"], unique=False)

    op.create_table(
        "request_rollups",
        sa.Column("minute", sa.DateTime(timezone=True), nullable=False),
        sa.Column("model", sa.String(length=255), nullable=False),
        sa.Column("endpoint", sa.String(length=32), nullable=False),
        sa.Column("outcome", sa.String(length=16), nullable=False),
        sa.Column("requests", sa.Integer(), nullable=False),
        sa.Column("ttft_count", sa.Integer(), nullable=False),
        sa.Column("ttft_sum_s", sa.Float(), nullable=False),
        sa.Column("e2e_sum_s", sa.Float(), nullable=False),
        sa.Column("itl_count", sa.BigInteger(), nullable=False),
        sa.Column("itl_sum_s", sa.Float(), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("output_tokens", sa.BigInteger(), nullable=False),
        sa.Column("ttft_buckets", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint(
            "minute", "model", "endpoint", "outcome", name=op.f("pk_request_rollups")
        ),
    )
    with op.batch_alter_table("request_rollups", schema=None) as batch_op:
        batch_op.create_index("ix_request_rollups_model_minute", ["model", "minute"], unique=False)

    op.create_table(
        "requests",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("request_id", sa.String(length=128), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("endpoint", sa.String(length=32), nullable=False),
        sa.Column("model", sa.String(length=255), nullable=True),
        sa.Column("upstream", sa.String(length=255), nullable=False),
        sa.Column("stream", sa.Boolean(), nullable=False),
        sa.Column("outcome", sa.String(length=16), nullable=False),
        sa.Column("http_status", sa.Integer(), nullable=True),
        sa.Column("in_flight_at_arrival", sa.Integer(), nullable=False),
        sa.Column("ttft_s", sa.Float(), nullable=True),
        sa.Column("e2e_s", sa.Float(), nullable=True),
        sa.Column("tpot_s", sa.Float(), nullable=True),
        sa.Column("itl_count", sa.Integer(), nullable=False),
        sa.Column("itl_mean_s", sa.Float(), nullable=True),
        sa.Column("itl_p50_s", sa.Float(), nullable=True),
        sa.Column("itl_p95_s", sa.Float(), nullable=True),
        sa.Column("itl_max_s", sa.Float(), nullable=True),
        sa.Column("prompt_tokens", sa.Integer(), nullable=True),
        sa.Column("output_tokens", sa.Integer(), nullable=True),
        sa.Column("tokens_exact", sa.Boolean(), nullable=False),
        sa.Column("run_id", sa.String(length=64), nullable=True),
        sa.Column("error", sa.String(length=200), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_requests")),
    )
    with op.batch_alter_table("requests", schema=None) as batch_op:
        batch_op.create_index("ix_requests_model_started_at", ["model", "started_at"], unique=False)
        batch_op.create_index("ix_requests_run_id", ["run_id"], unique=False)
        batch_op.create_index("ix_requests_request_id", ["request_id"], unique=False)
        batch_op.create_index("ix_requests_started_at", ["started_at"], unique=False)

    op.create_table(
        "runs",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("target", sa.String(length=500), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("parameters", sa.JSON(), nullable=False),
        sa.Column("engine", sa.JSON(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("summary", sa.JSON(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_runs")),
    )
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.create_index("ix_runs_started_at", ["started_at"], unique=False)

    op.create_table(
        "run_points",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("run_id", sa.String(length=64), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("x_name", sa.String(length=32), nullable=False),
        sa.Column("x_value", sa.Float(), nullable=False),
        sa.Column("requests", sa.Integer(), nullable=False),
        sa.Column("errors", sa.Integer(), nullable=False),
        sa.Column("concurrency", sa.Float(), nullable=True),
        sa.Column("ttft_p50_s", sa.Float(), nullable=True),
        sa.Column("ttft_p90_s", sa.Float(), nullable=True),
        sa.Column("ttft_p95_s", sa.Float(), nullable=True),
        sa.Column("ttft_p99_s", sa.Float(), nullable=True),
        sa.Column("itl_p50_s", sa.Float(), nullable=True),
        sa.Column("itl_p90_s", sa.Float(), nullable=True),
        sa.Column("itl_p95_s", sa.Float(), nullable=True),
        sa.Column("itl_p99_s", sa.Float(), nullable=True),
        sa.Column("output_throughput_tps", sa.Float(), nullable=True),
        sa.Column("total_throughput_tps", sa.Float(), nullable=True),
        sa.Column("goodput_rps", sa.Float(), nullable=True),
        sa.Column("extra", sa.JSON(), nullable=True),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_run_points_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_run_points")),
    )
    with op.batch_alter_table("run_points", schema=None) as batch_op:
        batch_op.create_index("ix_run_points_run_id_step", ["run_id", "step"], unique=False)


def downgrade() -> None:

    with op.batch_alter_table("run_points", schema=None) as batch_op:
        batch_op.drop_index("ix_run_points_run_id_step")

    op.drop_table("run_points")
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.drop_index("ix_runs_started_at")

    op.drop_table("runs")
    with op.batch_alter_table("requests", schema=None) as batch_op:
        batch_op.drop_index("ix_requests_started_at")
        batch_op.drop_index("ix_requests_run_id")
        batch_op.drop_index("ix_requests_request_id")
        batch_op.drop_index("ix_requests_model_started_at")

    op.drop_table("requests")
    with op.batch_alter_table("request_rollups", schema=None) as batch_op:
        batch_op.drop_index("ix_request_rollups_model_minute")

    op.drop_table("request_rollups")
    with op.batch_alter_table("diagnoses", schema=None) as batch_op:
        batch_op.drop_index("ix_diagnoses_model_at")

    op.drop_table("diagnoses")
