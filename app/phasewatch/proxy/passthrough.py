"""Everything else the upstream serves (`/v1/models`, `/tokenize`, `/health`, ...), relayed as is.

No timing and no records: method, path, query, headers and body go upstream unchanged, and
the answer comes back unchanged and unbuffered.
"""

from __future__ import annotations

import aiohttp
from yarl import URL

from phasewatch.proxy.asgi import (
    CONTENT_LENGTH,
    REQUEST_ID,
    BodyTooLarge,
    ClientGone,
    Receive,
    Scope,
    Send,
    client_response_headers,
    headers_named,
    new_request_id,
    read_body,
    refuse_body,
    send_error,
    send_full,
    upstream_request_headers,
)
from phasewatch.proxy.context import ProxyContext

_NAMED = frozenset({REQUEST_ID, CONTENT_LENGTH})


async def pass_through(ctx: ProxyContext, scope: Scope, receive: Receive, send: Send) -> None:
    """Relay any request to the same path on the upstream."""
    named = headers_named(scope, _NAMED)
    request_id = named.get(REQUEST_ID, b"").decode("latin-1") or new_request_id()
    try:
        body = await read_body(receive, named.get(CONTENT_LENGTH), ctx.settings.max_body_bytes)
    except ClientGone:
        return
    except BodyTooLarge as exc:
        await refuse_body(send, exc, request_id)
        return
    path: str = scope["path"]
    if not path.startswith("/"):  # `OPTIONS *` (asterisk form) asks about this server itself
        if scope["method"] == "OPTIONS" and path == "*":
            await send_full(send, 204, [(b"allow", b"GET, POST, OPTIONS"),
                                        (REQUEST_ID, request_id.encode("latin-1"))], b"")
        else:
            await send_error(send, 400, "the request target must be a path",
                             "invalid_request_error", request_id)
        return
    # The path as the client wrote it, percent-escapes and all (`/v1%2Fmodels` is not
    # `/v1/models`), and not quoted again on the way.
    raw: bytes = scope.get("raw_path") or path.encode()
    url = ctx.upstream + raw.decode("latin-1")
    if scope.get("query_string"):
        url += "?" + scope["query_string"].decode("latin-1")
    try:
        response = await ctx.session.request(
            scope["method"], URL(url, encoded=True), data=body or None,
            headers=upstream_request_headers(scope, request_id),
            timeout=ctx.passthrough_timeout,  # not a hot path: aiohttp's own idle timer
        )
    except TimeoutError:
        await send_error(send, 504, f"upstream {ctx.upstream} timed out", "upstream_timeout",
                         request_id)
        return
    except aiohttp.ClientError as exc:
        await send_error(send, 502, f"upstream {ctx.upstream} is unreachable: {exc}",
                         "upstream_unreachable", request_id)
        return
    try:
        length = response.content_length
        headers = client_response_headers(response.raw_headers, request_id, length)
        await send({"type": "http.response.start", "status": response.status,
                    "headers": headers})
        async for data in response.content.iter_any():
            await send({"type": "http.response.body", "body": data, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        response.release()
    finally:
        response.close()
