"""What the bench is pointed at: the served model, and what the server says about itself.

Read once before a run and stored with it:
- `GET /v1/models`: the model (the one asked for, else the first) and its `max_model_len`;
- `GET /api/health`: answered only by phasewatch (its version and its upstream), which makes
  the bench tag requests for the proxy's own records and read them back;
- `GET /version`: vLLM's version; phasewatch's simulator adds its configuration (GPU, model,
  scheduler limits, chunked prefill, time-scale), and phasewatch relays it from its upstream;
- `GET /metrics` of the engine: the labels of `vllm:cache_config_info` (block size, KV cache
  blocks, dtype, ...). Through phasewatch, `/metrics` is the proxy's own, so the engine's is read
  from the upstream phasewatch names, or from `engine_url`.

Everything here is best effort and a missing answer is left out, except the model list.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from phasewatch.bench.errors import WorkloadError

_INFO_LINE = re.compile(r"^vllm:cache_config_info\{(?P<labels>.*)\}\s+\S+\s*$", re.MULTILINE)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
_SHORT = aiohttp.ClientTimeout(total=5)


@dataclass(frozen=True, slots=True)
class Target:
    url: str
    model: str
    max_model_len: int | None
    phasewatch: dict[str, Any] | None  # /api/health, when the target is a phasewatch proxy
    engine: dict[str, Any] = field(default_factory=dict)

    @property
    def sim(self) -> dict[str, Any] | None:
        sim = self.engine.get("sim")
        return sim if isinstance(sim, dict) else None

    @property
    def time_scale(self) -> float:
        """Wall seconds per model second: the simulator's `--time-scale`, else 1."""
        scale = (self.sim or {}).get("time_scale", 1.0)
        return float(scale) if isinstance(scale, int | float) and scale > 0 else 1.0


async def _get_json(session: aiohttp.ClientSession, url: str) -> Any:
    try:
        async with session.get(url, timeout=_SHORT) as response:
            if response.status != 200:
                return None
            return await response.json(loads=orjson.loads, content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None


async def _get_text(session: aiohttp.ClientSession, url: str) -> str | None:
    try:
        async with session.get(url, timeout=_SHORT) as response:
            return await response.text() if response.status == 200 else None
    except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
        return None


def cache_config(metrics_text: str) -> dict[str, str] | None:
    """The labels of `vllm:cache_config_info` in a Prometheus text exposition, if present."""
    match = _INFO_LINE.search(metrics_text)
    if match is None:
        return None
    return {key: value.replace('\\"', '"').replace("\\\\", "\\")
            for key, value in _LABEL.findall(match.group("labels"))}


async def discover(
    session: aiohttp.ClientSession, url: str, model: str | None = None,
    engine_url: str | None = None,
) -> Target:
    models = await _get_json(session, url + "/v1/models")
    if not isinstance(models, dict) or not models.get("data"):
        raise WorkloadError(f"{url}/v1/models did not list any model")
    entries = [m for m in models["data"] if isinstance(m, dict)]
    chosen = next((m for m in entries if m.get("id") == model), None) if model else entries[0]
    if chosen is None:
        names = ", ".join(str(m.get("id")) for m in entries)
        raise WorkloadError(f"{url} does not serve model {model!r} (it serves {names})")
    max_len = chosen.get("max_model_len")
    health = await _get_json(session, url + "/api/health")
    phasewatch = health if isinstance(health, dict) and "upstream" in health else None
    engine: dict[str, Any] = {}
    if isinstance(max_len, int):
        engine["max_model_len"] = max_len
    if isinstance(chosen.get("root"), str):
        engine["root"] = chosen["root"]
    version = await _get_json(session, url + "/version")
    if isinstance(version, dict):
        if isinstance(version.get("version"), str):
            engine["version"] = version["version"]
        if isinstance(version.get("phasewatch_sim"), dict):
            engine["sim"] = version["phasewatch_sim"]
    metrics_base = engine_url or (phasewatch or {}).get("upstream") or url
    if phasewatch is None or metrics_base != url:
        text = await _get_text(session, str(metrics_base).rstrip("/") + "/metrics")
        found = cache_config(text) if text else None
        if found:
            engine["cache_config"] = found
    return Target(url, str(chosen["id"]), max_len if isinstance(max_len, int) else None,
                  phasewatch, engine)
