"""Fixtures: a real simulator on loopback, served by uvicorn (uvloop + httptools) in a thread."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from phasewatch.sim import RunningSim, load_sim_settings, running_sim


@pytest.fixture(scope="module")
def sim() -> Iterator[RunningSim]:
    # Ten times faster than real: the API tests are about shapes and behaviour, not timing.
    settings = load_sim_settings(port=0, time_scale=0.1, max_model_len=8192)
    with running_sim(settings) as server:
        yield server
