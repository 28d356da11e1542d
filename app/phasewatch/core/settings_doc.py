"""docs/configuration.md, rendered from the settings model: every variable, its default, its
type and bounds, and its description (the field's docstring in settings.py).

`python -m phasewatch.core.settings_doc > docs/configuration.md` (`make configuration`)
writes it; tests/test_settings_and_cli.py fails when the committed page differs.
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from annotated_types import Ge, Gt, Le
from pydantic import AnyHttpUrl, SecretStr
from pydantic.fields import FieldInfo

from phasewatch.core.settings import ENV_PREFIX, Settings

# Each section starts at its first field and runs to the next section's, in declaration order.
SECTIONS = (
    ("Listening and upstream", "upstream_url"),
    ("Clients", "client_head_timeout_s"),
    ("Metrics and export", "slo_ttft_s"),
    ("Operations", "shutdown_grace_s"),
    ("The admin API", "api_max_window_s"),
    ("Storage", "database_url"),
    ("Diagnosis", "diagnosis_interval_s"),
    ("Capacity", "capacity_interval_s"),
)

HEAD = """\
# Configuration

Every setting is an environment variable (a bad value stops phasewatch at startup with a
sentence naming it). This page is generated from the settings model,
`app/phasewatch/core/settings.py`: `make configuration` writes it again, and the tests fail
when it differs from the model."""


def variable(name: str, field: FieldInfo) -> str:
    alias = field.validation_alias
    return alias if isinstance(alias, str) else ENV_PREFIX + name.upper()


def _type(annotation: Any) -> str:
    if get_origin(annotation) in (Union, types.UnionType):
        return " or ".join(_type(a) for a in get_args(annotation) if a is not type(None))
    if get_origin(annotation) is Literal:
        return "one of " + ", ".join(f"`{a}`" for a in get_args(annotation))
    names = {bool: "boolean", int: "integer", float: "number", str: "string",
             AnyHttpUrl: "URL", SecretStr: "secret string", Path: "directory"}
    return names.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _bounds(field: FieldInfo) -> str:
    parts = []
    for item in field.metadata:
        if isinstance(item, Ge):
            parts.append(f">= {item.ge:g}")
        elif isinstance(item, Gt):
            parts.append(f"> {item.gt:g}")
        elif isinstance(item, Le):
            parts.append(f"<= {item.le:g}")
    return ", ".join(parts)


def _default(field: FieldInfo) -> str:
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, float):
        return f"`{value:g}`"
    return f"`{value}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def render() -> str:
    fields = list(Settings.model_fields.items())
    starts = {first: title for title, first in SECTIONS}
    lines = [HEAD]
    for name, field in fields:
        if name in starts:
            lines += ["", f"## {starts[name]}", "", "| variable | default | type | meaning |",
                      "|---|---|---|---|"]
        kind = _type(field.annotation)
        bounds = _bounds(field)
        lines.append(f"| `{variable(name, field)}` | {_default(field)} | "
                     f"{kind}{f' ({bounds})' if bounds else ''} | "
                     f"{_cell(field.description or '')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render(), end="")
