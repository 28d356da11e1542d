"""Who may use phasewatch's admin surface: its `/api` (records, runs, stats, diagnosis), the API
docs, and the run-id header that files a request under a benchmark run.

One of three modes, from the settings:
- closed (the default): nobody; the answer says how to open it;
- token (`PHASEWATCH_ADMIN_TOKEN`): callers that send it, as `x-phasewatch-admin-token` or, on
  `/api` routes, `Authorization: Bearer`. On inference requests only the first counts: their
  `Authorization` belongs to the upstream;
- open (`PHASEWATCH_ADMIN_OPEN=true`): everyone, for a trusted network or a laptop.
Liveness, readiness and `/metrics` are not admin routes. The token is compared in constant
time, never forwarded upstream, never stored or logged.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from enum import Enum

ADMIN_TOKEN_HEADER = b"x-phasewatch-admin-token"
ADMIN_PATHS = ("/api/", "/docs", "/redoc", "/openapi.json")
PUBLIC_PATHS = ("/api/health", "/api/ready")


class AdminMode(Enum):
    CLOSED = "closed"
    TOKEN = "token"
    OPEN = "open"


class AdminAccess:
    def __init__(self, token: str | None, open_to_all: bool) -> None:
        self._token = token.encode() if token else None
        self.mode = (AdminMode.TOKEN if self._token else
                     AdminMode.OPEN if open_to_all else AdminMode.CLOSED)

    def allows(self, headers: Iterable[tuple[bytes, bytes]], bearer: bool = True) -> bool:
        """Whether a request with these (lower-case) headers may use the admin surface;
        `bearer`: an `Authorization: Bearer` token counts too."""
        if self.mode is not AdminMode.TOKEN:
            return self.mode is AdminMode.OPEN
        assert self._token is not None
        for name, value in headers:
            if name == ADMIN_TOKEN_HEADER:
                given = value
            elif bearer and name == b"authorization" and value[:7].lower() == b"bearer ":
                given = value[7:].strip()
            else:
                continue
            if hmac.compare_digest(given, self._token):
                return True
        return False

    def refusal(self) -> tuple[int, str]:
        """The status and message for a caller that is not allowed."""
        if self.mode is AdminMode.CLOSED:
            return 403, ("phasewatch's admin API is closed: set PHASEWATCH_ADMIN_TOKEN and send "
                         "it as x-phasewatch-admin-token (or Authorization: Bearer), or set "
                         "PHASEWATCH_ADMIN_OPEN=true on a trusted network")
        return 401, "missing or wrong admin token (x-phasewatch-admin-token)"


def is_admin_path(path: str) -> bool:
    return path.startswith(ADMIN_PATHS) and not path.startswith(PUBLIC_PATHS)
