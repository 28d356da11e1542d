"""A time budget for every `/api` route: a call still running after `PHASEWATCH_API_TIMEOUT_S`
is stopped and answered 503 (`query_timeout`) in the OpenAI error format.

The admin API shares the relay's event loop and its database, so no call may hold them for long.
Stopping a call cancels its task, which stops its database query too: asyncpg cancels it on the
server, and an SQLite query is interrupted (app/phasewatch/core/db.py). Routers take part with
`APIRouter(route_class=BudgetedRoute)`; the budget covers the handler (and the setup of its
dependencies), not the sending of the answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

from phasewatch.api.errors import error_response


class BudgetedRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def within_budget(request: Request) -> Response:
            seconds: float = request.app.state.settings.api_timeout_s
            budget = asyncio.timeout(seconds)
            try:
                async with budget:
                    return await handler(request)
            except TimeoutError:
                if not budget.expired():  # a timeout of something else (a connection's)
                    raise
            return error_response(
                503, f"the call took longer than {seconds:g} s (PHASEWATCH_API_TIMEOUT_S) and "
                "was stopped; ask for less: a narrower window, one model, a smaller page",
                "query_timeout")

        return within_budget
