"""Everything else the upstream serves (`/v1/models`, `/tokenize`, `/health`, ...), relayed as is.

No timing and no records: method, path, query, headers and body go upstream unchanged, and
the answer comes back unchanged and unbuffered.
"""

from __future__ import annotations

import uuid

import aiohttp

from app.proxy.asgi import (
    REQUEST_ID,
    ClientGone,
    Receive,
    Scope,
    Send,
    client_response_headers,
    header,
    read_body,
    send_error,
    upstream_request_headers,
)
from app.proxy.context import ProxyContext


async def pass_through(ctx: ProxyContext, scope: Scope, receive: Receive, send: Send) -> None:
    """Relay any request to the same path on the upstream."""
    request_id = (header(scope, REQUEST_ID) or b"").decode("latin-1") or uuid.uuid4().hex
    try:
        body = await read_body(receive)
    except ClientGone:
        return
    url = ctx.upstream + scope["path"]
    if scope.get("query_string"):
        url += "?" + scope["query_string"].decode("latin-1")
    try:
        response = await ctx.session.request(
            scope["method"], url, data=body or None,
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
