"""The OpenTelemetry GenAI semantic conventions phasewatch follows: names, units, buckets.

Pinned to semantic conventions v1.41.0 (docs/gen-ai/gen-ai-metrics.md and gen-ai-spans.md,
the last release that kept GenAI in the main repository), whose attributes use
`gen_ai.provider.name` (v1.37.0 and later, not the older `gen_ai.system`). The conventions are
in development: another version would rename things, so the version phasewatch emits only
changes with a phasewatch release that says so. Pure data and arithmetic: no OpenTelemetry
import, so the rest of phasewatch can read it without the `otel` extra.
"""

from __future__ import annotations

from dataclasses import dataclass

from phasewatch.core.metrics import with_edges
from phasewatch.core.records import Outcome

SEMCONV_VERSION = "1.41.0"
SCHEMA_URL = f"https://opentelemetry.io/schemas/{SEMCONV_VERSION}"

# The convention's recommended bucket boundaries (ExplicitBucketBoundaries), v1.41.0.
DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48,
                    40.96, 81.92)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0)
TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304,
                 16777216, 67108864)

# gen_ai.operation.name by the relayed endpoint (the convention's well-known values).
OPERATIONS = {"chat.completions": "chat", "completions": "text_completion"}


@dataclass(frozen=True, slots=True)
class Instrument:
    name: str
    unit: str
    description: str
    buckets: tuple[float, ...]


def instruments(slo_ttft_s: float, slo_itl_s: float) -> dict[str, Instrument]:
    """The four histograms, by phasewatch's name for each; the SLO thresholds are added to the
    recommended boundaries as exact edges, as in the Prometheus histograms."""
    return {
        "ttft": Instrument(
            "gen_ai.server.time_to_first_token", "s",
            "Time to generate first token for successful responses.",
            with_edges(TTFT_BUCKETS, slo_ttft_s)),
        "tpot": Instrument(
            "gen_ai.server.time_per_output_token", "s",
            "Time per output token generated after the first token for successful responses.",
            with_edges(TPOT_BUCKETS, slo_itl_s)),
        "duration": Instrument(
            "gen_ai.server.request.duration", "s",
            "Generative AI server request duration such as time-to-last byte or last output "
            "token.", DURATION_BUCKETS),
        "tokens": Instrument(
            "gen_ai.client.token.usage", "{token}",
            "Number of input and output tokens used.", tuple(float(b) for b in TOKEN_BUCKETS)),
    }


def error_type(outcome: Outcome, http_status: int | None) -> str | None:
    """`error.type` of a request that ended in an error (None for success): the upstream's
    status code for an HTTP error, as the convention's examples do, else phasewatch's outcome
    (`timeout`, `stream_error`, `cancelled`, ...; README, "Outcomes")."""
    if outcome is Outcome.OK:
        return None
    if outcome is Outcome.HTTP_ERROR and http_status is not None:
        return str(http_status)
    return outcome.value
