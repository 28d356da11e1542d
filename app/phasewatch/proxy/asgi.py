"""Small ASGI helpers shared by the relay and the pass-through: headers, bodies, errors."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from random import getrandbits
from typing import Any

import orjson

from phasewatch.core.admin import ADMIN_TOKEN_HEADER

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

# Headers that describe one hop, not the message: never forwarded in either direction.
HOP_BY_HOP = frozenset(
    {
        b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
        b"trailer", b"trailers", b"transfer-encoding", b"upgrade", b"host", b"content-length",
    }
)
REQUEST_ID = b"x-request-id"
RUN_ID = b"x-phasewatch-run-id"
# Request headers for phasewatch alone, never sent upstream.
NOT_FORWARDED = HOP_BY_HOP | {REQUEST_ID, ADMIN_TOKEN_HEADER}


class ClientGone(Exception):
    """The client disconnected before the proxy finished with the request."""


class BodyTooLarge(Exception):
    """The request's body is over the limit (`PHASEWATCH_MAX_BODY_BYTES`)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"request body over {limit} bytes")
        self.limit = limit


CONTENT_LENGTH = b"content-length"


def header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None


def new_request_id() -> str:
    """An id for a request that came without one: 128 random bits, in hex. Not a secret, so
    not from the kernel on each request (os.urandom is a system call)."""
    return f"{getrandbits(128):032x}"


def headers_named(scope: Scope, names: frozenset[bytes]) -> dict[bytes, bytes]:
    """The first value of each of `names` the request carries, in one look at its headers."""
    found: dict[bytes, bytes] = {}
    for key, value in scope["headers"]:
        if key in names and key not in found:
            found[key] = bytes(value)
    return found


def upstream_request_headers(scope: Scope, request_id: str) -> list[tuple[str, str]]:
    headers = [
        (key.decode("latin-1"), value.decode("latin-1"))
        for key, value in scope["headers"]
        if key not in NOT_FORWARDED
    ]
    headers.append(("x-request-id", request_id))
    return headers


def client_response_headers(
    raw: Iterable[tuple[bytes, bytes]], request_id: str, content_length: int | None
) -> list[tuple[bytes, bytes]]:
    headers = [
        (key.lower(), value) for key, value in raw if key.lower() not in HOP_BY_HOP
    ]
    if not any(key == REQUEST_ID for key, _ in headers):
        headers.append((REQUEST_ID, request_id.encode("latin-1")))
    if content_length is not None:
        headers.append((b"content-length", str(content_length).encode()))
    return headers


async def read_body(receive: Receive, declared: bytes | None, limit: int) -> bytes:
    """The whole request body; raises BodyTooLarge as soon as it is known to be over `limit`
    bytes (from its Content-Length, `declared`, or as it is read: never more than that is
    held)."""
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(limit)
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def error_body(message: str, error_type: str, code: int) -> bytes:
    """An error in the OpenAI format, as vLLM and OpenAI send it."""
    return orjson.dumps(
        {"error": {"message": message, "type": error_type, "param": None, "code": code}}
    )


async def send_full(
    send: Send, status: int, headers: list[tuple[bytes, bytes]], body: bytes
) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_error(
    send: Send, status: int, message: str, error_type: str, request_id: str,
    close: bool = False,
) -> None:
    """An error answer in the OpenAI format; `close`: end the connection after it (the rest of
    a refused body is not read)."""
    body = error_body(message, error_type, status)
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (REQUEST_ID, request_id.encode("latin-1")),
    ]
    if close:
        headers.append((b"connection", b"close"))
    await send_full(send, status, headers, body)


async def refuse_body(send: Send, error: BodyTooLarge, request_id: str) -> None:
    await send_error(send, 413, f"request body is larger than {error.limit} bytes "
                     "(PHASEWATCH_MAX_BODY_BYTES)", "invalid_request_error", request_id,
                     close=True)
