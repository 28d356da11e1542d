"""Render an `SloSpec` into Prometheus rule groups: SLIs, burn rates and the alerts on them.

Pure: takes the spec, returns plain dicts and lists shaped like a Prometheus rule file's
`groups:` (the same list a PrometheusRule's `spec.groups` holds). No YAML, no files here.

What is rendered (the Google SRE workbook's multi-window, multi-burn-rate alerting):
- per SLO (TTFT, ITL), per model and per window (5m ... 3d): the events rate, the error ratio
  (the fraction of events over the threshold, `1 - bucket{le="T"} / count`) and the burn rate
  (error ratio / error budget; 1 spends the budget exactly over the SLO period);
- a burn alert per window pair: page when both 1h and 5m burn above 14.4x, or 6h and 30m above
  6x; ticket when 1d and 2h burn above 3x, or 3d and 6h above 1x. Each also needs the long
  window to hold `min_events`, so a trickle of requests cannot page anyone;
- guards: no phasewatch target up (every SLO alert is blind), an SLI whose bucket is missing;
- an alert on the diagnosis verdict, one rule per verdict so each says what it means.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from prometheus_client.utils import floatToGoString

from phasewatch.slo.spec import HISTOGRAMS, SLO_NAMES, Objective, SloName, SloSpec, Target

Rule = dict[str, Any]
Group = dict[str, Any]

WINDOWS = ("5m", "30m", "1h", "2h", "6h", "1d", "3d")
WINDOW_SECONDS = {"5m": 300, "30m": 1800, "1h": 3600, "2h": 7200, "6h": 21600, "1d": 86400,
                  "3d": 259200}
# The workbook's factors are for a 30-day budget: 14.4x spends 2% of it in an hour.
BUDGET_PERIOD_DAYS = 30


@dataclass(frozen=True, slots=True)
class BurnWindow:
    severity: str
    long: str
    short: str
    factor: float
    for_: str


BURN_WINDOWS = (
    BurnWindow("page", "1h", "5m", 14.4, "2m"),
    BurnWindow("page", "6h", "30m", 6.0, "15m"),
    BurnWindow("ticket", "1d", "2h", 3.0, "1h"),
    BurnWindow("ticket", "3d", "6h", 1.0, "3h"),
)

# The verdicts `phasewatch_diagnosis_verdict{model,verdict}` takes, and what each means for the
# operator; `healthy` and `insufficient_data` do not alert.
VERDICTS: dict[str, str] = {
    "queueing": (
        "TTFT is rising while ITL stays flat: requests wait for a scheduler slot before their "
        "prefill even starts (vllm:num_requests_waiting above 0). Add replicas or admission "
        "control; batching flags will not help."
    ),
    "prefill_bound": (
        "TTFT follows prompt length, not load: the prefill itself is the cost. Shorter "
        "prompts, prefix caching for shared prefixes, more compute (FLOPs), or a larger "
        "--max-num-batched-tokens for prefill-heavy work."
    ),
    "decode_saturation": (
        "ITL is rising with the decode batch (vllm:num_requests_running): the engine is at its "
        "throughput/latency boundary. Cap --max-num-seqs at the batch that holds the ITL "
        "objective and scale out with replicas."
    ),
    "out_of_capacity": (
        "TTFT and ITL are both rising: the deployment is simply out of capacity. Scale out."
    ),
    "interference": (
        "Streams stutter mid-answer while long prompts are prefilled: prefill steps stall the "
        "decode batch. Check chunked prefill is on; lower --max-num-batched-tokens."
    ),
    "kv_pressure": (
        "The KV cache is nearly full and the engine preempts (vllm:num_preemptions_total): "
        "sequences are evicted and recomputed. Lower --max-num-seqs or --max-model-len, or "
        "give the engine more KV memory."
    ),
    "unexplained": (
        "TTFT or ITL misses its objective (or rose where it matters) and no known cause fits "
        "the evidence: not the engine's queue, batch or KV cache. Compare with a known-good "
        "run (baseline=run:<id>), check the engine's metrics are scraped, and look in front "
        "of the engine (API server, network, proxy)."
    ),
}
QUIET_VERDICTS = ("healthy", "insufficient_data")

_SLO_TITLE: dict[SloName, str] = {"ttft": "TTFT", "itl": "ITL"}
_SLO_EVENTS: dict[SloName, str] = {"ttft": "requests", "itl": "token gaps"}
_READING: dict[SloName, str] = {
    "ttft": (
        "TTFT is the time before the first token: queueing plus prefill. If the ITL SLO is "
        "fine, decode is healthy and the time goes before the first token: queueing when TTFT "
        "follows load (vllm:num_requests_waiting above 0: add replicas or admission control), "
        "prefill when it follows prompt length (shorter prompts, prefix caching, more "
        "compute). If ITL burns too, the deployment is out of capacity: scale out."
    ),
    "itl": (
        "ITL is the decode step: one token per step for the whole batch. ITL burning means the "
        "decode batch has grown (vllm:num_requests_running): the engine is near its "
        "throughput/latency boundary; cap --max-num-seqs and scale out. Stutter only while "
        "long prompts arrive is interference (keep chunked prefill on, lower "
        "--max-num-batched-tokens); a full KV cache with preemptions is KV pressure. If TTFT "
        "burns too, the deployment is out of capacity."
    ),
}


def events_record(slo: SloName, window: str) -> str:
    return f"phasewatch:{slo}_slo_events:rate{window}"


def errors_record(slo: SloName, window: str) -> str:
    return f"phasewatch:{slo}_slo_errors:ratio_rate{window}"


def burn_record(slo: SloName, window: str) -> str:
    return f"phasewatch:{slo}_slo_burn:rate{window}"


def alert_name(slo: SloName) -> str:
    return f"Phasewatch{_SLO_TITLE[slo]}BudgetBurn"


ABSENT_ALERT = "PhasewatchMetricsAbsent"
BUCKET_MISSING_ALERT = "PhasewatchSLIBucketMissing"
DIAGNOSIS_ALERT = "PhasewatchDiagnosis"


def _string(value: str) -> str:
    """A PromQL double-quoted string literal."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _regex_literal(value: str) -> str:
    """RE2 escaping for a literal label value (every punctuation character is escapable)."""
    return re.sub(r"([\\.+*?()|\[\]{}^$-])", r"\\\1", value)


def model_matchers(spec: SloSpec, target: Target) -> list[str]:
    """Label matchers that select the models `target` covers."""
    if target.models:
        if len(target.models) == 1:
            return [f"model={_string(target.models[0])}"]
        return [f"model=~{_string('|'.join(_regex_literal(m) for m in target.models))}"]
    if spec.overridden_models:
        pattern = "|".join(_regex_literal(model) for model in spec.overridden_models)
        return [f"model!~{_string(pattern)}"]
    return []


def _selector(matchers: list[str]) -> str:
    return "{" + ", ".join(matchers) + "}" if matchers else ""


def le_value(threshold_s: float) -> str:
    """The `le` label value client_python writes for this edge (0.5 -> "0.5", 1 -> "1.0")."""
    # The very function the proxy's client library formats `le` with, so the two cannot differ.
    value: str = floatToGoString(threshold_s)  # type: ignore[no-untyped-call]
    return value


def _number(value: float) -> str:
    return f"{value:.12g}"


def _threshold(objective: Objective) -> str:
    if objective.threshold_s < 1:
        return f"{objective.threshold_s * 1000:g} ms"
    return f"{objective.threshold_s:g} s"


def describe_objective(slo: SloName, objective: Objective) -> str:
    """The objective in words: '95% of requests get their first token within 500 ms'."""
    share = f"{objective.objective * 100:.10g}%"
    if slo == "ttft":
        return f"{share} of requests get their first token within {_threshold(objective)}"
    return f"{share} of token gaps are within {_threshold(objective)}"


def _sli_rules(spec: SloSpec, slo: SloName) -> list[Rule]:
    histogram = HISTOGRAMS[slo]
    rules: list[Rule] = []
    for window in WINDOWS:
        rules.append({
            "record": events_record(slo, window),
            "expr": f"sum by (model) (rate({histogram}_count[{window}]))",
        })
        for target in spec.targets:
            objective = target.objective(slo)
            matchers = model_matchers(spec, target)
            bucket = _selector([f"le={_string(le_value(objective.threshold_s))}", *matchers])
            count = _selector(matchers)
            rules.append({
                "record": errors_record(slo, window),
                "expr": (
                    f"1 - (\n  sum by (model) (rate({histogram}_bucket{bucket}[{window}]))\n"
                    f"  /\n  sum by (model) (rate({histogram}_count{count}[{window}]))\n)\n"
                ),
            })
            rules.append({
                "record": burn_record(slo, window),
                "expr": (
                    f"{errors_record(slo, window)}{_selector(matchers)}"
                    f" / {_number(objective.budget)}"
                ),
            })
    return rules


def _burn_alerts(spec: SloSpec, slo: SloName) -> list[Rule]:
    rules: list[Rule] = []
    for target in spec.targets:
        objective = target.objective(slo)
        selector = _selector(model_matchers(spec, target))
        for burn in BURN_WINDOWS:
            factor = _number(burn.factor)
            lasts = BUDGET_PERIOD_DAYS / burn.factor
            rules.append({
                "alert": alert_name(slo),
                "expr": (
                    f"{burn_record(slo, burn.long)}{selector} > {factor}\n"
                    f"and {burn_record(slo, burn.short)}{selector} > {factor}\n"
                    f"and {events_record(slo, burn.long)}{selector}"
                    f" * {WINDOW_SECONDS[burn.long]} >= {objective.min_events}\n"
                ),
                "for": burn.for_,
                "labels": {"severity": burn.severity, "slo": slo,
                           "long_window": burn.long, "short_window": burn.short},
                "annotations": {
                    "summary": (
                        f"{{{{ $labels.model }}}}: {_SLO_TITLE[slo]} error budget burning "
                        f"{factor}x over {burn.long} and {burn.short}"
                    ),
                    "description": (
                        f"The {_SLO_TITLE[slo]} SLO of {{{{ $labels.model }}}} "
                        f"({describe_objective(slo, objective)}) is spending its error budget "
                        f"more than {factor} times as fast as it may, over both the last "
                        f"{burn.long} and the last {burn.short}: at this rate a "
                        f"{BUDGET_PERIOD_DAYS}-day budget lasts {lasts:.3g} days. "
                        f"{_READING[slo]}"
                    ),
                    "diagnosis": (
                        f"GET {spec.diagnosis_url} names the broken phase for "
                        "{{ $labels.model }} (queueing, prefill_bound, decode_saturation, "
                        "out_of_capacity, interference, kv_pressure, unexplained)."
                    ),
                },
            })
    return rules


def _guard_alerts(spec: SloSpec) -> list[Rule]:
    rules: list[Rule] = [{
        "alert": ABSENT_ALERT,
        "expr": f"absent(up{{job={_string(spec.job)}}} == 1)\n",
        "for": "5m",
        "labels": {"severity": "page"},
        "annotations": {
            "summary": f"No phasewatch target up (job {spec.job}): the SLO alerts are blind",
            "description": (
                f"Prometheus has no target of job {spec.job} that is up, so neither the TTFT "
                "nor the ITL SLO can be computed and none of their alerts can fire. Check that "
                "phasewatch is running and that Prometheus scrapes it."
            ),
        },
    }]
    for slo in SLO_NAMES:
        histogram = HISTOGRAMS[slo]
        for target in spec.targets:
            objective = target.objective(slo)
            matchers = model_matchers(spec, target)
            le = le_value(objective.threshold_s)
            bucket = _selector([f"le={_string(le)}", *matchers])
            rules.append({
                "alert": BUCKET_MISSING_ALERT,
                "expr": (
                    f"sum by (model) ({histogram}_count{_selector(matchers)})\n"
                    f"unless sum by (model) ({histogram}_bucket{bucket})\n"
                ),
                "for": "15m",
                "labels": {"severity": "ticket", "slo": slo},
                "annotations": {
                    "summary": (
                        f"{{{{ $labels.model }}}}: the {_SLO_TITLE[slo]} SLI has no "
                        f'le="{le}" bucket'
                    ),
                    "description": (
                        f"{histogram} for {{{{ $labels.model }}}} has no bucket at the SLO "
                        f"threshold ({_threshold(objective)}), so its error ratio cannot "
                        "be computed and its burn alerts cannot fire. The phasewatch serving it "
                        "predates these bucket edges or was built with others: upgrade it, or "
                        f"set PHASEWATCH_SLO_{slo.upper()}_S={objective.threshold_s:g}."
                    ),
                },
            })
    return rules


def _diagnosis_alerts(spec: SloSpec) -> list[Rule]:
    rules: list[Rule] = []
    for verdict, meaning in VERDICTS.items():
        rules.append({
            "alert": DIAGNOSIS_ALERT,
            "expr": (
                "max by (model, verdict) "
                f"(phasewatch_diagnosis_verdict{{verdict={_string(verdict)}}}) == 1\n"
                "and on (model) max by (model) (phasewatch_diagnosis_confidence)"
                f" >= {_number(spec.diagnosis_min_confidence)}\n"
            ),
            "for": spec.diagnosis_for,
            "labels": {"severity": "ticket", "verdict": verdict},
            "annotations": {
                "summary": f"{{{{ $labels.model }}}}: phasewatch diagnoses {verdict}",
                "description": meaning,
                "diagnosis": f"GET {spec.diagnosis_url} for the evidence behind the verdict.",
            },
        })
    return rules


def render_groups(spec: SloSpec) -> list[Group]:
    """The rule groups for `spec`, in a stable order."""
    groups: list[Group] = [
        {"name": f"phasewatch-slo-{slo}", "rules": _sli_rules(spec, slo)} for slo in SLO_NAMES
    ]
    groups.append({
        "name": "phasewatch-slo-alerts",
        "rules": [rule for slo in SLO_NAMES for rule in _burn_alerts(spec, slo)]
        + _guard_alerts(spec),
    })
    groups.append({"name": "phasewatch-diagnosis-alerts", "rules": _diagnosis_alerts(spec)})
    return groups


def prometheus_rule(groups: list[Group], name: str = "phasewatch-slo") -> dict[str, Any]:
    """The same groups as a Prometheus Operator `PrometheusRule` resource."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "phasewatch",
                                              "app.kubernetes.io/component": "slo"}},
        "spec": {"groups": groups},
    }
