"""Alembic environment: async engine, batch mode on SQLite, models' metadata as the target.

The URL comes from the Alembic config; `phasewatch db upgrade` sets it from the settings.
On Postgres, migrations hold an advisory lock for their transaction, so replicas that start
together on one database migrate it once: the others wait, then find the schema at head.
"""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy import text
from sqlalchemy.engine import Connection

from phasewatch.core.db import create_engine
from phasewatch.store.models import Base

config = context.config
target_metadata = Base.metadata

# Any fixed 64-bit key: phasewatch's own, for "a migration is running on this database".
MIGRATION_LOCK_KEY = 0x7068_6173_6577_6174  # "phasewat"


def _configure(connection: Connection | None = None, url: str | None = None) -> None:
    dialect = connection.dialect.name if connection is not None else (url or "").split(":")[0]
    context.configure(
        connection=connection,
        url=url,
        target_metadata=target_metadata,
        render_as_batch=dialect.startswith("sqlite"),  # SQLite cannot ALTER most things
        compare_type=True,
        literal_binds=connection is None,
    )


def run_migrations_offline() -> None:
    _configure(url=config.get_main_option("sqlalchemy.url"))
    with context.begin_transaction():
        context.run_migrations()


def _run_sync(connection: Connection) -> None:
    _configure(connection=connection)
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":
            # Taken before Alembic reads the current revision, released at commit.
            connection.execute(text("SELECT pg_advisory_xact_lock(:key)"),
                               {"key": MIGRATION_LOCK_KEY})
        context.run_migrations()


async def run_migrations_online() -> None:
    url = config.get_main_option("sqlalchemy.url")
    assert url, "sqlalchemy.url is not set"
    engine = create_engine(url)
    try:
        async with engine.connect() as connection:
            await connection.run_sync(_run_sync)
            await connection.commit()
    finally:
        await engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    asyncio.run(run_migrations_online())
