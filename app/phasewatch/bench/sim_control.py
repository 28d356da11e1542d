"""The one change the bench makes to a server: phasewatch's simulator's chunked-prefill switch.

`bench interference --chunked-prefill on|off|both` measures the same long prompt against the
same short stream with chunked prefill on and off. A real vLLM reads the flag once, at start;
the simulator takes `POST /sim/config {"enable_chunked_prefill": ...}` on its own base URL (the
upstream, when the bench goes through phasewatch) and plans its next step with the budget that
setting resolves to. The bench puts the setting back as it found it when the run ends. Nothing
here is called against any other server.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson

from phasewatch.bench.errors import WorkloadError
from phasewatch.bench.target import Target

CHOICES = ("as-is", "on", "off", "both")
# The settings each choice measures, in order; None: as the server runs, unchanged.
VARIANTS: dict[str, tuple[bool | None, ...]] = {
    "as-is": (None,), "on": (True,), "off": (False,), "both": (True, False),
}


def require_simulator(target: Target, choice: str) -> None:
    """Refuse a switch the target cannot make, saying what to do instead."""
    if choice != "as-is" and target.sim is None:
        raise WorkloadError(
            f"--chunked-prefill {choice} switches phasewatch's simulator, and {target.engine_url} "
            "is not one (its /version has no phasewatch_sim). vLLM reads chunked prefill once, "
            "at start: restart it with --enable-chunked-prefill or --no-enable-chunked-prefill, "
            "run `phasewatch bench interference` once per setting, and `phasewatch runs compare` "
            "the two runs")


async def set_chunked_prefill(
    session: aiohttp.ClientSession, target: Target, enabled: bool
) -> dict[str, Any]:
    """Switch the simulator's chunked prefill; its configuration summary after the switch."""
    url = target.engine_url + "/sim/config"
    try:
        async with session.post(url, data=orjson.dumps({"enable_chunked_prefill": enabled}),
                                headers={"content-type": "application/json"}) as response:
            body = await response.read()
            status = response.status
    except aiohttp.ClientError as exc:
        raise WorkloadError(f"{url} failed: {type(exc).__name__}: {exc}") from None
    if status != 200:
        raise WorkloadError(f"{url} answered {status} to the chunked-prefill switch: "
                            f"{body[:300].decode(errors='replace')} (a simulator older than "
                            "this bench has no switch: upgrade it, or use --chunked-prefill "
                            "as-is)")
    config: dict[str, Any] = orjson.loads(body)["config"]
    return config
