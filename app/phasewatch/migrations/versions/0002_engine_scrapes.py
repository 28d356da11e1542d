"""engine scrapes: the leader's scrapes of the engine's /metrics, shared by every process

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02 09:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "engine_scrapes",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("url", sa.String(length=500), nullable=False),
        sa.Column("snapshot", sa.JSON(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_engine_scrapes")),
    )
    with op.batch_alter_table("engine_scrapes", schema=None) as batch_op:
        batch_op.create_index("ix_engine_scrapes_url_at", ["url", "at"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("engine_scrapes", schema=None) as batch_op:
        batch_op.drop_index("ix_engine_scrapes_url_at")

    op.drop_table("engine_scrapes")
