"""Where bench runs are kept: phasewatch's own database (`runs` and `run_points`).

By default the database of `PHASEWATCH_DATABASE_URL` (or `--database-url`), the proxy's
default included, so a bench through a local phasewatch shares its store: the run, its points,
and the proxy's records of the same requests (`requests.run_id`) sit side by side, and
`/api/runs` serves the runs. The schema is checked as the proxy checks it: a new database is
migrated, one that is behind is refused with what to run.

Reading (`runs list|show|compare`) opens the store `read_only`: a database that does not exist
is never created (SQLite would create an empty file on connect) and an empty one is never
migrated; `NoDatabase` names the place that was read instead. `where` says which file or server
a URL means (a relative SQLite path is relative to the working directory).

Rows go in and come out exactly as `phasewatch.bench.result` shapes them, so a stored run
renders the same report as the run that stored it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from phasewatch.bench.result import POINT_COLUMNS, RUN_COLUMNS, RunResult
from phasewatch.core.db import create_engine, create_sessionmaker, is_sqlite
from phasewatch.store.migrate import prepare_schema, schema_state
from phasewatch.store.queries import get_run, list_runs, run_ids_starting_with
from phasewatch.store.runs import begin_run, complete_run


class RunNotFound(LookupError):
    """No run, or more than one, answers to the id given; the message says which."""


class NoDatabase(LookupError):
    """Reading found no database, or one without phasewatch's tables; nothing was created."""


def where(database_url: str) -> str:
    """The database a URL names, for people: a SQLite file's absolute path, else the URL
    without credentials."""
    if is_sqlite(database_url):
        database = make_url(database_url).database
        if not database or database == ":memory:":
            return "an in-memory SQLite database"
        return str(Path(database).resolve())
    return database_url.split("@")[-1]


def _is_file(path: str) -> bool:
    return Path(path).is_file()  # one stat, before any connection: not worth a thread


class RunStore:
    def __init__(self, database_url: str, auto_upgrade: bool = False,
                 read_only: bool = False) -> None:
        self.url = database_url
        self.auto_upgrade = auto_upgrade
        self.read_only = read_only
        self._engine: AsyncEngine | None = None
        self._sessions: async_sessionmaker[AsyncSession] | None = None

    async def __aenter__(self) -> RunStore:
        if self.read_only and is_sqlite(self.url):
            database = make_url(self.url).database
            if database and database != ":memory:" and not _is_file(database):
                raise NoDatabase(f"no database at {self.safe_url}, so no runs; nothing was "
                                 "created")
        self._engine = create_engine(self.url)
        try:
            if self.read_only and (await schema_state(self._engine)).empty:
                raise NoDatabase(f"{self.safe_url} has no phasewatch tables, so no runs")
            await prepare_schema(self._engine, self.url, self.auto_upgrade)
        except BaseException:
            await self._engine.dispose()
            raise
        self._sessions = create_sessionmaker(self._engine)
        return self

    async def __aexit__(self, *_: object) -> None:
        if self._engine is not None:
            await self._engine.dispose()

    def _session(self) -> AsyncSession:
        assert self._sessions is not None, "use RunStore in `async with`"
        return self._sessions()

    async def begin(self, run: dict[str, Any]) -> None:
        async with self._session() as session:
            await begin_run(session, run)

    async def finish(self, run: dict[str, Any], points: list[dict[str, Any]]) -> None:
        async with self._session() as session:
            await complete_run(session, run, points)

    async def resolve(self, id_or_prefix: str) -> str:
        async with self._session() as session:
            if await get_run(session, id_or_prefix) is not None:
                return id_or_prefix
            found = await run_ids_starting_with(session, id_or_prefix)
        if len(found) != 1:
            what = "no run" if not found else "more than one run"
            raise RunNotFound(f"{what} with an id starting {id_or_prefix!r} in {self.safe_url}")
        return found[0]

    async def load(self, id_or_prefix: str) -> RunResult:
        run_id = await self.resolve(id_or_prefix)
        async with self._session() as session:
            run = await get_run(session, run_id)
            assert run is not None
            return RunResult(
                {key: getattr(run, key) for key in RUN_COLUMNS},
                [{key: getattr(p, key) for key in POINT_COLUMNS} for p in run.points],
            )

    async def recent(self, limit: int, kind: str | None = None) -> list[dict[str, Any]]:
        async with self._session() as session:
            runs, _ = await list_runs(session, None, None, kind, limit, None)
            return [{key: getattr(run, key) for key in RUN_COLUMNS} for run in runs]

    @property
    def safe_url(self) -> str:
        """Where the store is, for messages: a SQLite file's absolute path, or the URL without
        credentials."""
        return where(self.url)
