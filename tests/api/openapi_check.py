"""Validate phasewatch's `/api` answers against its own `/openapi.json`, strictly.

The document FastAPI emits is OpenAPI 3.1, whose schemas are JSON Schema 2020-12: each answer
is validated (jsonschema) against the schema its path declares for its status, `$ref`s resolved
in the document itself through a referencing Registry. Strictly, in the tests' view: an object
schema that lists its properties allows no others, so a field an answer has and the document
does not declare fails the test (the document cannot fall behind the code), and a `date-time`
must be one (ISO 8601 with its offset, as RFC 3339 wants).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import httpx
from jsonschema import Draft202012Validator, FormatChecker  # type: ignore[import-untyped]
from jsonschema.exceptions import ValidationError  # type: ignore[import-untyped]
from referencing import Registry
from referencing.jsonschema import DRAFT202012

DOC_URI = "urn:phasewatch:openapi"

# The keywords of JSON Schema 2020-12 whose values are schemas: maps of them, one, or lists.
_MAPS = ("properties", "patternProperties", "$defs", "dependentSchemas")
_ONE = ("items", "additionalProperties", "unevaluatedProperties", "not", "contains",
        "propertyNames", "if", "then", "else")
_MANY = ("anyOf", "allOf", "oneOf", "prefixItems")

FORMATS = FormatChecker(formats=())


@FORMATS.checks("date-time", raises=ValueError)  # type: ignore[untyped-decorator]
def _date_time(value: object) -> bool:
    return not isinstance(value, str) or datetime.fromisoformat(value).tzinfo is not None


def closed(schema: Any) -> Any:
    """A copy of `schema` in which every object schema with `properties` allows no others
    (unless it says what others it allows: a free-form object stays free-form)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _MAPS:
        if key in out:
            out[key] = {name: closed(sub) for name, sub in out[key].items()}
    for key in _ONE:
        if key in out:
            out[key] = closed(out[key])
    for key in _MANY:
        if key in out:
            out[key] = [closed(sub) for sub in out[key]]
    if "properties" in out:
        out.setdefault("additionalProperties", False)
    return out


def _deepest(error: ValidationError) -> ValidationError:
    """Where an `anyOf` failed: among the branches whose type the value has (a dict is no
    null), the complaint deepest in the value."""
    while error.context:
        fitting = [e for e in error.context
                   if not (e.validator == "type" and not e.relative_path)]
        if not fitting:
            break
        error = max(fitting, key=lambda e: len(e.absolute_path))
    return error


def _pointer(*parts: str) -> str:
    return "".join("/" + part.replace("~", "~0").replace("/", "~1") for part in parts)


class ApiSchema:
    """An OpenAPI document, and the validators of what its paths declare."""

    def __init__(self, doc: dict[str, Any]) -> None:
        self.doc = doc
        strict = {**doc, "components": {**doc["components"], "schemas": {
            name: closed(schema) for name, schema in doc["components"]["schemas"].items()}}}
        self.registry: Registry[Any] = Registry().with_resource(
            DOC_URI, DRAFT202012.create_resource(strict))

    def validator(self, pointer: str) -> Draft202012Validator:
        return Draft202012Validator({"$ref": f"{DOC_URI}#{pointer}"}, registry=self.registry,
                                    format_checker=FORMATS)

    def problems(self, instance: Any, pointer: str) -> list[str]:
        """Every way `instance` breaks the schema at `pointer` (empty: it matches). Where it
        matches none of several schemas (a report, or a list of them), the likeliest one's
        deepest complaint."""
        found = []
        for error in self.validator(pointer).iter_errors(instance):
            deepest = _deepest(error)
            where = "/".join(map(str, deepest.absolute_path)) or "(top)"
            found.append(f"{where}: {deepest.message}")
        return sorted(found)

    def component(self, name: str) -> str:
        return _pointer("components", "schemas", name)

    def answer(self, path: str, status: int, method: str = "get") -> str:
        """The pointer to the schema `path` declares for `status`."""
        return _pointer("paths", path, method, "responses", str(status), "content",
                        "application/json", "schema")

    def check(self, response: httpx.Response, path: str, method: str = "get") -> Any:
        """The answer's JSON, after failing unless its status is declared for `path` and its
        body matches the schema declared for that status. `path` as the document has it
        (`/api/runs/{run_id}`)."""
        declared = self.doc["paths"][path][method]["responses"]
        status = response.status_code
        assert str(status) in declared, f"{path} answered {status}, which it does not declare"
        assert response.headers["content-type"] == "application/json", response.headers
        body = response.json()
        problems = self.problems(body, self.answer(path, status, method))
        assert not problems, f"{path} ({status}) does not match its schema:\n" + "\n".join(
            problems[:20])
        return body
