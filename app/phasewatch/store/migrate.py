"""Schema migrations: where the database stands, and bringing it to the code's revision.

A fresh database (no tables at all) is migrated on first start: that is the zero-configuration
default. A database at an older revision is refused unless the operator says to upgrade
(`phasewatch db upgrade`, or PHASEWATCH_DATABASE_AUTO_UPGRADE=true).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncEngine

log = logging.getLogger(__name__)



def migrations_dir() -> Path:
    """The Alembic scripts, found through the package (`phasewatch.migrations`:
    app/phasewatch/migrations/ in the source tree, inside the package once installed), never through
    the working directory."""
    return Path(str(files("phasewatch.migrations")))


class SchemaError(RuntimeError):
    """The database's schema does not match the code; the message says what to do."""


@dataclass(frozen=True, slots=True)
class SchemaState:
    current: str | None  # the database's revision, None if it has none
    head: str  # the revision this code needs
    empty: bool  # no tables at all: a new database


def alembic_config(url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def head_revision() -> str:
    head = ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()
    assert head is not None, "no migrations found"
    return head


async def schema_state(engine: AsyncEngine) -> SchemaState:
    def read(connection: Connection) -> tuple[str | None, bool]:
        current = MigrationContext.configure(connection).get_current_revision()
        return current, not inspect(connection).get_table_names()

    async with engine.connect() as connection:
        current, empty = await connection.run_sync(read)
    return SchemaState(current, head_revision(), empty)


def upgrade(url: str, revision: str = "head") -> None:
    """Apply migrations up to `revision` (blocking; the migration env runs its own loop)."""
    command.upgrade(alembic_config(url), revision)


async def prepare_schema(engine: AsyncEngine, url: str, auto_upgrade: bool) -> None:
    """Make sure the schema is the code's, or raise SchemaError saying what to run."""
    state = await schema_state(engine)
    if state.current == state.head:
        return
    if state.empty or auto_upgrade:
        log.info("migrating database from %s to %s", state.current or "empty", state.head)
        await asyncio.to_thread(upgrade, url)
        return
    if state.current is not None and state.current not in _known_revisions():
        raise SchemaError(
            f"the database is at revision {state.current}, which this phasewatch does not know "
            "(a newer version migrated it); run that version, or point "
            "PHASEWATCH_DATABASE_URL at another database"
        )
    raise SchemaError(
        f"the database schema is at revision {state.current or 'none'} but this phasewatch "
        f"needs {state.head}: run `phasewatch db upgrade`, or set "
        "PHASEWATCH_DATABASE_AUTO_UPGRADE=true to upgrade at startup"
    )


def _known_revisions() -> set[str]:
    scripts = ScriptDirectory.from_config(alembic_config("sqlite://"))
    return {script.revision for script in scripts.walk_revisions()}
