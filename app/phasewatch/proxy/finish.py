"""Finishing a request: its end-of-request figures into metrics and its record onto the queue.

Runs in the relay's `finally`, after the last byte went to the client. It must never raise:
a fault in metrics, records or the OpenTelemetry export is logged and swallowed, never turned
into a client error; the record is queued before anything is exported.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from phasewatch.core.log_throttle import LogThrottle
from phasewatch.core.records import Outcome, RequestRecord
from phasewatch.proxy.context import ProxyContext
from phasewatch.proxy.timing import StreamTiming, figures

if TYPE_CHECKING:
    from phasewatch.otel.export import RequestTrace

log = logging.getLogger(__name__)
# A fault that stays would recur on every request: each kind logged once a minute.
_FINISH_FAULTS, _EXPORT_FAULTS = LogThrottle(), LogThrottle()


def finish(ctx: ProxyContext, record: RequestRecord, timing: StreamTiming,
           request_trace: RequestTrace | None = None) -> None:
    try:
        label = _finish(ctx, record, timing)
    except Exception:
        _FINISH_FAULTS.exception(log, "could not finish the record of request %s",
                                 record.request_id)
        return
    if ctx.otel is not None:
        try:
            ctx.otel.finish(request_trace, record, label, timing.arrival_ns)
        except Exception:
            _EXPORT_FAULTS.exception(log, "could not export request %s to OpenTelemetry",
                                     record.request_id)


def _finish(ctx: ProxyContext, record: RequestRecord, timing: StreamTiming) -> str:
    """Observe the end-of-request metrics and queue the record; the model's label."""
    timing.settle()
    figs = figures(timing)
    status = record.http_status
    served = status is not None and 200 <= status < 300
    label = ctx.labels.label(record.model, served)
    metrics = ctx.metrics
    bound = metrics.bind(label, record.endpoint)
    outcome = record.outcome.value

    # TTFT and token gaps were observed as they happened (timing.py), whatever the ending.
    if record.outcome is Outcome.OK:
        if figs.tpot_s is not None:
            bound.observe_tpot(figs.tpot_s)
        if figs.prompt_tokens is not None:
            bound.observe_prompt_tokens(figs.prompt_tokens)
        if figs.output_tokens is not None:
            bound.observe_output_tokens(figs.output_tokens)
    ended = metrics.ended(label, record.endpoint, outcome)
    if figs.e2e_s is not None:
        ended.observe_e2e(figs.e2e_s)
    ended.count_request()

    record.ttft_s = figs.ttft_s
    record.e2e_s = figs.e2e_s
    record.tpot_s = figs.tpot_s
    record.prompt_tokens = figs.prompt_tokens
    record.output_tokens = figs.output_tokens
    record.tokens_exact = figs.tokens_exact
    (record.itl_count, record.itl_mean_s, record.itl_p50_s, record.itl_p95_s,
     record.itl_max_s) = figs.itl
    ctx.records.offer(record)
    return label
