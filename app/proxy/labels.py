"""Bounded model labels: a hostile or mistaken model name must not create unbounded series.

A name earns its own label once the upstream has served it successfully, up to a limit;
everything else (names the upstream rejected, names past the limit) shares `other`.
"""

from __future__ import annotations

OTHER = "other"


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
