"""Generate phasewatch's Grafana dashboard from code, with grafana-foundation-sdk.

    .venv/bin/python grafana/dashboards.py          # write grafana/dashboards/phasewatch.json
    .venv/bin/python grafana/dashboards.py --check  # exit 1 if the committed JSON is stale

(`make dashboards` runs the first; the tests run the second.) The SDK is the optional extra
`dashboards` (also in `test`). The SLO thresholds drawn on the latency panels and the recorded
burn-rate series come from deploy/slo.yaml through `phasewatch.slo`, so dashboard and alerts cannot
disagree. Edit this file, never the JSON.

Query rules: histograms are read through rate()/increase() of their buckets, never raw
cumulative counts; quantiles are `histogram_quantile(q, sum by (le, ...) (rate(...)))`;
every range is `$__rate_interval`. The proxy labels models `model`, vLLM labels them
`model_name`: both are filtered by the one `$model` variable.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import (
    common,
    dashboard,
    heatmap,
    prometheus,
    stat,
    statetimeline,
    timeseries,
)
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as common_models
from grafana_foundation_sdk.models import dashboard as dashboard_models
from grafana_foundation_sdk.models import heatmap as heatmap_models
from grafana_foundation_sdk.models import prometheus as prometheus_models

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from phasewatch.slo.files import load_spec  # noqa: E402
from phasewatch.slo.rules import BURN_WINDOWS, VERDICTS, burn_record, errors_record  # noqa: E402
from phasewatch.slo.spec import HISTOGRAMS, SloName, SloSpec  # noqa: E402

OUT = ROOT / "grafana" / "dashboards" / "phasewatch.json"
SLO_FILE = ROOT / "deploy" / "slo.yaml"
DATASOURCE = dashboard_models.DataSourceRef(type_val="prometheus", uid="${datasource}")
PROXY = 'model=~"$model"'
ENGINE = 'model_name=~"$model"'
RATE = "$__rate_interval"
TITLE: dict[SloName, str] = {"ttft": "TTFT", "itl": "ITL"}
# The proxy's quantile next to vLLM's own for the same phase.
ENGINE_COMPARISONS: tuple[tuple[SloName, str, float], ...] = (
    ("ttft", "vllm:time_to_first_token_seconds", 0.95),
    ("itl", "vllm:inter_token_latency_seconds", 0.5),
)


def query(expr: str, legend: str, ref: str, fmt: str = "time_series",
          exemplars: bool = False) -> prometheus.Dataquery:
    built = (
        prometheus.Dataquery()
        .expr(expr)
        .legend_format(legend)
        .ref_id(ref)
        .format(prometheus_models.PromQueryFormat(fmt))
        .datasource(DATASOURCE)
        .range()
    )
    return built.exemplar(True) if exemplars else built


def series(title: str, description: str, unit: str, queries: list[tuple[str, str]],
           width: int = 12, height: int = 8, exemplars: bool = False) -> timeseries.Panel:
    """A time series panel; with `exemplars`, its first query also shows the exemplars of its
    histogram (a dot per request id, linked by the datasource's exemplar link)."""
    panel = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .span(width)
        .height(height)
        .line_width(1)
        .fill_opacity(10)
        .legend(common.VizLegendOptions()
                .display_mode(common_models.LegendDisplayMode.TABLE)
                .placement(common_models.LegendPlacement.BOTTOM)
                .show_legend(True)
                .calcs(["lastNotNull", "max"]))
        .tooltip(common.VizTooltipOptions().mode(common_models.TooltipDisplayMode.MULTI)
                 .sort(common_models.SortOrder.DESCENDING))
    )
    for index, (expr, legend) in enumerate(queries):
        panel = panel.with_target(query(expr, legend, chr(ord("A") + index),
                                        exemplars=exemplars and index == 0))
    return panel


def threshold_lines(panel: timeseries.Panel, steps: list[tuple[float, str]]) -> timeseries.Panel:
    """Dashed lines at the given values (SLO thresholds, burn factors)."""
    lines = [dashboard_models.Threshold(value=value, color=color) for value, color in steps]
    return (
        panel.thresholds(dashboard.ThresholdsConfig()
                         .mode(dashboard_models.ThresholdsMode.ABSOLUTE)
                         .steps([dashboard_models.Threshold(value=None, color="transparent"),
                                 *lines]))
        .thresholds_style(common.GraphThresholdsStyleConfig()
                          .mode(common_models.GraphTresholdsStyleMode.DASHED))
    )


def latency_heatmap(slo: SloName) -> heatmap.Panel:
    histogram = HISTOGRAMS[slo]
    return (
        heatmap.Panel()
        .title(f"{TITLE[slo]} distribution")
        .description(
            f"{histogram}: requests per bucket per interval (increase of each bucket; Grafana "
            "de-accumulates the le buckets). A band creeping upward is the phase slowing down."
        )
        .datasource(DATASOURCE)
        .span(12)
        .height(8)
        .with_target(query(
            f"sum by (le) (increase({histogram}_bucket{{{PROXY}}}[{RATE}]))", "{{le}}", "A",
            fmt="heatmap",
        ))
        .calculate(False)
        .y_axis(heatmap.YAxisConfig().unit("s"))
        .rows_frame(heatmap.RowsHeatmapOptions().layout(common_models.HeatmapCellLayout.LE))
        .color(heatmap.HeatmapColorOptions().mode(heatmap_models.HeatmapColorMode.SCHEME)
               .scheme("Oranges").scale(heatmap_models.HeatmapColorScale.EXPONENTIAL)
               .exponent(0.5))
        .cell_gap(1)
        .show_legend()
    )


def quantiles(spec: SloSpec, slo: SloName) -> timeseries.Panel:
    histogram = HISTOGRAMS[slo]
    threshold = spec.default.objective(slo).threshold_s
    panel = series(
        f"{TITLE[slo]} p50 / p95 / p99",
        f"Quantiles of {histogram} per model, interpolated within buckets; the dashed line is "
        f"the SLO threshold ({threshold:g} s). The SLO itself is counted exactly from the "
        "bucket at that edge (burn-rate panels). Dots are exemplars: one request that landed "
        "in a bucket (for ITL, a request's largest gap so far); its link opens that request's "
        "record in phasewatch's API.",
        "s",
        [(f"histogram_quantile({q}, sum by (le, model) "
          f"(rate({histogram}_bucket{{{PROXY}}}[{RATE}])))", f"p{int(q * 100)} {{{{model}}}}")
         for q in (0.5, 0.95, 0.99)],
        exemplars=True,
    )
    return threshold_lines(panel, [(threshold, "red")])


def burn(slo: SloName) -> timeseries.Panel:
    windows = sorted({w.long for w in BURN_WINDOWS} | {w.short for w in BURN_WINDOWS},
                     key=["5m", "30m", "1h", "2h", "6h", "1d", "3d"].index)
    panel = series(
        f"{TITLE[slo]} SLO burn rate",
        "Error ratio / error budget, per window (recorded by the SLO rules). 1 spends the "
        "budget exactly over 30 days. Page: 1h and 5m above 14.4, or 6h and 30m above 6. "
        "Ticket: 1d and 2h above 3, or 3d and 6h above 1.",
        "x",
        [(f"{burn_record(slo, w)}{{{PROXY}}}", f"{{{{model}}}} {w}") for w in windows],
        width=8,
    )
    return threshold_lines(panel, [(1.0, "yellow"), (3.0, "orange"), (6.0, "red"),
                                   (14.4, "dark-red")])


def attainment(spec: SloSpec, slo: SloName) -> stat.Panel:
    objective = spec.default.objective(slo)
    return (
        stat.Panel()
        .title(f"{TITLE[slo]} within threshold, last 1h")
        .description(f"Share of {'requests' if slo == 'ttft' else 'token gaps'} within the SLO "
                     f"threshold over the last hour (objective {objective.objective:.1%} within "
                     f"{objective.threshold_s:g} s for the default models).")
        .datasource(DATASOURCE)
        .unit("percentunit")
        .decimals(2)
        .span(4)
        .height(8)
        .with_target(query(f"1 - {errors_record(slo, '1h')}{{{PROXY}}}", "{{model}}", "A"))
        .thresholds(dashboard.ThresholdsConfig()
                    .mode(dashboard_models.ThresholdsMode.ABSOLUTE)
                    .steps([dashboard_models.Threshold(value=None, color="red"),
                            dashboard_models.Threshold(value=objective.objective,
                                                       color="green")]))
        .color_mode(common_models.BigValueColorMode.BACKGROUND)
        .reduce_options(common.ReduceDataOptions().calcs(["lastNotNull"]))
    )


def verdicts() -> statetimeline.Panel:
    colors = {verdict: "red" for verdict in VERDICTS}
    colors |= {"healthy": "green", "insufficient_data": "text"}
    panel = (
        statetimeline.Panel()
        .title("Diagnosis verdict")
        .description("phasewatch_diagnosis_verdict: which phase is broken, per model, over time. "
                     "GET /api/diagnosis for the evidence behind the current verdict.")
        .datasource(DATASOURCE)
        .span(16)
        .height(7)
        .with_target(query(
            f"max by (model, verdict) (phasewatch_diagnosis_verdict{{{PROXY}}}) == 1",
            "{{model}}: {{verdict}}", "A",
        ))
        .mappings([dashboard_models.ValueMap(options={
            "1": dashboard_models.ValueMappingResult(text="active", color="red")})])
        .merge_values(True)
        .show_value(common_models.VisibilityMode.NEVER)
    )
    for verdict, color in colors.items():
        panel = panel.override_by_regexp(
            f".*: {verdict}$",
            [dashboard_models.DynamicConfigValue(id_val="color", value={
                "mode": "fixed", "fixedColor": color})],
        )
    return panel


def build(spec: SloSpec) -> dashboard.Dashboard:
    board = (
        dashboard.Dashboard("phasewatch: prefill (TTFT) and decode (ITL)")
        .uid("phasewatch")
        .description("TTFT and ITL SLOs as phasewatch measures them, the diagnosis, traffic, and "
                     "the engine's own gauges beside them. Generated by grafana/dashboards.py.")
        .tags(["phasewatch", "vllm", "slo"])
        .editable()
        .refresh("30s")
        .time("now-3h", "now")
        .timezone("browser")
        .tooltip(dashboard_models.DashboardCursorSync.CROSSHAIR)
        .with_variable(dashboard.DatasourceVariable("datasource").label("Data source")
                       .type("prometheus"))
        .with_variable(
            dashboard.QueryVariable("model")
            .label("Model")
            .datasource(DATASOURCE)
            .query({"query": "label_values(phasewatch_requests_total, model)",
                    "refId": "PrometheusVariableQueryEditor-VariableQuery"})
            .refresh(dashboard_models.VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(dashboard_models.VariableSort.ALPHABETICAL_ASC)
            .multi(True)
            .include_all(True)
            .all_value(".*")
        )
    )

    board = board.with_row(dashboard.Row("SLOs: is anyone's experience broken?"))
    for slo in ("ttft", "itl"):  # TTFT on the left, ITL on the right, on every row
        board = board.with_panel(attainment(spec, slo)).with_panel(burn(slo))

    board = board.with_row(dashboard.Row("Now: streams in flight"))
    ttft_threshold = spec.default.objective("ttft").threshold_s
    board = board.with_panel(series(
        "Streams waiting for a first token | decoding",
        "Open streams at the proxy, per model, refreshed every second: waiting (queued or in "
        "prefill: no first token yet) and decoding; the engine's own waiting queue and running "
        "batch beside them. Waiting growing while decoding holds is queueing.", "short",
        [(f"sum by (model) (phasewatch_streams_waiting{{{PROXY}}})", "waiting {{model}}"),
         (f"sum by (model) (phasewatch_streams_decoding{{{PROXY}}})", "decoding {{model}}"),
         (f"sum(vllm:num_requests_waiting{{{ENGINE}}})", "engine waiting"),
         (f"sum(vllm:num_requests_running{{{ENGINE}}})", "engine running")],
        width=10, height=7))
    board = board.with_panel(threshold_lines(series(
        "Oldest wait for a first token",
        "Age of the oldest stream still waiting for its first token, per model: a TTFT still "
        "being paid, seen before the request ends (the dashed line is the TTFT threshold).",
        "s", [(f"max by (model) (phasewatch_oldest_waiting_seconds{{{PROXY}}})", "{{model}}")],
        width=7, height=7), [(ttft_threshold, "red")]))
    board = board.with_panel(series(
        "Stalled streams",
        "Decoding streams silent for longer than PHASEWATCH_STALL_THRESHOLD_S (default 5 s): "
        "an engine stuck, or decode starved by long prefills.", "short",
        [(f"sum by (model) (phasewatch_streams_stalled{{{PROXY}}})", "{{model}}")],
        width=7, height=7))

    board = board.with_row(dashboard.Row("Diagnosis: which phase?"))
    board = board.with_panel(verdicts())
    board = board.with_panel(
        series("Diagnosis confidence", "phasewatch_diagnosis_confidence per model (0-1).",
               "percentunit",
               [(f"max by (model) (phasewatch_diagnosis_confidence{{{PROXY}}})", "{{model}}")],
               width=8, height=7)
    )

    board = board.with_row(dashboard.Row("Capacity: how much more traffic before an SLO breaks?"))
    board = board.with_panel(threshold_lines(series(
        "SLO headroom",
        "phasewatch_slo_headroom per model: the highest request rate the engine replicas serve "
        "within both SLOs (calibrated on their own traffic, docs/plan.md) over the rate they "
        "serve now. Below the dashed line at 1, today's traffic breaks an SLO. Empty unless "
        "PHASEWATCH_CAPACITY_INTERVAL_S is set.", "short",
        [(f"max by (model) (phasewatch_slo_headroom{{{PROXY}}})", "{{model}}")],
        width=12, height=7), [(1.0, "red")]))
    board = board.with_panel(series(
        "Highest rate within both SLOs, per replica | served rate",
        "phasewatch_slo_max_rate_rps (one engine replica, as calibrated) beside the request "
        "rate served now: the gap between them is the headroom.", "reqps",
        [(f"max by (model) (phasewatch_slo_max_rate_rps{{{PROXY}}})", "per replica {{model}}"),
         (f"sum by (model) (rate(phasewatch_requests_total{{{PROXY}}}[{RATE}]))",
          "served {{model}}")],
        width=12, height=7))

    board = board.with_row(dashboard.Row("Latency: TTFT (queueing + prefill) | ITL (decode)"))
    board = board.with_panel(latency_heatmap("ttft")).with_panel(latency_heatmap("itl"))
    board = board.with_panel(quantiles(spec, "ttft")).with_panel(quantiles(spec, "itl"))

    board = board.with_row(dashboard.Row("Traffic: concurrency, throughput, token mix"))
    board = board.with_panel(series(
        "Concurrency", "Requests open at the proxy, next to the engine's batch and queue. "
        "Waiting above zero is queueing: TTFT pays for it.", "short",
        [("sum(phasewatch_requests_in_flight)", "in flight at phasewatch"),
         (f"sum(vllm:num_requests_running{{{ENGINE}}})", "running in the engine"),
         (f"sum(vllm:num_requests_waiting{{{ENGINE}}})", "waiting in the engine")],
    ))
    board = board.with_panel(series(
        "Throughput", "Finished requests per second by outcome, and output tokens per second "
        "(aggregate, not per user: per-user speed is ITL).", "short",
        [(f"sum by (outcome) (rate(phasewatch_requests_total{{{PROXY}}}[{RATE}]))",
          "requests/s {{outcome}}"),
         (f"sum by (model) (rate(phasewatch_request_generation_tokens_sum{{{PROXY}}}[{RATE}]))",
          "output tokens/s {{model}}")],
    ))
    board = board.with_panel(series(
        "Token mix: prompt vs output tokens/s", "Prefill work (prompt tokens) against decode "
        "work (output tokens). A prefill-heavy mix (RAG) wants compute; a decode-heavy one (chat) "
        "wants bandwidth.", "short",
        [(f"sum(rate(phasewatch_request_prompt_tokens_sum{{{PROXY}}}[{RATE}]))", "prompt tokens/s"),
         (f"sum(rate(phasewatch_request_generation_tokens_sum{{{PROXY}}}[{RATE}]))",
          "output tokens/s")],
    ))
    board = board.with_panel(series(
        "Tokens per request", "Mean prompt and output length per model, and prompt tokens per "
        "output token: TTFT follows the first, total decode time the second.", "short",
        [(f"sum by (model) (rate(phasewatch_request_prompt_tokens_sum{{{PROXY}}}[{RATE}])) / "
          f"sum by (model) (rate(phasewatch_request_prompt_tokens_count{{{PROXY}}}[{RATE}]))",
          "prompt {{model}}"),
         (f"sum by (model) (rate(phasewatch_request_generation_tokens_sum{{{PROXY}}}[{RATE}])) / "
          f"sum by (model) (rate(phasewatch_request_generation_tokens_count{{{PROXY}}}[{RATE}]))",
          "output {{model}}"),
         (f"sum by (model) (rate(phasewatch_request_prompt_tokens_sum{{{PROXY}}}[{RATE}])) / "
          f"sum by (model) (rate(phasewatch_request_generation_tokens_sum{{{PROXY}}}[{RATE}]))",
          "prompt per output token {{model}}")],
    ))

    board = board.with_row(dashboard.Row("Engine (vLLM) next to the proxy"))
    board = board.with_panel(series(
        "Engine queue and batch", "vllm:num_requests_waiting (queueing: TTFT) and "
        "vllm:num_requests_running (the decode batch: ITL).", "short",
        [(f"sum by (model_name) (vllm:num_requests_waiting{{{ENGINE}}})", "waiting {{model_name}}"),
         (f"sum by (model_name) (vllm:num_requests_running{{{ENGINE}}})",
          "running {{model_name}}")],
        width=8,
    ))
    board = board.with_panel(threshold_lines(series(
        "KV cache usage", "vllm:kv_cache_usage_perc (vllm:gpu_cache_usage_perc before it was "
        "renamed). Near 100% the engine preempts.", "percentunit",
        [(f"max by (model_name) (vllm:kv_cache_usage_perc{{{ENGINE}}} "
          f"or vllm:gpu_cache_usage_perc{{{ENGINE}}})", "{{model_name}}")],
        width=8,
    ), [(0.9, "red")]))
    board = board.with_panel(series(
        "Preemptions", "rate(vllm:num_preemptions_total): sequences evicted from the KV cache "
        "and recomputed later.", "short",
        [(f"sum by (model_name) (rate(vllm:num_preemptions_total{{{ENGINE}}}[{RATE}]))",
          "preemptions/s {{model_name}}")],
        width=8,
    ))
    for slo, engine_metric, q in ENGINE_COMPARISONS:
        board = board.with_panel(series(
            f"{TITLE[slo]} p{int(q * 100)}: proxy vs engine",
            f"{HISTOGRAMS[slo]} against {engine_metric}. The proxy's includes the network "
            "between proxy and engine and the engine frontend's own wait; vLLM's ITL takes one "
            "sample per output chunk, phasewatch's one per token.", "s",
            [(f"histogram_quantile({q}, sum by (le) "
              f"(rate({HISTOGRAMS[slo]}_bucket{{{PROXY}}}[{RATE}])))", "phasewatch"),
             (f"histogram_quantile({q}, sum by (le) "
              f"(rate({engine_metric}_bucket{{{ENGINE}}}[{RATE}])))", "vLLM")],
        ))
    return board


def render(spec: SloSpec) -> str:
    model = build(spec).build()
    for number, panel in enumerate(model.panels or [], start=1):
        panel.id_val = number  # unique ids: Grafana links and "view panel" address panels by id
    return json.dumps(model, cls=JSONEncoder, indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if the committed dashboard differs from the generated one")
    args = parser.parse_args(argv)
    text = render(load_spec(SLO_FILE))
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is stale: run `make dashboards`", file=sys.stderr)
            return 1
        print(f"{OUT} is up to date")
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
