"""The JSON body of every `/api` answer, encoded in one C call (orjson).

The routes declare their response models for the OpenAPI document (`response_model=`) and
return this pre-encoded `Response`, which FastAPI passes through without validating or
encoding it again: validating a large answer into those models would hold the relay's event
loop (about ten times orjson's cost). Invariant: the bytes match the declared models;
tests/api/test_schema.py proves it on real traffic.
"""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import Response


def json_response(payload: Any) -> Response:
    """`payload` as JSON. Times as FastAPI writes them: ISO 8601, UTC as "Z"."""
    return Response(orjson.dumps(payload, option=orjson.OPT_UTC_Z),
                    media_type="application/json")
