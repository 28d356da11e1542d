"""PNG plots of a run, drawn from its rows with matplotlib's Agg backend (no display needed).

One figure per kind of run: TTFT and ITL against prompt length; ITL, throughput and TTFT
against concurrency; the short client's gaps against time around the long prefill (one panel
per chunked-prefill setting); TTFT quantiles, TPOT and ITL, throughput, and completed against
good requests per second (goodput) against the request rate, with the SLO lines. matplotlib
comes with the optional `bench` extra: without it `write_plots` returns no paths and says why.

A log-scaled axis says so in its label. The x axis is linear for prompt lengths (the article's
claim, TTFT linear in the prompt, is a straight line there) and rates, log-2 for concurrency
(1 to 64 streams); `x_scale` ("linear" or "log") overrides that.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

Row = dict[str, Any]
X_SCALES = ("linear", "log")
DEFAULT_X_SCALE = {"prompt": "linear", "concurrency": "log", "rate": "linear",
                   "goodput": "linear"}


class PlotsUnavailable(RuntimeError):
    """matplotlib is not installed (pip install 'phasewatch[bench]')."""


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise PlotsUnavailable(
            "plots skipped: matplotlib is not installed (pip install 'phasewatch[bench]')"
        ) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _ms(points: Sequence[Row], key: str) -> list[float | None]:
    return [None if p.get(key) is None else p[key] * 1e3 for p in points]


def _lines(ax: Any, xs: Sequence[float], series: Sequence[tuple[str, list[float | None]]],
           styles: Sequence[str] = ("o-", "s--", "^:", "v-.")) -> None:
    for (label, ys), style in zip(series, styles, strict=False):
        pairs = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None]
        if pairs:
            ax.plot([x for x, _ in pairs], [y for _, y in pairs], style, label=label)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)


def _x_axis(ax: Any, xs: Sequence[float], label: str, scale: str) -> None:
    """The x axis: log-2 (labelled so, ticks at the values swept) or linear from 0."""
    if scale == "log":
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(xs), [f"{x:g}" for x in xs])
        ax.minorticks_off()
        ax.set_xlabel(f"{label} (log scale)")
    else:
        ax.set_xlim(left=0, right=max(xs, default=1) * 1.05)
        ax.set_xlabel(label)


def _title(run: Row) -> str:
    sim = (run["engine"] or {}).get("sim")
    where = f"{sim['gpu']} (simulated)" if sim else run["target"]
    clock = " - model time" if run["parameters"].get("clock") == "model" else ""
    return f"{run['id']}: {run['parameters'].get('model')} on {where}{clock}"


def _prompt(plt: Any, run: Row, points: Sequence[Row], x_scale: str) -> Any:
    xs = [p["x_value"] for p in points]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    _lines(a, xs, [("TTFT p50", _ms(points, "ttft_p50_s")),
                   ("TTFT p99", _ms(points, "ttft_p99_s"))])
    a.set(ylabel="ms", title="TTFT against prompt length (prefill)")
    a.set_ylim(bottom=0)
    _lines(b, xs, [("ITL p50", _ms(points, "itl_p50_s")), ("ITL p99", _ms(points, "itl_p99_s"))])
    b.set(ylabel="ms", title="ITL against prompt length (decode)")
    b.set_ylim(bottom=0)
    for ax in (a, b):
        _x_axis(ax, xs, "prompt tokens", x_scale)
    return fig


def _concurrency(plt: Any, run: Row, points: Sequence[Row], x_scale: str) -> Any:
    xs = [p["x_value"] for p in points]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4.2))
    _lines(a, xs, [("ITL p50", _ms(points, "itl_p50_s")), ("ITL p95", _ms(points, "itl_p95_s"))])
    a.set(ylabel="ms", title="ITL against concurrency")
    a.set_ylim(bottom=0)
    _lines(b, xs, [("output", [p["output_throughput_tps"] for p in points]),
                   ("total", [p["total_throughput_tps"] for p in points])])
    b.set(ylabel="tokens/s", title="throughput against concurrency")
    _lines(c, xs, [("TTFT p50", _ms(points, "ttft_p50_s")),
                   ("TTFT p95", _ms(points, "ttft_p95_s"))])
    c.set(ylabel="ms", title="TTFT against concurrency")
    for ax in (a, b, c):
        _x_axis(ax, xs, "concurrent streams", x_scale)
    return fig


def _timeline(plt: Any, run: Row, points: Sequence[Row], x_scale: str) -> Any:
    timelines = (run["summary"] or {}).get("timelines") or []
    settings = list(dict.fromkeys(line.get("chunked_prefill") for line in timelines)) or [None]
    fig, axes = plt.subplots(len(settings), 1, figsize=(11, 3.6 * len(settings)), sharex=True,
                             sharey=True, squeeze=False)
    colors = ("tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown")
    for ax, setting in zip(axes[:, 0], settings, strict=True):
        mine = [line for line in timelines if line.get("chunked_prefill") == setting]
        for index, line in enumerate(mine):
            # Each gap is drawn over the time it lasted (its end minus its length to its end).
            ends = [t for t, _ in line["gaps"]]
            heights = [g * 1e3 for _, g in line["gaps"]]
            color = colors[index % len(colors)]
            ax.hlines(heights, [t - g / 1e3 for t, g in zip(ends, heights, strict=True)], ends,
                      colors=color, linewidth=1.5, label=f"repeat {index + 1}")
            ax.plot(ends, heights, ".", color=color, markersize=3)
            ax.axvspan(0.0, line["long_first_token_s"], color="tab:red", alpha=0.08)
        title = "a short stream's gaps around a long prefill"
        ax.set(ylabel="gap between its tokens,\nms (log scale)",
               title=title + (f": chunked prefill {setting}" if setting else ""))
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        if mine:
            ax.legend(fontsize=8)
    axes[-1, 0].set_xlabel("seconds since the long prompt arrived (shaded: until its first "
                           "token)")
    return fig


def _rate(plt: Any, run: Row, points: Sequence[Row], x_scale: str) -> Any:
    ordered = sorted(points, key=lambda p: p["x_value"])
    xs = [p["x_value"] for p in ordered]
    slo = (run["summary"] or {}).get("slo") or {}
    q = slo.get("quantile", "p95")
    fig, (a, b, c, d) = plt.subplots(1, 4, figsize=(19, 4.2))
    _lines(a, xs, [(f"TTFT {q}", _ms(ordered, f"ttft_{q}_s")),
                   ("TTFT p50", _ms(ordered, "ttft_p50_s"))])
    tpot = [None if (v := ((p["extra"] or {}).get("figures") or {}).get("tpot_s", {}).get(q))
            is None else v * 1e3 for p in ordered]
    _lines(b, xs, [(f"TPOT {q} (per request)", tpot),
                   ("ITL p50 (per chunk)", _ms(ordered, "itl_p50_s"))])
    if slo:
        for ax, limit in ((a, slo["ttft_s"]), (b, slo["itl_s"])):
            ax.axhline(limit * 1e3, color="tab:red", linestyle=":", label="objective")
            ax.legend(fontsize=8)
    a.set(ylabel="ms", title="TTFT against load")
    b.set(ylabel="ms", title="time per output token against load")
    _lines(c, xs, [("output tok/s", [p["output_throughput_tps"] for p in ordered])])
    c.set(ylabel="tokens/s", title="token throughput")
    # Requests per second on their own axes: completed and good (goodput) in different colours
    # and markers, the rates that met the SLO circled.
    d.plot(xs, xs, color="0.6", linestyle=":", label="offered rate")
    d.plot(xs, [(((p["extra"] or {}).get("figures") or {}).get("request_rps")) for p in ordered],
           "o-", color="tab:blue", label="completed req/s")
    if any(p["goodput_rps"] is not None for p in ordered):
        d.plot(xs, [p["goodput_rps"] or 0 for p in ordered], "s--", color="tab:green",
               linewidth=2, label=f"goodput (good req/s, {q[1:]}% needed)")
        met = [(p["x_value"], p["goodput_rps"]) for p in ordered
               if (p["extra"] or {}).get("slo_met")]
        if met:
            d.plot(*zip(*met, strict=True), "o", markersize=12, markerfacecolor="none",
                   markeredgecolor="tab:green", label="met the SLO")
    d.set(ylabel="requests/s", title="completed and good requests per second")
    d.set_ylim(bottom=0)
    d.grid(True, alpha=0.3)
    d.legend(fontsize=8)
    for ax in (a, b, c, d):
        _x_axis(ax, xs, "arrival rate, req/s", x_scale)
    return fig


_DRAW = {"prompt": _prompt, "concurrency": _concurrency, "interference": _timeline,
         "rate": _rate, "goodput": _rate}


def draw(run: Row, points: Sequence[Row], x_scale: str | None = None) -> Any:
    """The run's matplotlib figure; raises PlotsUnavailable. `x_scale` ("linear", "log";
    None: the kind's default) applies to sweeps, not to the interference timeline."""
    plt = _pyplot()
    ordered = sorted(points, key=lambda p: p["step"])
    scale = x_scale or DEFAULT_X_SCALE.get(run["kind"], "linear")
    fig = _DRAW[run["kind"]](plt, run, ordered, scale)
    fig.suptitle(_title(run), fontsize=9)
    fig.tight_layout()
    return fig


def write_plots(run: Row, points: Sequence[Row], folder: Path,
                x_scale: str | None = None) -> list[Path]:
    """Draw the run's figure into `folder` as `<run id>.png`; raises PlotsUnavailable."""
    fig = draw(run, points, x_scale)
    plt = _pyplot()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{run['id']}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
