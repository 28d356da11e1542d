"""Real databases for tests: a throwaway database on the machine's PostgreSQL (127.0.0.1:5432,
trust auth), and a private PostgreSQL instance that a test may stop and start at will."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import asyncpg  # type: ignore[import-untyped]
import pytest

from tests.support.servers import free_port

ADMIN_DSN = os.environ.get("PHASEWATCH_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/test")


def _admin(sql: str, dsn: str = ADMIN_DSN) -> None:
    import asyncio

    async def run() -> None:
        connection = await asyncpg.connect(dsn, timeout=5)
        try:
            await connection.execute(sql)
        finally:
            await connection.close()

    asyncio.run(run())


@contextmanager
def postgres_database(name: str) -> Iterator[str]:
    """A new, empty database on the shared server, dropped afterwards."""
    try:
        _admin(f'CREATE DATABASE "{name}"')
    except (OSError, asyncpg.PostgresError) as exc:
        pytest.fail(f"PostgreSQL at {ADMIN_DSN} is needed (.ci/run starts it): {exc}")
    base = ADMIN_DSN.rsplit("/", 1)[0].replace("postgresql://", "postgresql+asyncpg://")
    try:
        yield f"{base}/{name}"
    finally:
        _admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _pg_bin(tool: str) -> str:
    found = sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{tool}"))
    if not found:
        pytest.skip(f"PostgreSQL server binaries ({tool}) are not installed")
    return str(found[-1])


class PrivatePostgres:
    """A PostgreSQL instance of the test's own, on a free port, that it can stop and start."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="pw-pg-"))
        self.data = self.dir / "data"
        self.port = free_port()
        self.url = f"postgresql+asyncpg://postgres@127.0.0.1:{self.port}/postgres"
        self._as_postgres = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if self._as_postgres:
            shutil.chown(self.dir, "postgres")
        subprocess.run([*self._as_postgres, _pg_bin("initdb"), "-D", str(self.data), "-U",
                        "postgres", "--auth=trust", "-E", "UTF8"],
                       check=True, capture_output=True)

    def start(self) -> None:
        subprocess.run([*self._as_postgres, _pg_bin("pg_ctl"), "-D", str(self.data), "-w",
                        "-l", str(self.dir / "log"), "-o",
                        f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 "
                        "-c fsync=off", "start"], check=True, capture_output=True)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                _admin("SELECT 1", f"postgresql://postgres@127.0.0.1:{self.port}/postgres")
                return
            except (OSError, asyncpg.PostgresError):
                time.sleep(0.1)
        raise RuntimeError("private PostgreSQL did not start")

    def stop(self) -> None:
        subprocess.run([*self._as_postgres, _pg_bin("pg_ctl"), "-D", str(self.data), "-w",
                        "-m", "fast", "stop"], check=False, capture_output=True)

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
