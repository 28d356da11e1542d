"""diagnosis latest: the schedule's latest round per model, what every process answers by default

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-07 06:30:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "diagnosis_latest",
        sa.Column("model", sa.String(length=255), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("verdict", sa.String(length=32), nullable=False),
        sa.Column("confidence", sa.Float(), nullable=False),
        sa.Column("report", sa.JSON(), nullable=False),
        sa.Column("held", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("model", name=op.f("pk_diagnosis_latest")),
    )


def downgrade() -> None:
    op.drop_table("diagnosis_latest")
