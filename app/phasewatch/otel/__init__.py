"""OpenTelemetry export, optional: the GenAI metrics and a span per request over OTLP/HTTP.

Off unless `PHASEWATCH_OTEL_ENABLED` is on, and it needs the `otel` extra
(`pip install 'phasewatch[otel]'`). Only `export.py` imports OpenTelemetry, and only the app's
lifespan imports `export.py`, when the switch is on: with it off (or the extra absent) no
OpenTelemetry code runs. `conventions.py` is the pinned semantic-convention version.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping

EXTRA_MISSING = ("PHASEWATCH_OTEL_ENABLED is on but OpenTelemetry is not installed: install "
                 "phasewatch's `otel` extra (pip install 'phasewatch[otel]'), or turn it off")


def otel_installed() -> bool:
    """The `otel` extra's packages can be imported (checked without importing them)."""
    try:
        return all(importlib.util.find_spec(name) is not None for name in (
            "opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http"))
    except ModuleNotFoundError:  # a parent package is missing
        return False


class OtelConfigError(RuntimeError):
    """OpenTelemetry is switched on but cannot work as configured; the message says why."""


_PROTOCOL_VARIABLES = ("OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL",
                       "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")


def _exporters(env: Mapping[str, str], variable: str) -> set[str]:
    return {name.strip() for name in env.get(variable, "otlp").split(",") if name.strip()}


def signals(env: Mapping[str, str]) -> tuple[bool, bool]:
    """Whether metrics and traces are exported, by the standard variables:
    OTEL_METRICS_EXPORTER / OTEL_TRACES_EXPORTER (`otlp`, the default, or `none`) and
    OTEL_SDK_DISABLED."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False, False
    return ("otlp" in _exporters(env, "OTEL_METRICS_EXPORTER"),
            "otlp" in _exporters(env, "OTEL_TRACES_EXPORTER"))


def check_otel(env: Mapping[str, str]) -> None:
    """Raise OtelConfigError when OpenTelemetry, switched on, cannot export as `env` asks."""
    if not otel_installed():
        raise OtelConfigError(EXTRA_MISSING)
    for variable in _PROTOCOL_VARIABLES:
        value = env.get(variable, "").strip()
        if value and value != "http/protobuf":
            raise OtelConfigError(
                f"{variable}={value}: phasewatch exports OTLP over HTTP with protobuf only: "
                "set it to http/protobuf (or unset it) and point OTEL_EXPORTER_OTLP_ENDPOINT "
                "at the collector's OTLP/HTTP port (4318 by default)")
    for variable in ("OTEL_METRICS_EXPORTER", "OTEL_TRACES_EXPORTER"):
        unknown = _exporters(env, variable) - {"otlp", "none"}
        if unknown:
            raise OtelConfigError(
                f"{variable}={env[variable]}: phasewatch exports over OTLP only: use otlp, or "
                "none to leave that signal out")
