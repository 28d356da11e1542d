"""A fault that can recur on every pass or connection, logged at most once per interval.

The live registry's pass runs every second and the server accepts connections as fast as they
come: a fault that stays (a stream whose replay keeps failing, a flood over the connection
limit) would otherwise write a line, or a traceback, each time. The first occurrence is logged
at once; after it, at most one per `interval_s`, saying how many went unlogged in between, so
the log shows that the fault goes on and how often without being flooded by it.
"""

from __future__ import annotations

import time


class LogThrottle:
    """Counts occurrences of one fault and says when one should be logged."""

    __slots__ = ("_logged_at", "_unlogged", "count", "interval_s")

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.count = 0  # occurrences in all
        self._unlogged = 0  # since the last one logged
        self._logged_at: float | None = None

    def occurred(self) -> int | None:
        """Count one occurrence. When it should be logged, return how many before it since the
        last logged one went unlogged (0 for the first); else None."""
        self.count += 1
        now = time.monotonic()
        if self._logged_at is not None and now - self._logged_at < self.interval_s:
            self._unlogged += 1
            return None
        unlogged, self._unlogged, self._logged_at = self._unlogged, 0, now
        return unlogged
