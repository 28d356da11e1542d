"""`phasewatch runs compare A B`: what moved between two runs, by how much, beyond the noise.

Points are matched on their x (prompt tokens, streams, rate) and named by it; interference
points are named and matched by phase (before, during, after) and chunked-prefill setting, and
a run of one setting is matched phase by phase with a run of another (comparing chunked prefill
on with off is what the two runs are for). For each figure, the
change is B - A and B / A; the noise is the larger of the two points' spreads between repeats
(max - min of that figure over the repeats of one run). A change of more than twice the noise
is "moved" (with two repeats a range is about one standard deviation, so that is about two);
a smaller one is "within noise"; when either run has a single repeat the noise is unknown and
the change is shown without a verdict. Differences in the runs' parameters and
engine (version, flags) are listed first: a change there explains a change in the figures.
Pure: rows in, text out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from phasewatch.bench.render import Column, ms, num, point_label, table

Row = dict[str, Any]

# (label, point column, key in extra["spread"], unit: "ms" or "" for rates and counts)
FIGURES = (
    ("TTFT p50", "ttft_p50_s", "ttft_p50_s", "ms"),
    ("TTFT p95", "ttft_p95_s", "ttft_p95_s", "ms"),
    ("TTFT p99", "ttft_p99_s", "ttft_p99_s", "ms"),
    ("ITL p50", "itl_p50_s", "itl_p50_s", "ms"),
    ("ITL p95", "itl_p95_s", "itl_p95_s", "ms"),
    ("ITL p99", "itl_p99_s", "itl_p99_s", "ms"),
    ("ITL max", "extra.itl_max_s", "itl_max_s", "ms"),  # interference: the stall
    ("output tok/s", "output_throughput_tps", "output_tps", ""),
    ("total tok/s", "total_throughput_tps", "total_tps", ""),
    ("concurrency", "concurrency", "concurrency_mean", ""),
    ("goodput req/s", "goodput_rps", "goodput_rps", ""),
)
MOVED, WITHIN, UNKNOWN = "moved", "within noise", "noise unknown (1 repeat)"
NOISE_FACTOR = 2.0
SHOWN_MOVES = 8


def _differences(a: Any, b: Any, path: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out: list[str] = []
        for key in sorted(set(a) | set(b)):
            out += _differences(a.get(key), b.get(key), f"{path}.{key}" if path else key)
        return out
    return [] if a == b else [f"{path}: {a!r} -> {b!r}"]


def verdict(a: float, b: float, spread_a: float | None, spread_b: float | None) -> str:
    if spread_a is None or spread_b is None:
        return UNKNOWN
    change = abs(b - a)
    # The relative floor only keeps float dust (a spread of 0.0) from counting as a move.
    moved = change > NOISE_FACTOR * max(spread_a, spread_b) and change > 1e-9 * abs(a)
    return MOVED if moved else WITHIN


def _figure(point: Row, column: str) -> Any:
    if column.startswith("extra."):
        return (point.get("extra") or {}).get(column.removeprefix("extra."))
    return point.get(column)


def _phase_count(points: Sequence[Row], point: Row) -> int:
    return sum(1 for p in points if p["x_name"] == point["x_name"] == "phase"
               and p["x_value"] == point["x_value"])


def _match(pa: Row, points_a: Sequence[Row], points_b: Sequence[Row]) -> tuple[Row, str] | None:
    """A's point's counterpart in B and the name of the pair, if B has one."""
    label = point_label(pa)
    for pb in points_b:
        if point_label(pb) == label:
            return pb, label
    if _phase_count(points_a, pa) == 1:  # one setting each: phase against phase
        found = [pb for pb in points_b if _phase_count(points_b, pb) == 1
                 and pb["x_name"] == "phase" and pb["x_value"] == pa["x_value"]]
        if found:
            a_set = (pa.get("extra") or {}).get("chunked_prefill") or "?"
            b_set = (found[0].get("extra") or {}).get("chunked_prefill") or "?"
            phase = (pa.get("extra") or {}).get("phase")
            return found[0], f"{phase}, chunked prefill {a_set} -> {b_set}"
    return None


def changes(points_a: Sequence[Row], points_b: Sequence[Row]) -> list[Row]:
    """One row per matched point and figure present in both."""
    out: list[Row] = []
    for pa in sorted(points_a, key=lambda p: p["step"]):
        matched = _match(pa, points_a, points_b)
        if matched is None:
            continue
        pb, name = matched
        for label, column, spread_key, unit in FIGURES:
            a, b = _figure(pa, column), _figure(pb, column)
            if a is None or b is None:
                continue
            sa = ((pa.get("extra") or {}).get("spread") or {}).get(spread_key)
            sb = ((pb.get("extra") or {}).get("spread") or {}).get(spread_key)
            out.append({
                "x": name, "figure": label, "unit": unit,
                "a": a, "b": b, "delta": b - a, "ratio": b / a if a else None,
                "noise": None if sa is None or sb is None else max(sa, sb),
                "verdict": verdict(a, b, sa, sb),
            })
    return out


def _value(value: Any, unit: str, signed: bool = False) -> str:
    if value is None:
        return "-"
    text = ms(value, 2) if unit == "ms" else num(value, 2)
    return ("+" + text) if signed and value > 0 else text


def render_compare(run_a: Row, points_a: Sequence[Row], run_b: Row,
                   points_b: Sequence[Row]) -> str:
    lines = [f"A {run_a['id']}  ({run_a['kind']}, {run_a['status']})  {run_a['name']}",
             f"B {run_b['id']}  ({run_b['kind']}, {run_b['status']})  {run_b['name']}"]
    if run_a["kind"] != run_b["kind"]:
        lines.append(f"different kinds of run ({run_a['kind']} and {run_b['kind']}): "
                     "only points with the same x are compared")
    setup = (_differences(run_a["parameters"], run_b["parameters"])
             + _differences(run_a["engine"], run_b["engine"]))
    lines.append("what differs in the setup:" + (" nothing" if not setup else ""))
    lines += [f"  {line}" for line in setup]
    rows = changes(points_a, points_b)
    if not rows:
        return "\n".join([*lines, "no point of A has a matching x in B"]) + "\n"
    columns = [
        Column("point", "x", lambda r: r["x"], left=True),
        Column("point", "figure", lambda r: r["figure"], left=True),
        Column("A -> B (ms for times)", "A", lambda r: _value(r["a"], r["unit"])),
        Column("A -> B (ms for times)", "B", lambda r: _value(r["b"], r["unit"])),
        Column("A -> B (ms for times)", "B - A", lambda r: _value(r["delta"], r["unit"], True)),
        Column("A -> B (ms for times)", "B / A",
               lambda r: "-" if r["ratio"] is None else f"{r['ratio']:.3f}"),
        Column("noise", "repeat spread", lambda r: _value(r["noise"], r["unit"])),
        Column("noise", "verdict", lambda r: r["verdict"], left=True),
    ]
    moved = sorted((r for r in rows if r["verdict"] == MOVED),
                   key=lambda r: -abs((r["ratio"] or 1.0) - 1.0))
    lines += ["", *table(columns, rows), ""]
    if moved:
        shown = [f"{r['x']} {r['figure']} {_value(r['delta'], r['unit'], True)}"
                 f"{' ms' if r['unit'] == 'ms' else ''}"
                 + (f" (x{r['ratio']:.2f})" if r["ratio"] else "") for r in moved[:SHOWN_MOVES]]
        more = f"; and {len(moved) - SHOWN_MOVES} more" if len(moved) > SHOWN_MOVES else ""
        lines.append("moved beyond the noise, largest first: " + "; ".join(shown) + more)
    elif all(r["verdict"] == UNKNOWN for r in rows):
        lines.append("no verdict: run sweeps with --repeats 2 or more to measure the noise")
    else:
        lines.append("nothing moved beyond the noise between repeats")
    return "\n".join(lines) + "\n"
