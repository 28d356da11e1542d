"""Measure an OpenAI-compatible server from the client's side: TTFT, ITL, throughput, errors.

Measuring: `client` streams one request and times it; `load` sends closed- and open-loop
batches; `prompts` builds exact-length prompts; `target` reads what the server says about
itself; `modes` holds the bench's five experiments and `runner` runs one of them end to end,
joining phasewatch's own records of the same requests (`proxy_view`). `long_prompt` sizes the
interference's long prompt from the server's budget (pure); `sim_control` is the one change the
bench makes to a server: the simulator's chunked-prefill switch.
Figures and output, all pure: `stats` (summaries), `result` (a run as rows: exported, stored
and printed alike), `render` (the report), `compare`, `plots`. `storage` keeps runs in
phasewatch's database (`phasewatch.store`); `export` writes the JSON and PNG files; `cli` is the
`bench` and `runs` commands. `article` and `workload` hold the article's two experiments for
`phasewatch demo`. Nothing here imports the proxy or the simulator: it talks HTTP, so it
measures a real vLLM the same way.
"""

from phasewatch.bench.client import RequestResult, stream_request
from phasewatch.bench.stats import StepStats, summarize

__all__ = ["RequestResult", "StepStats", "stream_request", "summarize"]
