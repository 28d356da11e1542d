"""What the bench is pointed at: the served model, and what the server says about itself.

Read once before a run and stored with it:
- `GET /v1/models`: the model (the one asked for, else the first) and its `max_model_len`;
- `GET /api/health`: answered only by phasewatch (its version and its upstream), which makes
  the bench tag requests for the proxy's own records and read them back;
- `GET /version`: vLLM's version; phasewatch's simulator adds its configuration (GPU, model,
  scheduler limits, chunked prefill, time-scale), and phasewatch relays it from its upstream;
- `GET /metrics` of the engine: the labels of `vllm:cache_config_info` (block size, KV cache
  blocks, dtype, ...). Through phasewatch, `/metrics` is the proxy's own, so the engine's is read
  from the upstream phasewatch names, or from `engine_url`;
- `GET /server_info?config_format=json` of the engine, when it is not the simulator: vLLM serves
  it only with `VLLM_SERVER_DEV_MODE=1`, and it holds the scheduler's `max_num_batched_tokens`
  and chunked-prefill setting (the simulator reports both in `/version`).

Everything here is best effort and a missing answer is left out, except the model list: when
that fails, `WorkloadError` says what happened (nothing listening, a status, not JSON, no
model) and what to try.
"""

from __future__ import annotations

import re
import socket
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
    engine_url: str = ""  # the engine's own base URL (the upstream, through phasewatch)

    @property
    def sim(self) -> dict[str, Any] | None:
        sim = self.engine.get("sim")
        return sim if isinstance(sim, dict) else None

    @property
    def scheduler(self) -> dict[str, Any]:
        """`max_num_batched_tokens` and `enable_chunked_prefill` as the engine runs now, from
        the simulator's `/version` or vLLM's `/server_info`; empty when neither said."""
        found = self.sim or self.engine.get("scheduler")
        return found if isinstance(found, dict) else {}

    @property
    def batched_tokens(self) -> int | None:
        value = self.scheduler.get("max_num_batched_tokens")
        return value if isinstance(value, int) and value > 0 else None

    @property
    def chunked_prefill(self) -> bool | None:
        value = self.scheduler.get("enable_chunked_prefill")
        return value if isinstance(value, bool) else None

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


def scheduler_config(server_info: Any) -> dict[str, Any] | None:
    """The scheduler's budget and chunked-prefill flag from vLLM's `/server_info` JSON."""
    config = server_info.get("vllm_config") if isinstance(server_info, dict) else None
    found = config.get("scheduler_config") if isinstance(config, dict) else None
    if not isinstance(found, dict) or not isinstance(found.get("max_num_batched_tokens"), int):
        return None
    chunked = found.get("enable_chunked_prefill", found.get("chunked_prefill_enabled"))
    return {"max_num_batched_tokens": found["max_num_batched_tokens"],
            "enable_chunked_prefill": chunked if isinstance(chunked, bool) else None,
            "from": "/server_info"}


def _unreachable(url: str, exc: aiohttp.ClientError | OSError) -> str:
    """What a failed connection means, and what to try."""
    cause = getattr(exc, "os_error", None) or exc
    try_this = ("Start a server there (`phasewatch up` serves phasewatch on :8080 in front of "
                "its simulator; vLLM listens on :8000 by default) or point --url at yours.")
    if isinstance(cause, ConnectionRefusedError):
        return f"connection refused at {url}: nothing is listening there. {try_this}"
    if isinstance(cause, socket.gaierror):
        return f"cannot resolve the host of {url} ({cause.strerror}). {try_this}"
    return f"cannot connect to {url} ({type(exc).__name__}: {exc}). {try_this}"


async def _model_list(session: aiohttp.ClientSession, url: str) -> list[dict[str, Any]]:
    """`/v1/models`'s entries, or WorkloadError saying what went wrong and what to try."""
    where = url + "/v1/models"
    try:
        async with session.get(where, timeout=_SHORT) as response:
            text = await response.text(errors="replace")
            status = response.status
    except (aiohttp.ClientConnectorError, aiohttp.ClientOSError) as exc:
        raise WorkloadError(_unreachable(url, exc)) from None
    except TimeoutError:
        raise WorkloadError(f"{where} did not answer within {_SHORT.total:g} s: is the server "
                            "still starting, or overloaded?") from None
    except aiohttp.ClientError as exc:
        raise WorkloadError(f"{where} failed: {type(exc).__name__}: {exc}") from None
    if status != 200:
        hint = {401: " (the server wants an API key, which the bench does not send)",
                404: ": --url is the server's base URL, without /v1, and it must serve the "
                     "OpenAI API (vLLM, phasewatch, the simulator)"}.get(status, "")
        raise WorkloadError(f"{where} answered HTTP {status}{hint}: {text[:200].strip()}")
    try:
        body = orjson.loads(text)
    except orjson.JSONDecodeError:
        raise WorkloadError(f"{where} did not answer JSON ({text[:80].strip()!r}...): is {url} "
                            "an OpenAI-compatible server?") from None
    entries = body.get("data") if isinstance(body, dict) else None
    if not isinstance(entries, list) or not any(isinstance(m, dict) for m in entries):
        raise WorkloadError(f"{where} lists no model: the server answers but serves nothing yet")
    return [m for m in entries if isinstance(m, dict)]


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
    entries = await _model_list(session, url)
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
    base = str(engine_url or (phasewatch or {}).get("upstream") or url).rstrip("/")
    if phasewatch is None or base != url:
        text = await _get_text(session, base + "/metrics")
        found = cache_config(text) if text else None
        if found:
            engine["cache_config"] = found
        if "sim" not in engine:
            info = await _get_json(session, base + "/server_info?config_format=json")
            scheduler = scheduler_config(info)
            if scheduler:
                engine["scheduler"] = scheduler
    return Target(url, str(chosen["id"]), max_len if isinstance(max_len, int) else None,
                  phasewatch, engine, base)
