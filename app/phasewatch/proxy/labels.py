"""Bounded model labels: a hostile or mistaken model name must not create unbounded series.

`model_name` is the one form of a requested model's name that phasewatch keeps, the same for
metrics, records and the diagnosis: control characters (NUL included) replaced by U+FFFD and
at most `MODEL_NAME_MAX` characters (a longer one is cut and ends in `…`). The request itself
goes upstream unchanged. A name earns its own label once the upstream has served it
successfully, up to a limit; everything else (names the upstream rejected, names past the
limit) shares `other`.
"""

from __future__ import annotations

import re

OTHER = "other"
MODEL_NAME_MAX = 128
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def model_name(value: object) -> str | None:
    """The name phasewatch keeps for a request's `model` field; None when it is not a string."""
    if not isinstance(value, str):
        return None
    if len(value) > MODEL_NAME_MAX:
        value = value[: MODEL_NAME_MAX - 1] + "\u2026"
    # A printable name holds no control character (they are all unprintable): nearly every
    # name, kept without the substitution's pass.
    return value if value.isprintable() else _CONTROL.sub("\ufffd", value)


class ModelLabels:
    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._admitted: set[str] = set()

    def label(self, model: str | None, served: bool) -> str:
        """The label for `model`; `served` says whether the upstream answered it with 2xx."""
        if not model:
            return OTHER
        if model in self._admitted:
            return model
        if served and len(self._admitted) < self._limit:
            self._admitted.add(model)
            return model
        return OTHER
