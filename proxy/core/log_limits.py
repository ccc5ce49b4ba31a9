"""Log lines that clients can trigger at will, limited so that no client can flood the log."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable


class RateLimitedLog:
    """At most one line per `interval` seconds on logger; the lines in between are only
    counted, and the next line let through says how many there were."""

    def __init__(self, logger: logging.Logger, *, interval: float = 60.0,
                 level: int = logging.WARNING,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._logger = logger
        self._interval = interval
        self._level = level
        self._clock = clock
        self._last: float | None = None  # when the last line went out
        self._suppressed = 0

    @property
    def suppressed(self) -> int:
        """Lines dropped since the last one logged."""
        return self._suppressed

    def log(self, message: str, *args: object) -> bool:
        """Log message % args now, or count it if a line went out less than `interval`
        seconds ago; True when it was logged."""
        now = self._clock()
        if self._last is not None and now - self._last < self._interval:
            self._suppressed += 1
            return False
        if self._suppressed and self._last is not None:
            message += " (%d more like it in the last %ds were not logged)"
            args = (*args, self._suppressed, round(now - self._last))
        self._logger.log(self._level, message, *args)
        self._suppressed = 0
        self._last = now
        return True
