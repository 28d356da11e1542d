"""Migrations build the schema from empty on both backends and agree with the models."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import text
from sqlalchemy.engine import Connection

from phasewatch.core.db import create_engine
from phasewatch.store.migrate import (
    SchemaError,
    head_revision,
    prepare_schema,
    schema_state,
    upgrade,
)
from phasewatch.store.models import Base
from tests.support.databases import postgres_database


async def _diff(url: str) -> list[object]:
    engine = create_engine(url)

    def compare(connection: Connection) -> list[object]:
        context = MigrationContext.configure(connection, opts={"compare_type": True})
        return list(compare_metadata(context, Base.metadata))

    try:
        async with engine.connect() as connection:
            return await connection.run_sync(compare)
    finally:
        await engine.dispose()


def test_upgrade_from_empty_matches_the_models(database_url: str) -> None:
    upgrade(database_url)
    assert asyncio.run(_diff(database_url)) == []


def test_downgrade_to_base_and_back(database_url: str) -> None:
    upgrade(database_url)
    from alembic import command

    from phasewatch.store.migrate import alembic_config
    command.downgrade(alembic_config(database_url), "base")
    upgrade(database_url)
    assert asyncio.run(_diff(database_url)) == []


async def test_a_new_database_is_created_on_first_start(database_url: str) -> None:
    engine = create_engine(database_url)
    try:
        assert (await schema_state(engine)).empty
        await prepare_schema(engine, database_url, auto_upgrade=False)
        state = await schema_state(engine)
        assert state.current == state.head == head_revision()
    finally:
        await engine.dispose()


async def test_a_database_behind_the_code_is_refused_with_what_to_run(database_url: str) -> None:
    engine = create_engine(database_url)
    try:
        async with engine.begin() as connection:  # an old install: tables, no revision
            await connection.execute(text("CREATE TABLE legacy (id INTEGER PRIMARY KEY)"))
        with pytest.raises(SchemaError, match="run `phasewatch db upgrade`"):
            await prepare_schema(engine, database_url, auto_upgrade=False)
        await prepare_schema(engine, database_url, auto_upgrade=True)  # told to: it upgrades
        assert (await schema_state(engine)).current == head_revision()
    finally:
        await engine.dispose()


async def test_a_database_from_a_newer_version_is_refused(sqlite_url: str) -> None:
    await asyncio.to_thread(upgrade, sqlite_url)
    engine = create_engine(sqlite_url)
    try:
        async with engine.begin() as connection:
            await connection.execute(text("UPDATE alembic_version SET version_num = 'ffff'"))
        with pytest.raises(SchemaError, match="does not know"):
            await prepare_schema(engine, sqlite_url, auto_upgrade=False)
    finally:
        await engine.dispose()


def test_sqlite_runs_in_wal_mode(sqlite_url: str) -> None:
    async def mode() -> str:
        engine = create_engine(sqlite_url)
        try:
            async with engine.connect() as connection:
                return str(await connection.scalar(text("PRAGMA journal_mode")))
        finally:
            await engine.dispose()

    assert asyncio.run(mode()) == "wal"


def test_db_command_upgrades_and_reports(database_url: str) -> None:
    env = {**os.environ, "PHASEWATCH_DATABASE_URL": database_url}
    run = [sys.executable, "-m", "phasewatch.cli", "db"]
    before = subprocess.run([*run, "current"], env=env, capture_output=True, text=True,
                            timeout=60, check=True)
    assert "revision none" in before.stdout and "behind" in before.stdout
    after = subprocess.run([*run, "upgrade"], env=env, capture_output=True, text=True,
                           timeout=60, check=True)
    assert f"revision {head_revision()}" in after.stdout and "up to date" in after.stdout


def test_replicas_starting_together_on_an_empty_postgres_all_migrate() -> None:
    """Several replicas (processes) upgrading one empty database at once: one migrates, the
    others wait for it and find the schema at head, and none fails."""
    with postgres_database(f"pw_{uuid.uuid4().hex[:12]}") as url:
        script = "import sys; from phasewatch.store.migrate import upgrade; upgrade(sys.argv[1])"
        replicas = [subprocess.Popen([sys.executable, "-c", script, url],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                    for _ in range(4)]
        outputs = [(p.wait(timeout=120), p.stdout.read().decode() if p.stdout else "")
                   for p in replicas]
        assert [code for code, _ in outputs] == [0] * 4, outputs
        assert asyncio.run(_diff(url)) == []
