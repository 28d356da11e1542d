"""The pass-through's HTTP client: one aiohttp session per app, for the upstream's other paths.

`/v1/models`, `/tokenize`, `/health` and the rest are relayed with aiohttp: they are not on the
hot path. The two timed inference paths go through the relay's own protocol-level connections
(`upstream_pool.py`), which hand each read to the relay from the event loop's read callback
instead of waking a task per chunk as aiohttp's response reader does.
"""

from __future__ import annotations

import aiohttp

from phasewatch.core.settings import Settings


def create_upstream_session(settings: Settings) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(
        limit=settings.upstream_max_connections,  # 0: no cap; a stream holds its connection
        limit_per_host=0,
        ttl_dns_cache=60,
        keepalive_timeout=30,
    )
    # No total timeout here; the pass-through sets aiohttp's own read timeout per request.
    timeout = aiohttp.ClientTimeout(
        total=None,
        connect=None,
        sock_connect=settings.upstream_connect_timeout_s,
        sock_read=None,
    )
    return aiohttp.ClientSession(
        connector=connector,
        timeout=timeout,
        # Relay bodies byte for byte: no decompression, and none of aiohttp's own headers.
        auto_decompress=False,
        skip_auto_headers=("Accept", "Accept-Encoding", "User-Agent", "Content-Type"),
        raise_for_status=False,
    )
