"""Measure an OpenAI-compatible server from the client's side: TTFT, ITL, throughput, errors.

`client` streams one request and times it; `stats` turns results into summaries (pure);
`workload` builds exact-length prompts and sends bursts; `proxy_view` reads phasewatch's own
stored view of the same requests; `article` holds the article's two experiments and renders
them. `phasewatch demo` is a thin shell over this package. It imports nothing from the proxy or
the simulator: it talks HTTP, so it measures a real vLLM the same way.
"""

from app.bench.client import RequestResult, stream_request
from app.bench.stats import StepStats, summarize

__all__ = ["RequestResult", "StepStats", "stream_request", "summarize"]
