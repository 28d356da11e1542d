"""PNG plots of a run, drawn from its rows with matplotlib's Agg backend (no display needed).

One figure per kind of run: TTFT and ITL against prompt length; ITL, throughput and TTFT
against concurrency; the short client's gaps against time around the long prefill; TTFT and
ITL quantiles, throughput and goodput against the request rate, with the SLO lines. matplotlib
comes with the optional `bench` extra: without it `write_plots` returns no paths and says why.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

Row = dict[str, Any]


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


def _log2_x(ax: Any, xs: Sequence[float]) -> None:
    """A log-2 axis labelled with the values swept, not powers of two."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(xs), [f"{x:g}" for x in xs])
    ax.minorticks_off()


def _title(run: Row) -> str:
    sim = (run["engine"] or {}).get("sim")
    where = f"{sim['gpu']} (simulated)" if sim else run["target"]
    clock = " - model time" if run["parameters"].get("clock") == "model" else ""
    return f"{run['id']}: {run['parameters'].get('model')} on {where}{clock}"


def _prompt(plt: Any, run: Row, points: Sequence[Row]) -> Any:
    xs = [p["x_value"] for p in points]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    _lines(a, xs, [("TTFT p50", _ms(points, "ttft_p50_s")),
                   ("TTFT p99", _ms(points, "ttft_p99_s"))])
    a.set(xlabel="prompt tokens", ylabel="ms", title="TTFT against prompt length (prefill)")
    _lines(b, xs, [("ITL p50", _ms(points, "itl_p50_s")), ("ITL p99", _ms(points, "itl_p99_s"))])
    b.set(xlabel="prompt tokens", ylabel="ms", title="ITL against prompt length (decode)")
    b.set_ylim(bottom=0)
    for ax in (a, b):
        _log2_x(ax, xs)
    return fig


def _concurrency(plt: Any, run: Row, points: Sequence[Row]) -> Any:
    xs = [p["x_value"] for p in points]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4.2))
    _lines(a, xs, [("ITL p50", _ms(points, "itl_p50_s")), ("ITL p95", _ms(points, "itl_p95_s"))])
    a.set(xlabel="concurrent streams", ylabel="ms", title="ITL against concurrency")
    a.set_ylim(bottom=0)
    _lines(b, xs, [("output", [p["output_throughput_tps"] for p in points]),
                   ("total", [p["total_throughput_tps"] for p in points])])
    b.set(xlabel="concurrent streams", ylabel="tokens/s", title="throughput against concurrency")
    _lines(c, xs, [("TTFT p50", _ms(points, "ttft_p50_s")),
                   ("TTFT p95", _ms(points, "ttft_p95_s"))])
    c.set(xlabel="concurrent streams", ylabel="ms", title="TTFT against concurrency")
    for ax in (a, b, c):
        _log2_x(ax, xs)
    return fig


def _timeline(plt: Any, run: Row, points: Sequence[Row]) -> Any:
    timelines = (run["summary"] or {}).get("timelines") or []
    fig, ax = plt.subplots(figsize=(11, 4.2))
    colors = ("tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown")
    for index, line in enumerate(timelines):
        # Each gap is drawn over the time it lasted (its end minus its length to its end).
        ends = [t for t, _ in line["gaps"]]
        heights = [g * 1e3 for _, g in line["gaps"]]
        color = colors[index % len(colors)]
        ax.hlines(heights, [t - g / 1e3 for t, g in zip(ends, heights, strict=True)], ends,
                  colors=color, linewidth=1.5, label=f"repeat {index + 1}")
        ax.plot(ends, heights, ".", color=color, markersize=3)
        ax.axvspan(0.0, line["long_first_token_s"], color="tab:red", alpha=0.08)
    ax.set(xlabel="seconds since the long prompt arrived (shaded: until its first token)",
           ylabel="short client's gap between tokens, ms",
           title="a short stream's gaps around a long prefill")
    ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def _rate(plt: Any, run: Row, points: Sequence[Row]) -> Any:
    ordered = sorted(points, key=lambda p: p["x_value"])
    xs = [p["x_value"] for p in ordered]
    slo = (run["summary"] or {}).get("slo") or {}
    q = slo.get("quantile", "p95")
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4.2))
    _lines(a, xs, [(f"TTFT {q}", _ms(ordered, f"ttft_{q}_s")),
                   ("TTFT p50", _ms(ordered, "ttft_p50_s"))])
    _lines(b, xs, [(f"ITL {q}", _ms(ordered, f"itl_{q}_s")),
                   ("ITL p50", _ms(ordered, "itl_p50_s"))])
    if slo:
        for ax, key, limit in ((a, f"ttft_{q}_s", slo["ttft_s"]), (b, f"itl_{q}_s", slo["itl_s"])):
            ax.axhline(limit * 1e3, color="tab:red", linestyle=":", label=f"SLO ({q})")
            over = [(p["x_value"], p[key] * 1e3) for p in ordered
                    if p.get(key) is not None and p[key] > limit]
            if over:
                ax.plot(*zip(*over, strict=True), "rx", markersize=9, label="over the SLO")
            ax.legend(fontsize=8)
    a.set(xlabel="arrival rate, req/s", ylabel="ms", title="TTFT against load")
    b.set(xlabel="arrival rate, req/s", ylabel="ms", title="ITL against load")
    series = [("output tok/s", [p["output_throughput_tps"] for p in ordered])]
    _lines(c, xs, series)
    c.set(xlabel="arrival rate, req/s", ylabel="tokens/s", title="throughput")
    if any(p["goodput_rps"] is not None for p in ordered):
        twin = c.twinx()
        twin.plot(xs, [p["goodput_rps"] or 0 for p in ordered], "g^--", label="goodput req/s")
        twin.set_ylabel("goodput, req/s")
        twin.legend(fontsize=8, loc="lower right")
    return fig


_DRAW = {"prompt": _prompt, "concurrency": _concurrency, "interference": _timeline,
         "rate": _rate, "goodput": _rate}


def write_plots(run: Row, points: Sequence[Row], folder: Path) -> list[Path]:
    """Draw the run's figure into `folder` as `<run id>.png`; raises PlotsUnavailable."""
    plt = _pyplot()
    ordered = sorted(points, key=lambda p: p["step"])
    fig = _DRAW[run["kind"]](plt, run, ordered)
    fig.suptitle(_title(run), fontsize=9)
    fig.tight_layout()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{run['id']}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
