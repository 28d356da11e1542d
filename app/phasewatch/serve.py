"""What `phasewatch serve` sets up before uvicorn starts its workers.

Each worker builds its own app from the environment (`phasewatch.main.serve_app`, uvicorn's factory,
in a freshly spawned process), so the command's flags are put into the environment first, as the
`PHASEWATCH_*` variables they stand for. With more than one worker (or PROMETHEUS_MULTIPROC_DIR
set), the metrics directory is made ready before any worker starts, because prometheus_client reads
the variable when it is imported: created, or emptied of an earlier run's files, or, when none is
named, a temporary one removed at exit (app/phasewatch/core/exposition.py). And the database schema
is prepared here, once, rather than raced by N workers at startup (a new SQLite file would be
created by all of them at once). These changes last for the rest of the process: `phasewatch serve`
is the whole of its life.

The command stays a thin shell over this; uvicorn's own options stay in app/phasewatch/cli.py.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import resource
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

from phasewatch.core.db import create_engine
from phasewatch.core.exposition import prepare_metrics_dir
from phasewatch.core.settings import ENV_PREFIX, Settings
from phasewatch.store.migrate import prepare_schema

log = logging.getLogger(__name__)

METRICS_DIR_VARIABLE = "PROMETHEUS_MULTIPROC_DIR"


# Descriptors kept free of client and upstream connections: the listening socket, the
# database, log files, the metrics files of several workers.
FD_RESERVE = 64


def raise_open_file_limit() -> int:
    """Raise this process's soft open-file limit to its hard limit (inherited by the workers);
    the limit it has now. Every stream holds two descriptors (client and upstream; four
    while the native relay holds it: its thread's duplicates): the default soft limit of
    1,024 would refuse streams with "Too many open files" near 250."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-file limit from %d (%s)", soft, exc)
    return soft


def connection_capacity(open_files: int, native_relay: bool) -> int:
    """Client connections one process can hold with an upstream connection each, leaving
    `FD_RESERVE` descriptors; past it, new connections are refused with a 503
    (app/phasewatch/proxy/client_leg.py) before any descriptor runs out. A stream in the native leg
    holds a duplicate of both (app/phasewatch/proxy/native.py): four descriptors instead of two."""
    return max(1, (open_files - FD_RESERVE) // (4 if native_relay else 2))


def usable_cores() -> int:
    """CPUs this process may run on (its affinity; a container's CPU quota is not seen)."""
    return len(os.sched_getaffinity(0))


async def _prepare_database(settings: Settings) -> None:
    engine = create_engine(settings.database_url)
    try:
        await prepare_schema(engine, settings.database_url, settings.database_auto_upgrade)
    finally:
        await engine.dispose()


def prepare_serving(settings: Settings, flags: Mapping[str, object]) -> int:
    """Make this process's environment the one its workers start in: `flags` (settings field
    -> value, from the command line) as variables, the open-file limit raised, and the metrics
    directory when needed. Returns the client connections each worker may hold. Raises
    phasewatch.store.migrate.SchemaError (a sentence for a person) when the schema is not the code's
    and may not be upgraded."""
    os.environ.update({ENV_PREFIX + name.upper(): str(value) for name, value in flags.items()})
    open_files = raise_open_file_limit()
    capacity = settings.max_client_connections or connection_capacity(open_files,
                                                                       settings.native_relay)
    log.info("open-file limit %d: up to %d client connections (streams) per worker; more are "
             "refused with 503", open_files, capacity)
    if settings.workers > 1 or settings.metrics_dir is not None:
        directory = settings.metrics_dir
        if directory is None:
            directory = Path(tempfile.mkdtemp(prefix="phasewatch-metrics-"))
            atexit.register(shutil.rmtree, directory, ignore_errors=True)
        prepare_metrics_dir(directory)
        os.environ[METRICS_DIR_VARIABLE] = str(directory)
    if settings.workers > 1:
        if settings.workers > usable_cores():
            log.warning("%d workers on %d usable cores: more workers than cores only adds "
                        "contention (README, How to scale)", settings.workers, usable_cores())
        asyncio.run(_prepare_database(settings))
    return capacity
