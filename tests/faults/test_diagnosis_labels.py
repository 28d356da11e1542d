"""The diagnosis' gauges stay bounded: only names the upstream served get a `model` label, at
most `max_model_labels` at once, and a model that went quiet loses its series.

Seen before: `phasewatch_diagnosis_verdict` gained labels every round without limit, names the
upstream had answered 404 among them, and never dropped one.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import httpx

from phasewatch.store.models import RequestRow
from tests.conftest import Proxy
from tests.diagnosis.test_api import insert, rows, wait_for

WINDOW_S, BASELINE_S = 60, 600
FADES_IN_S = 8.0  # the fading model's requests leave the judged span this long after insertion


def rejected(model: str, start: datetime, n: int) -> list[RequestRow]:
    """Requests the upstream answered 404 (an unknown model)."""
    out = rows(model, start, 30, n, seed=9)
    for row in out:
        row.outcome, row.http_status, row.ttft_s, row.e2e_s = "http_error", 404, None, 0.002
        row.itl_count, row.itl_mean_s, row.itl_p50_s, row.itl_p95_s = 0, None, None, None
        row.itl_max_s, row.tpot_s, row.output_tokens = None, None, None
    return out


def exported(proxy: Proxy) -> set[str]:
    """Models with verdict series in the scrape."""
    families = httpx.get(proxy.url + "/metrics").text.splitlines()
    return {line.split('model="', 1)[1].split('"', 1)[0] for line in families
            if line.startswith("phasewatch_diagnosis_verdict{")}


def test_verdict_labels_are_bounded_served_and_dropped_when_quiet(
    make_proxy: Callable[..., Proxy], scripted_url: str, sqlite_url: str
) -> None:
    proxy = make_proxy(scripted_url, diagnosis_interval_s=0.2, diagnosis_window_s=WINDOW_S,
                       diagnosis_baseline_s=BASELINE_S, max_model_labels=2,
                       engine_metrics_enabled=False)
    now = datetime.now(UTC)
    fading_at = now - timedelta(seconds=WINDOW_S + BASELINE_S - FADES_IN_S)
    insert(sqlite_url, [
        *rejected("no-such-model", now - timedelta(seconds=30), 200),  # the busiest name
        *rows("fading", fading_at, 1, 50, seed=1),
        *rows("a", now - timedelta(seconds=40), 30, 30, seed=2),
        *rows("b", now - timedelta(seconds=40), 30, 20, seed=3),
    ])
    seen: list[set[str]] = []

    def exports(models: set[str]) -> bool:
        seen.append(exported(proxy))
        return seen[-1] == models

    # The two busiest served models; "b" waits for a free label, the 404'd name never gets one.
    wait_for(lambda: exports({"fading", "a"}))
    # "fading" has no request left in window + baseline: its series go, "b" takes its place.
    wait_for(lambda: exports({"a", "b"}), timeout=FADES_IN_S + 15)
    assert all(len(models) <= 2 and "no-such-model" not in models for models in seen), seen
    assert proxy.registry.get_sample_value(
        "phasewatch_diagnosis_confidence", {"model": "fading"}) is None
