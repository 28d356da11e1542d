"""live snapshots: each process's latest list of requests in flight, shared by every process

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01 15:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "live_snapshots",
        sa.Column("process", sa.String(length=100), nullable=False),
        sa.Column("taken_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("items", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("process", name=op.f("pk_live_snapshots")),
    )
    with op.batch_alter_table("live_snapshots", schema=None) as batch_op:
        batch_op.create_index("ix_live_snapshots_taken_at", ["taken_at"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("live_snapshots", schema=None) as batch_op:
        batch_op.drop_index("ix_live_snapshots_taken_at")

    op.drop_table("live_snapshots")
