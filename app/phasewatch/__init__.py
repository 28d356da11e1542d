"""phasewatch: an OpenAI-compatible proxy that times prefill (TTFT) and decode (ITL) separately."""

__version__ = "0.1.0"
