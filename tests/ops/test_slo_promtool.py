"""The rendered SLO rules under the real promtool: they load, and alerts fire when they should.

`promtool test rules` replays synthetic series through the rules at a 1-minute step. Each
scenario starts with a day of healthy history so the long windows (1d, 3d) hold real data,
then changes one thing. Traffic levels, thresholds and budgets come from deploy/slo.yaml, so the
scenarios follow the committed SLOs: healthy traffic spends budget at 0.4x, a burn at 16x
(every time below is a proportion of the windows, independent of the objective).
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from phasewatch.slo.files import dump_yaml, load_spec
from phasewatch.slo.rules import (
    ABSENT_ALERT,
    BUCKET_MISSING_ALERT,
    DIAGNOSIS_ALERT,
    alert_name,
    le_value,
    render_groups,
)
from phasewatch.slo.spec import HISTOGRAMS, SLO_NAMES, SloName, SloSpec, parse_spec
from tests.ops.conftest import DEPLOY, SLO_FILE

RULES = DEPLOY / "rules" / "phasewatch-slo.rules.yml"
DAY = 1440  # minutes
EVENTS_PER_MIN: dict[SloName, float] = {"ttft": 50, "itl": 1000}  # requests; token gaps
HEALTHY_BURN, FAST_BURN = 0.4, 16.0
MODEL = "Qwen/Qwen2.5-0.5B-Instruct"  # a label value with regex metacharacters in it


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)


def test_promtool_check_rules(promtool: str) -> None:
    result = _run([promtool, "check", "rules", str(RULES)])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_promtool_check_config(promtool: str) -> None:
    result = _run([promtool, "check", "config", str(DEPLOY / "prometheus.yml")])
    assert result.returncode == 0, result.stdout + result.stderr
    # The config's rule_files glob must reach the rendered rules, not an empty directory.
    assert re.search(r"SUCCESS: [1-9][0-9]* rules found", result.stdout), result.stdout


# -- building promtool's input -------------------------------------------------------------

def cumulative(*segments: tuple[float, int]) -> str:
    """promtool series notation for a counter that grows `per_min` for `minutes`, then the next
    segment's rate, sampled every minute from t=0: one value per minute, no gap, no repeat."""
    parts, value, first = [], 0.0, True
    for per_min, minutes in segments:
        start = value if first else value + per_min
        steps = minutes if first else minutes - 1
        parts.append(f"{start:g}+{per_min:g}x{steps}")
        value = start + per_min * steps
        first = False
    return " ".join(parts)


def histogram_series(spec: SloSpec, slo: SloName, model: str,
                     phases: list[tuple[float, int]]) -> list[dict[str, str]]:
    """The SLI's bucket and count series for `model`: phases of (burn rate, minutes)."""
    rate = EVENTS_PER_MIN[slo]
    budget = spec.default.objective(slo).budget
    name = HISTOGRAMS[slo]
    labels = f'model="{model}", endpoint="chat.completions", job="phasewatch", instance="pw:8080"'
    le = le_value(spec.default.objective(slo).threshold_s)
    good = [(rate * (1 - min(1.0, burn * budget)), minutes) for burn, minutes in phases]
    total = [(rate, minutes) for _, minutes in phases]
    return [
        {"series": f'{name}_bucket{{{labels}, le="{le}"}}', "values": cumulative(*good)},
        {"series": f'{name}_count{{{labels}}}', "values": cumulative(*total)},
    ]


def up(minutes: int, value: int = 1, job: str = "phasewatch") -> dict[str, str]:
    return {"series": f'up{{job="{job}", instance="pw:8080"}}', "values": f"{value}x{minutes}"}


def _expand(template: str, labels: dict[str, str]) -> str:
    text = re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels[m.group(1)], template)
    assert "{{" not in text, f"annotation uses a template the test cannot expand: {template}"
    return text


class Alerts:
    """The rendered alerting rules, to say what promtool must see firing."""

    def __init__(self, spec: SloSpec) -> None:
        self.rules = [rule for group in render_groups(spec) for rule in group["rules"]
                      if "alert" in rule]

    def expect(self, name: str, model: str, **match: str) -> list[dict[str, Any]]:
        found = []
        for rule in self.rules:
            if rule["alert"] == name and all(rule["labels"].get(k) == v for k, v in match.items()):
                labels = {**rule["labels"], "model": model}
                found.append({"exp_labels": labels,
                              "exp_annotations": {k: _expand(v, labels)
                                                  for k, v in rule["annotations"].items()}})
        assert found, f"no rule {name} with {match}"
        return found

    def burn(self, slo: SloName, model: str, *long_windows: str) -> list[dict[str, Any]]:
        return [alert for window in long_windows
                for alert in self.expect(alert_name(slo), model, long_window=window)]


def silent(names: list[str], *eval_minutes: int) -> list[dict[str, Any]]:
    return [{"eval_time": f"{t}m", "alertname": name, "exp_alerts": []}
            for t in eval_minutes for name in names]


def burn_scenario(spec: SloSpec, alerts: Alerts, slo: SloName) -> dict[str, Any]:
    """A day healthy, then `slo` burns at 16x for 8 hours while the other SLO stays healthy."""
    other: SloName = "itl" if slo == "ttft" else "ttft"
    burning = [(HEALTHY_BURN, DAY), (FAST_BURN, 480)]
    start = DAY
    return {
        "name": f"{slo} burning at 16x after a healthy day",
        "interval": "1m",
        "input_series": [
            *histogram_series(spec, slo, MODEL, burning),
            *histogram_series(spec, other, MODEL, [(HEALTHY_BURN, DAY + 480)]),
            up(DAY + 480),
        ],
        "alert_rule_test": [
            # Half an hour in: the 1h window is below 14.4x, nothing fires yet.
            *silent([alert_name(slo), alert_name(other)], start + 30),
            # 75 minutes in: the 1h/5m page (true from ~54 min, for 2m) and nothing slower.
            {"eval_time": f"{start + 75}m", "alertname": alert_name(slo),
             "exp_alerts": alerts.burn(slo, MODEL, "1h")},
            # 8 hours in: every pair fires (6h/30m from ~2h24, 1d/2h ~5h, 3d/6h ~4h).
            {"eval_time": f"{start + 480}m", "alertname": alert_name(slo),
             "exp_alerts": alerts.burn(slo, MODEL, "1h", "6h", "1d", "3d")},
            # The healthy SLO stays quiet throughout.
            *silent([alert_name(other)], start + 75, start + 480),
        ],
    }


def low_traffic_scenario(spec: SloSpec, burn_alerts: list[str],
                         expect: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A model with too few events for any window to hold min_events, every one of them over
    the threshold. 70 minutes in, the long windows hold ~58% of min_events."""
    low_rate = {slo: max(spec.default.objective(slo).min_events, 1) / 120 for slo in SLO_NAMES}
    return {
        "name": "a trickle of traffic, all of it slow",
        "interval": "1m",
        "input_series": [
            *[s for slo in SLO_NAMES for s in (
                {"series": f'{HISTOGRAMS[slo]}_bucket{{model="rare", job="phasewatch", '
                           f'le="{le_value(spec.default.objective(slo).threshold_s)}"}}',
                 "values": "0x80"},
                {"series": f'{HISTOGRAMS[slo]}_count{{model="rare", job="phasewatch"}}',
                 "values": cumulative((low_rate[slo], 80))},
            )],
            up(80),
        ],
        "alert_rule_test": expect if expect is not None else silent(burn_alerts, 20, 70),
    }


def scenarios(spec: SloSpec) -> list[dict[str, Any]]:
    alerts = Alerts(spec)
    burn_alerts = [alert_name(slo) for slo in SLO_NAMES]
    healthy_minutes = DAY + 480
    healthy = {
        "name": "healthy traffic for 32 hours: no alert of any kind",
        "interval": "1m",
        "input_series": [
            *[s for slo in SLO_NAMES
              for s in histogram_series(spec, slo, MODEL, [(HEALTHY_BURN, healthy_minutes)])],
            up(healthy_minutes),
            {"series": f'phasewatch_diagnosis_verdict{{model="{MODEL}", verdict="healthy"}}',
             "values": f"1x{healthy_minutes}"},
            {"series": f'phasewatch_diagnosis_confidence{{model="{MODEL}"}}',
             "values": f"0.9x{healthy_minutes}"},
        ],
        "alert_rule_test": silent(
            [*burn_alerts, ABSENT_ALERT, BUCKET_MISSING_ALERT, DIAGNOSIS_ALERT],
            60, 360, DAY, healthy_minutes,
        ),
    }
    low_traffic = low_traffic_scenario(spec, burn_alerts)
    absent = {
        "name": "phasewatch down, then gone: the SLO alerts are blind, which pages",
        "interval": "1m",
        "input_series": [up(30, value=0), up(30, job="vllm")],
        "alert_rule_test": [
            *silent([ABSENT_ALERT], 3),
            {"eval_time": "10m", "alertname": ABSENT_ALERT,
             "exp_alerts": [{"exp_labels": {"severity": "page"},
                             "exp_annotations": _plain(alerts, ABSENT_ALERT)}]},
        ],
    }
    ttft_edge = le_value(spec.default.ttft.threshold_s)
    missing = {
        "name": "a proxy without the SLO's bucket edge: the SLI cannot be computed",
        "interval": "1m",
        "input_series": [
            {"series": f'{HISTOGRAMS["ttft"]}_bucket{{model="old", le="+Inf"}}',
             "values": cumulative((10, 30))},
            {"series": f'{HISTOGRAMS["ttft"]}_count{{model="old"}}',
             "values": cumulative((10, 30))},
            {"series": f'{HISTOGRAMS["itl"]}_bucket{{model="old", '
                       f'le="{le_value(spec.default.itl.threshold_s)}"}}',
             "values": cumulative((10, 30))},
            {"series": f'{HISTOGRAMS["itl"]}_count{{model="old"}}', "values": cumulative((10, 30))},
        ],
        "alert_rule_test": [
            *silent([BUCKET_MISSING_ALERT], 10),
            {"eval_time": "20m", "alertname": BUCKET_MISSING_ALERT,
             "exp_alerts": alerts.expect(BUCKET_MISSING_ALERT, "old", slo="ttft")},
        ],
    }
    assert ttft_edge != "+Inf"
    confident = spec.diagnosis_min_confidence
    diagnosis = {
        "name": "a confident, held verdict alerts; a doubtful or quiet one does not",
        "interval": "1m",
        "input_series": [
            *_verdicts("chat", "queueing", 40),
            {"series": 'phasewatch_diagnosis_confidence{model="chat"}',
             "values": f"{min(1.0, confident + 0.2):g}x40"},
            *_verdicts("rag", "prefill_bound", 40),
            {"series": 'phasewatch_diagnosis_confidence{model="rag"}',
             "values": f"{confident / 2:g}x40"},
            *_verdicts("idle", "insufficient_data", 40),
            {"series": 'phasewatch_diagnosis_confidence{model="idle"}', "values": "1x40"},
        ],
        "alert_rule_test": [
            *silent([DIAGNOSIS_ALERT], 5),
            {"eval_time": "30m", "alertname": DIAGNOSIS_ALERT,
             "exp_alerts": [
                 {**alert, "exp_labels": {**alert["exp_labels"], "verdict": "queueing"}}
                 for alert in alerts.expect(DIAGNOSIS_ALERT, "chat", verdict="queueing")
             ]},
        ],
    }
    return [healthy, burn_scenario(spec, alerts, "ttft"), burn_scenario(spec, alerts, "itl"),
            low_traffic, absent, missing, diagnosis]


def _plain(alerts: Alerts, name: str) -> dict[str, str]:
    (rule,) = [rule for rule in alerts.rules if rule["alert"] == name]
    return dict(rule["annotations"])


def _verdicts(model: str, active: str, minutes: int) -> list[dict[str, str]]:
    verdicts = ["healthy", "queueing", "decode_saturation", "out_of_capacity", "prefill_bound",
                "interference", "kv_pressure", "insufficient_data"]
    return [{"series": f'phasewatch_diagnosis_verdict{{model="{model}", verdict="{v}"}}',
             "values": f"{int(v == active)}x{minutes}"} for v in verdicts]


@pytest.fixture(scope="module")
def spec() -> SloSpec:
    return load_spec(SLO_FILE)


def test_alerts_fire_on_burns_and_stay_silent_on_healthy_traffic(
    promtool: str, spec: SloSpec, tmp_path: Path
) -> None:
    tests = tmp_path / "slo-tests.yml"
    tests.write_text(dump_yaml({
        "rule_files": [str(RULES)],
        "evaluation_interval": "5m",
        "tests": scenarios(spec),
    }))
    result = _run([promtool, "test", "rules", str(tests)])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_promtool_test_catches_an_alert_that_does_not_fire(
    promtool: str, spec: SloSpec, tmp_path: Path
) -> None:
    """The harness itself can fail: expecting the 1h page half an hour in is reported."""
    scenario = burn_scenario(spec, Alerts(spec), "ttft")
    scenario["alert_rule_test"] = [{"eval_time": f"{DAY + 30}m",
                                    "alertname": alert_name("ttft"),
                                    "exp_alerts": Alerts(spec).burn("ttft", MODEL, "1h")}]
    tests = tmp_path / "wrong.yml"
    tests.write_text(dump_yaml({"rule_files": [str(RULES)], "evaluation_interval": "5m",
                                "tests": [scenario]}))
    result = _run([promtool, "test", "rules", str(tests)])
    assert result.returncode != 0
    assert alert_name("ttft") in result.stdout + result.stderr


def test_the_trickle_pages_without_the_min_events_guard(
    promtool: str, spec: SloSpec, tmp_path: Path
) -> None:
    """The low-traffic scenario is quiet because of the guard, not by accident: the same
    series with min_events 0 fire, for both SLOs, every pair whose `for` has run out by then
    (all but 3d/6h, which waits 3 hours)."""
    assert all(spec.default.objective(slo).min_events > 0 for slo in SLO_NAMES)
    unguarded = replace(spec, default=replace(
        spec.default,
        ttft=spec.default.ttft.model_copy(update={"min_events": 0}),
        itl=spec.default.itl.model_copy(update={"min_events": 0}),
    ))
    rules = tmp_path / "unguarded.rules.yml"
    rules.write_text(dump_yaml({"groups": render_groups(unguarded)}))
    alerts = Alerts(unguarded)
    expect = [{"eval_time": "70m", "alertname": alert_name(slo),
               "exp_alerts": alerts.burn(slo, "rare", "1h", "6h", "1d")} for slo in SLO_NAMES]
    tests = tmp_path / "unguarded.yml"
    tests.write_text(dump_yaml({"rule_files": [str(rules)], "evaluation_interval": "5m",
                                "tests": [low_traffic_scenario(unguarded, [], expect)]}))
    result = _run([promtool, "test", "rules", str(tests)])
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_model_override_is_judged_by_its_own_threshold(
    promtool: str, spec: SloSpec, tmp_path: Path
) -> None:
    """Every first token at 0.75 s: over the default threshold, under a 1 s override. Only the
    model without the override burns; the lookalike name shows the model regex is escaped."""
    data = yaml.safe_load(SLO_FILE.read_text())
    data["models"] = [{"model": MODEL, "ttft": {"threshold_s": 1.0}}]
    overridden = parse_spec(data)
    rules = tmp_path / "override.rules.yml"
    rules.write_text(dump_yaml({"groups": render_groups(overridden)}))
    lookalike = MODEL.replace(".", "x")  # matches MODEL's name only if "." were left unescaped
    series = []
    for model in (MODEL, lookalike):
        for le in (le_value(spec.default.ttft.threshold_s), "1.0"):
            value = "0x80" if le != "1.0" else cumulative((50, 80))
            series.append({"series": f'{HISTOGRAMS["ttft"]}_bucket{{model="{model}", le="{le}"}}',
                           "values": value})
        series.append({"series": f'{HISTOGRAMS["ttft"]}_count{{model="{model}"}}',
                       "values": cumulative((50, 80))})
    alerts = Alerts(overridden)
    expect = [a for a in alerts.burn("ttft", lookalike, "1h", "6h", "1d")
              if "0.5" in a["exp_annotations"]["description"]
              or "500 ms" in a["exp_annotations"]["description"]]
    assert len(expect) == 3
    tests = tmp_path / "override.yml"
    tests.write_text(dump_yaml({"rule_files": [str(rules)], "evaluation_interval": "5m", "tests": [{
        "name": "per-model threshold", "interval": "1m", "input_series": series,
        "alert_rule_test": [{"eval_time": "70m", "alertname": alert_name("ttft"),
                             "exp_alerts": expect}],
    }]}))
    result = _run([promtool, "test", "rules", str(tests)])
    assert result.returncode == 0, result.stdout + result.stderr
