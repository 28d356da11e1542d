"""What `GET /metrics` serves: this process's registry, or the metrics of every worker merged.

With one process, the app's own registry is served as it is. Under `phasewatch serve --workers
N` any worker may answer a scrape, so each must serve the metrics of all of them:
prometheus_client's multiprocess mode. `PROMETHEUS_MULTIPROC_DIR` is set before any worker
starts, so in every worker prometheus_client keeps each metric's value in a per-process file
there (`counter_<pid>.db`, `gauge_livesum_<pid>.db`, ...), and a scrape merges the files with
its `MultiProcessCollector`:

- counters and histograms are summed over every worker that ever ran since the directory was
  emptied, a dead one's included: a counter must not go back when a worker dies;
- gauges are merged by their `multiprocess_mode`, and phasewatch's are all `live*` modes
  (`livesum` for in-flight requests and queue depths, `livemax` for the leader's verdict
  gauges), which count the processes alive only. Before each merge, the live-gauge files of
  processes that are gone are removed (`mark_process_dead`), so a killed worker leaves no
  series behind and its in-flight requests stop counting.

This module only reads and prunes those files; the metrics themselves are built, on an
injected registry, by the modules that own them (app/core/metrics.py and the packages').
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import re
import time
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest, values
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

# The live-gauge files prometheus_client writes: gauge_<live mode>_<pid>.db
LIVE_GAUGE_FILE = re.compile(r"^gauge_live[a-z]+_(\d+)\.db$")


def prepare_metrics_dir(path: Path) -> None:
    """Create `path`, or empty it of a previous run's metric files. For the parent process,
    before any worker starts: files left from an earlier run would be merged into this one."""
    path.mkdir(parents=True, exist_ok=True)
    for stale in path.glob("*.db"):
        stale.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, under another user
        return True
    return True


def prune_dead_workers(path: Path) -> list[int]:
    """Remove the live-gauge files of processes that no longer exist; their pids.

    A pid is taken as alive while any process has it; a pid reused by an unrelated process
    keeps a dead worker's live gauges until that process ends too (rare: pids cycle slowly).
    """
    dead = set()
    for entry in os.scandir(path):
        match = LIVE_GAUGE_FILE.match(entry.name)
        if match is not None and not _alive(int(match.group(1))):
            dead.add(int(match.group(1)))
    for pid in dead:
        with contextlib.suppress(FileNotFoundError):  # another worker pruned it first
            mark_process_dead(pid, str(path))  # type: ignore[no-untyped-call]
    return sorted(dead)


class Exposition:
    """The bytes of one scrape of `/metrics`.

    `latest()` is what the endpoint serves: rendered in a worker thread, never on the relay's
    event loop; one render at a time, shared by every scrape that arrives while it runs; and
    reused for `max_age_s` after it started, so a storm of scrapers costs at most one render
    per `max_age_s` however many there are (rendering walks every series under the GIL).
    """

    def __init__(self, registry: CollectorRegistry, multiprocess_dir: Path | None,
                 max_age_s: float = 0.0) -> None:
        self.multiprocess_dir = multiprocess_dir
        self.max_age_s = max_age_s
        self._cached = b""
        self._cached_at = -math.inf
        self._rendering: asyncio.Future[bytes] | None = None
        if multiprocess_dir is None:
            self._registry = registry
        else:
            if not getattr(values.ValueClass, "_multiprocess", False):
                raise ValueError(
                    "PROMETHEUS_MULTIPROC_DIR must be set before the process starts (it is read "
                    "when prometheus_client is imported): let `phasewatch serve` set it")
            # The metrics' own registry holds this process's values only; a scrape reads the
            # files of every worker instead.
            self._registry = CollectorRegistry()
            path = str(multiprocess_dir)
            MultiProcessCollector(self._registry, path)  # type: ignore[no-untyped-call]

    @property
    def multiprocess(self) -> bool:
        return self.multiprocess_dir is not None

    def render(self) -> bytes:
        if self.multiprocess_dir is not None:
            prune_dead_workers(self.multiprocess_dir)
        return generate_latest(self._registry)

    async def latest(self) -> bytes:
        if time.monotonic() - self._cached_at < self.max_age_s:
            return self._cached
        if self._rendering is None:
            self._rendering = asyncio.ensure_future(self._render())
        return await asyncio.shield(self._rendering)  # one scraper leaving cancels no render

    async def _render(self) -> bytes:
        try:
            started = time.monotonic()
            data = await asyncio.to_thread(self.render)
            self._cached, self._cached_at = data, started
            return data
        finally:
            self._rendering = None
