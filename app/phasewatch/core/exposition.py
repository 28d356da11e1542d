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

A scrape gets the format it asks for in `Accept`, as prometheus_client's own handler decides:
OpenMetrics when the scraper offers it (Prometheus does by default), which is the format that
carries exemplars (the request ids on TTFT and ITL buckets, app/phasewatch/core/metrics.py); the
classic text format otherwise. Names and values are the same in both.

This module only reads and prunes those files; the metrics themselves are built, on an
injected registry, by the modules that own them (app/phasewatch/core/metrics.py and the packages').
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry, values
from prometheus_client.exposition import choose_encoder
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

log = logging.getLogger(__name__)

# Formats (content types, as `Accept` chose them) kept rendered; others get the text format.
MAX_FORMATS = 4
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


@dataclass(slots=True)
class _Rendered:
    """One format's latest render, and the render under way, if any."""

    data: bytes = b""
    at: float = -math.inf
    rendering: asyncio.Future[bytes] | None = None


class Exposition:
    """The bytes of one scrape of `/metrics`.

    `latest(accept)` is what the endpoint serves, in the format `accept` asks for: rendered in a
    worker thread, never on the relay's event loop; one render per format at a time, shared by every
    scrape that arrives while it runs; and reused for `max_age_s` after it started, so a storm of
    scrapers costs at most one render per format per `max_age_s` however many there are (rendering
    walks every series under the GIL). Before each render it awaits `before_render`, if set: the
    app's live registry bringing the streams the native leg holds up to date
    (app/phasewatch/proxy/live.py), so a render counts every token relayed before it. A fault there
    is logged and the render goes on with what is recorded.
    """

    def __init__(self, registry: CollectorRegistry, multiprocess_dir: Path | None,
                 max_age_s: float = 0.0) -> None:
        self.multiprocess_dir = multiprocess_dir
        self.max_age_s = max_age_s
        self._formats: dict[str, _Rendered] = {}  # by content type: two at most
        self.before_render: Callable[[], Awaitable[None]] | None = None
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

    def render(self, accept: str = "") -> bytes:
        encoder, _ = choose_encoder(accept)
        if self.multiprocess_dir is not None:
            prune_dead_workers(self.multiprocess_dir)
        return encoder(self._registry)

    async def latest(self, accept: str = "") -> tuple[bytes, str]:
        """The scrape's body and its content type."""
        _, content_type = choose_encoder(accept)
        rendered = self._formats.get(content_type)
        if rendered is None:
            if len(self._formats) >= MAX_FORMATS:  # `Accept` is the client's: stay bounded
                accept = ""
                _, content_type = choose_encoder(accept)
            rendered = self._formats.setdefault(content_type, _Rendered())
        if time.monotonic() - rendered.at < self.max_age_s:
            return rendered.data, content_type
        if rendered.rendering is None:
            rendered.rendering = asyncio.ensure_future(self._render(rendered, accept))
        # One scraper leaving cancels no render.
        return await asyncio.shield(rendered.rendering), content_type

    async def _bring_up_to_date(self) -> None:
        before = self.before_render
        if before is None:
            return
        try:
            await before()
        except Exception:  # a scrape is served with what is recorded
            log.exception("could not bring the live streams up to date before a scrape")

    async def _render(self, rendered: _Rendered, accept: str) -> bytes:
        try:
            started = time.monotonic()
            await self._bring_up_to_date()
            data = await asyncio.to_thread(self.render, accept)
            rendered.data, rendered.at = data, started
            return data
        finally:
            rendered.rendering = None
