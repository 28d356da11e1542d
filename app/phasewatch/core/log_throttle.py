"""A fault that can recur on every chunk, pass, request or connection, logged at most once per
interval.

A fault that stays (a metrics observation that keeps raising, a stream whose replay keeps
failing, a flood over the connection limit) would otherwise write a line, or a traceback, each
time it recurs: per token, per pass of the live registry, per request. The first occurrence is
logged at once; after it, at most one per `interval_s`, saying how many like it went unlogged
in between, so the log shows that the fault goes on and how often without being flooded by it.
"""

from __future__ import annotations

import logging
import time

# The interval of a fault whose occurrences are all alike: one traceback a minute shows it.
FAULT_LOG_INTERVAL_S = 60.0


class LogThrottle:
    """Counts occurrences of one fault and says when one should be logged."""

    __slots__ = ("_logged_at", "_unlogged", "count", "interval_s")

    def __init__(self, interval_s: float = FAULT_LOG_INTERVAL_S) -> None:
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

    def exception(self, logger: logging.Logger, message: str, *args: object,
                  level: int = logging.ERROR) -> None:
        """Log the exception being handled, with its traceback (as `logger.exception(message,
        *args)`, at `level`), unless one was logged within the interval; the line says how
        many went unlogged since the last."""
        unlogged = self.occurred()
        if unlogged:
            logger.log(level, message + " (and %d more since the last logged)", *args, unlogged,
                       exc_info=True)
        elif unlogged is not None:
            logger.log(level, message, *args, exc_info=True)
