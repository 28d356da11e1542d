"""The live SLO-headroom signal: every `capacity_interval_s`, for each active model, the
highest request rate its calibrated deployment serves within both SLOs, against the rate it
is serving now.

`phasewatch_slo_max_rate_rps{model}` is that highest rate for one engine replica;
`phasewatch_slo_headroom{model}` is it times `capacity_engine_replicas`, divided by the model's
arrival rate over the last `capacity_rate_window_s`, requests still in flight included (below
1: today's traffic breaks an SLO). An
autoscaler of the engine scales on the rate over the per-replica maximum
(deploy/k8s/keda-headroom.yaml).

Invariants: it runs in the leading process only (a duty, store/leader.py); the calibration and
the search run in one worker process of their own (`headroom.compute`, spawned), never on the
relay's event loop or under its GIL; a model that cannot be calibrated, or that served nothing
in the rate's window, has no series; any fault is logged and counted and the next round goes
on. Under several workers the gauges are `liveall`: read them as `max by (model)`; a process
that stops leading sets its series to NaN, which that ignores.
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import logging
import math
import multiprocessing
import os
import signal
import sys
from concurrent.futures import ProcessPoolExecutor
from datetime import UTC, datetime, timedelta

from prometheus_client import CollectorRegistry, Counter, Gauge
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from phasewatch.core.settings import Settings
from phasewatch.plan.headroom import compute
from phasewatch.store.diagnoses import active_models
from phasewatch.store.live_snapshots import read_fresh
from phasewatch.store.plan_inputs import request_count, timed_requests

log = logging.getLogger(__name__)


class CapacityMetrics:
    def __init__(self, registry: CollectorRegistry, multiprocess: bool = False) -> None:
        self.multiprocess = multiprocess
        self.max_rate = Gauge(
            "phasewatch_slo_max_rate_rps",
            "The highest request rate one engine replica serves within both SLOs, as "
            "calibrated on its traffic.",
            ("model",), registry=registry, multiprocess_mode="liveall")
        self.headroom = Gauge(
            "phasewatch_slo_headroom",
            "The engine replicas' highest rate within both SLOs over the current request rate "
            "(below 1: an SLO breaks at today's traffic).", ("model",), registry=registry,
            multiprocess_mode="liveall")
        self.failures = Counter(
            "phasewatch_slo_headroom_failures",
            "Headroom evaluations that failed (database, calibration worker).",
            registry=registry)
        self._models: set[str] = set()

    @property
    def models(self) -> frozenset[str]:
        """The models with series set."""
        return frozenset(self._models)

    def set(self, model: str, max_rate: float, headroom: float) -> None:
        self.max_rate.labels(model).set(max_rate)
        self.headroom.labels(model).set(headroom)
        self._models.add(model)

    def remove(self, model: str) -> None:
        if model not in self._models:
            return
        self._models.discard(model)
        if self.multiprocess:
            self.max_rate.labels(model).set(math.nan)
            self.headroom.labels(model).set(math.nan)
        else:
            self.max_rate.remove(model)
            self.headroom.remove(model)

    def withdraw(self) -> None:
        for model in list(self._models):
            self.remove(model)


def follow_parent(parent: int) -> None:
    """(the worker's initializer) End with `parent`, however it ends: a worker left behind by
    a killed process would wait for work forever. Linux only (PR_SET_PDEATHSIG); elsewhere the
    pool's own shutdown ends it."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
        return
    if os.getppid() != parent:  # it ended before the prctl took
        os._exit(0)


_PR_SET_PDEATHSIG = 1


def _end_workers(pool: ProcessPoolExecutor) -> None:
    """Shut the pool down without waiting for a round in progress (tens of seconds): its
    worker is terminated, so shutdown stays bounded."""
    terminate = getattr(pool, "terminate_workers", None)  # Python 3.14
    if terminate is not None:
        terminate()
        return
    processes = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        process.terminate()


class CapacityService:
    """The duty. Calibrating a model takes tens of seconds of the worker, the rate it is
    divided by one query: every round reads the rate, and the headroom is the latest highest
    rate (`_top`) over it, while the next calibration of the model runs in the background
    (one at a time per model, `_calibrating`). A ramp of traffic shows at the next round."""

    def __init__(self, sessionmaker: async_sessionmaker[AsyncSession], settings: Settings,
                 metrics: CapacityMetrics) -> None:
        self.sessionmaker = sessionmaker
        self.settings = settings
        self.metrics = metrics
        self._top: dict[str, float | None] = {}  # model -> its latest calibration's answer
        self._calibrating: dict[str, asyncio.Future[float | None]] = {}

    async def run(self) -> None:
        """The duty: a round every `capacity_interval_s` until cancelled; the worker process
        lives as long as the duty runs, and no longer than this process."""
        pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=follow_parent, initargs=(os.getpid(),))
        try:
            while True:
                await asyncio.sleep(self.settings.capacity_interval_s)  # data first
                try:
                    await self.evaluate_all(pool)
                except Exception as exc:
                    log.warning("headroom round failed (%s: %s)", type(exc).__name__,
                                str(exc)[:200])
                    self.metrics.failures.inc()
        finally:
            self.metrics.withdraw()
            for pending in self._calibrating.values():
                pending.cancel()
            _end_workers(pool)

    async def evaluate_all(self, pool: ProcessPoolExecutor) -> dict[str, float]:
        """One round; returns model -> headroom for the models that have one."""
        s = self.settings
        now = datetime.now(UTC)
        since = now - timedelta(seconds=s.capacity_window_s)
        recent = now - timedelta(seconds=s.capacity_rate_window_s)
        async with self.sessionmaker() as session:
            models = await active_models(session, since, now, s.max_model_labels)
            fresh = await read_fresh(
                session, now - timedelta(seconds=s.diagnosis_live_max_age_s), datetime.now(UTC))
        # Arrivals still in flight count: under overload the stored (ended) requests show the
        # engine's throughput, not the rate offered to it.
        waiting = collections.Counter(item.model for snapshot in fresh for item in snapshot.requests
                          if item.started_s >= recent.timestamp())
        out: dict[str, float] = {}
        for model in models:
            await self._calibrate(pool, model, since)
            async with self.sessionmaker() as session:
                offered = await request_count(session, model=model, since=recent, until=now)
            rate = (offered + waiting[model]) / s.capacity_rate_window_s
            top = self._top.get(model)
            if top is None or rate <= 0:
                self.metrics.remove(model)
                continue
            out[model] = top * s.capacity_engine_replicas / rate
            self.metrics.set(model, top, out[model])
        for model in set(self._top) - set(models):  # no longer active
            self._top.pop(model, None)
            pending = self._calibrating.pop(model, None)
            if pending is not None:
                pending.cancel()
        for model in self.metrics.models - set(out):
            self.metrics.remove(model)
        return out

    async def _calibrate(self, pool: ProcessPoolExecutor, model: str, since: datetime) -> None:
        """Take the model's finished calibration, if any (its fault is raised here, once), and
        start the next one on what is stored now; none while one runs. The first round of a
        model waits for its first calibration, so that a headroom comes with it."""
        pending = self._calibrating.get(model)
        if pending is not None:
            if not pending.done():
                return
            del self._calibrating[model]
            self._top[model] = pending.result()
        s = self.settings
        async with self.sessionmaker() as session:
            rows = await timed_requests(session, model=model, since=since,
                                        limit=s.capacity_max_requests)
        task = asyncio.get_running_loop().run_in_executor(
            pool, compute, rows, s.capacity_max_num_seqs, s.capacity_max_num_batched_tokens,
            s.slo_ttft_s, s.slo_itl_s, s.capacity_objective)
        if model not in self._top:
            self._top[model] = await task
        else:
            self._calibrating[model] = task
