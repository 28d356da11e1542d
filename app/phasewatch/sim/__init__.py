"""A vLLM-faithful engine simulator: vLLM's OpenAI API and metrics over a roofline model.

Public entry points: `create_sim_app(settings)`, `run_sim(settings)`, `running_sim(settings)`,
`SimSettings` / `load_sim_settings(**overrides)`, and `cli.add_parser` for `phasewatch sim`.
See docs/simulator.md.
"""

from phasewatch.sim.app import create_sim_app
from phasewatch.sim.config import SimConfigError, SimSettings, load_sim_settings
from phasewatch.sim.server import RunningSim, run_sim, running_sim

__all__ = [
    "RunningSim",
    "SimConfigError",
    "SimSettings",
    "create_sim_app",
    "load_sim_settings",
    "run_sim",
    "running_sim",
]
