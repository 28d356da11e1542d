"""The diagnosis evidence the simulator's traffic does not reach matches `/openapi.json` too.

tests/api/test_schema.py validates reports built from real traffic; requests still in flight
(waiting past the baseline's TTFT p99, and decoding now), TTFT judged at equal prompt length
and the engine's KV cache are rarer there. Here the pure diagnosis builds them from made-up
observations and the evidence is validated, strictly, against the `Evidence` schema of the
app's own document (built, not served: no server is needed to read it).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from phasewatch.core.live import InFlight
from phasewatch.core.settings import load_settings
from phasewatch.diagnosis.diagnose import Rules, diagnose
from phasewatch.diagnosis.observations import Observation, Sample
from phasewatch.engine.window import EngineWindow
from phasewatch.main import create_app
from tests.api.openapi_check import ApiSchema


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> ApiSchema:
    database = tmp_path_factory.mktemp("doc") / "unused.db"
    app = create_app(load_settings(upstream_url="http://127.0.0.1:9",
                                   database_url=f"sqlite+aiosqlite:///{Path(database)}"))
    return ApiSchema(app.api.openapi())


def finished(n: int, start: float, ttft: float, rng: random.Random) -> list[Observation]:
    return [Observation(started_s=start + i, ok=True, ttft_s=ttft * rng.lognormvariate(0, 0.1),
                        e2e_s=ttft + 0.4, itl_count=31, itl_p50_s=0.01 * rng.lognormvariate(0, .05),
                        itl_max_s=0.02, prompt_tokens=rng.randint(150, 250),
                        in_flight=rng.randint(0, 3)) for i in range(n)]


def in_flight(start: float, rng: random.Random) -> list[InFlight]:
    """15 streams decoding slower than the baseline's, and 10 waiting for 2 s (arrived after
    the window's finished requests: one that arrived with a finished one would be it)."""
    decoding = [InFlight("m", start + 50 + i, 1.0, 0.3, 0.01, 12, 0.02 * rng.lognormvariate(0, .05),
                         0.03, 200, 4) for i in range(15)]
    waiting = [InFlight("m", start + 70 + i, 2.0, None, 2.0, 0, None, None, None, 6)
               for i in range(10)]
    return decoding + waiting


ENGINE = EngineWindow(scrapes=12, waiting_mean=3.0, waiting_max=9.0, running_mean=20.0,
                      running_max=25.0, kv_usage_mean=0.5, kv_usage_max=0.7, preemptions=0.0,
                      ttft_count=40.0, ttft_mean_s=0.25, ttft_p50_s=0.2, ttft_p95_s=0.6,
                      queue_time_mean_s=0.2,
                      metric_names={"ttft": "vllm:time_to_first_token_seconds"})


def evidence(window_ttft: float, engine: EngineWindow | None) -> dict[str, Any]:
    rng = random.Random(7)
    baseline = Sample(finished(60, 0.0, 0.06, rng), 60.0, 60)
    window = Sample(finished(40, 1000.0, window_ttft, rng), 40.0, 40, in_flight(1000.0, rng))
    return diagnose(window, baseline, engine, Rules(slo_ttft_s=0.5, slo_itl_s=0.04)).evidence


def test_evidence_of_requests_in_flight_and_of_the_engine(api: ApiSchema) -> None:
    found = evidence(0.3, ENGINE)
    for key in ("live_queue", "itl_in_flight", "ttft_at_equal_prompt", "engine",
                "ttft_proxy_vs_engine", "stalls"):
        assert found[key] is not None, key  # the branches this test is for were taken
    assert found["checks"]["ttft_rising_live"] is True
    assert api.problems(found, api.component("Evidence")) == []


def test_evidence_without_the_engine(api: ApiSchema) -> None:
    found = evidence(0.06, None)
    assert found["engine"] is None and found["ttft_proxy_vs_engine"] is None
    assert found["checks"]["kv_pressure"] is None
    assert api.problems(found, api.component("Evidence")) == []


def test_evidence_of_a_window_judged_without_a_baseline(api: ApiSchema) -> None:
    rng = random.Random(8)
    window = Sample(finished(40, 1000.0, 0.9, rng), 40.0, 40)
    finding = diagnose(window, Sample([], 60.0, 0), ENGINE,
                       Rules(slo_ttft_s=0.5, slo_itl_s=0.04))
    assert finding.verdict.value == "queueing"  # the engine's queue names the cause
    assert finding.evidence["checks"]["baseline_free"] is True
    assert api.problems(finding.evidence, api.component("Evidence")) == []
