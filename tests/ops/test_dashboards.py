"""The Grafana dashboard: generated from grafana/dashboards.py, committed up to date, and its
queries shaped correctly (buckets only through rate/increase, quantiles by `le`).

Whether each query returns data is checked against a live Prometheus in
test_live_prometheus.py.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from tests.ops.conftest import ROOT

GENERATOR = ROOT / "grafana" / "dashboards.py"
DASHBOARD = ROOT / "grafana" / "dashboards" / "phasewatch.json"
PROVISIONING = ROOT / "grafana" / "provisioning"


def board() -> dict[str, Any]:
    data = json.loads(DASHBOARD.read_text())
    assert isinstance(data, dict)
    return data


def targets() -> list[tuple[dict[str, Any], dict[str, Any]]]:
    return [(panel, target) for panel in board()["panels"] for target in panel.get("targets", [])]


def load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("phasewatch_dashboards", GENERATOR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_dashboard_is_what_the_generator_writes() -> None:
    result = subprocess.run([sys.executable, str(GENERATOR), "--check"], capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr


def test_check_fails_on_a_stale_dashboard(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    generator = load_generator()
    stale = tmp_path / "grafana" / "phasewatch.json"
    stale.parent.mkdir()
    stale.write_text(DASHBOARD.read_text().replace("p95", "p96", 1))
    generator.OUT = stale
    assert generator.main(["--check"]) == 1
    assert "stale: run `make dashboards`" in capsys.readouterr().err


def test_histograms_are_never_plotted_as_raw_cumulative_counts() -> None:
    for panel, target in targets():
        expr = target["expr"]
        # Every bucket, sum or count series (cumulative counters) is read over a range...
        for match in re.finditer(r"[\w:]+_(bucket|sum|count|total)\{[^}]*\}(\[[^\]]+\])?", expr):
            assert match.group(2) == "[$__rate_interval]", (panel["title"], expr)
            # ...inside rate() or increase(), never as the raw cumulative value.
            assert re.search(r"(rate|increase)\($", expr[: match.start()]), (panel["title"], expr)
        # Quantiles aggregate buckets by `le` and nothing coarser.
        for quantile in re.finditer(r"histogram_quantile\([0-9.]+, sum by \(([^)]*)\)", expr):
            assert "le" in [label.strip() for label in quantile.group(1).split(",")], expr
        assert "histogram_quantile" not in expr or "sum by (" in expr, expr


def test_heatmaps_read_increase_per_bucket_as_prometheus_buckets() -> None:
    heatmaps = [panel for panel in board()["panels"] if panel["type"] == "heatmap"]
    assert {p["title"] for p in heatmaps} == {"TTFT distribution", "ITL distribution"}
    for panel in heatmaps:
        (target,) = panel["targets"]
        assert target["format"] == "heatmap" and target["legendFormat"] == "{{le}}"
        assert target["expr"].startswith("sum by (le) (increase(")
        assert panel["options"]["calculate"] is False


def test_the_panels_the_operator_needs_are_there() -> None:
    exprs = "\n".join(target["expr"] for _, target in targets())
    for needed in (
        "phasewatch_time_to_first_token_seconds_bucket", "phasewatch_inter_token_latency_seconds",
        "histogram_quantile(0.5,", "histogram_quantile(0.95,", "histogram_quantile(0.99,",
        "phasewatch:ttft_slo_burn:rate1h", "phasewatch:itl_slo_burn:rate1h",
        "phasewatch_requests_in_flight", "phasewatch_requests_total",
        "phasewatch_request_prompt_tokens_sum", "phasewatch_request_generation_tokens_sum",
        "phasewatch_diagnosis_verdict", "phasewatch_diagnosis_confidence",
        "vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc", "vllm:num_preemptions_total",
    ):
        assert needed in exprs, needed


def test_every_query_uses_the_datasource_variable_and_filters_by_model() -> None:
    for panel, target in targets():
        assert target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        if "in_flight" not in target["expr"]:  # the proxy's gauge has no model label
            assert '=~"$model"' in target["expr"], (panel["title"], target["expr"])
    ids = [panel["id"] for panel in board()["panels"]]
    assert len(ids) == len(set(ids))


def test_provisioning_points_at_the_dashboards_and_the_datasource() -> None:
    datasources = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yml").read_text())
    (prometheus,) = datasources["datasources"]
    assert prometheus["type"] == "prometheus" and prometheus["isDefault"] is True
    providers = yaml.safe_load((PROVISIONING / "dashboards" / "phasewatch.yml").read_text())
    (provider,) = providers["providers"]
    assert provider["type"] == "file"
    # The compose file mounts grafana/dashboards at this path (test_deploy_files checks it).
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"
    variable = {v["name"]: v for v in board()["templating"]["list"]}["datasource"]
    assert variable["query"] == "prometheus"


def test_latency_panels_show_exemplars_linked_to_the_stored_record() -> None:
    """Both quantile panels ask for their histogram's exemplars, and the datasource turns the
    exemplar's request_id into a link to that request in phasewatch's API."""
    with_exemplars = {panel["title"] for panel, target in targets() if target.get("exemplar")}
    assert with_exemplars == {"TTFT p50 / p95 / p99", "ITL p50 / p95 / p99"}
    for panel, target in targets():
        if target.get("exemplar"):
            assert re.search(r"phasewatch_(time_to_first_token|inter_token_latency)_seconds_bucket",
                             target["expr"]), panel["title"]
    datasources = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yml").read_text())
    (prometheus,) = datasources["datasources"]
    (link,) = prometheus["jsonData"]["exemplarTraceIdDestinations"]
    assert link["name"] == "request_id"  # the exemplar label phasewatch writes
    assert link["url"].endswith("/api/requests?request_id=${__value.raw}")
