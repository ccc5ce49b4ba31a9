"""Log lines that clients can trigger at will, limited so that no client can flood the log."""

from __future__ import annotations

import functools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable


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


class KeyedRateLimitedLog:
    """A RateLimitedLog per key (e.g. an artifact and why it failed): each key at most one
    line per `interval` seconds, with the count of its dropped lines; on top, at most
    `max_lines` lines per interval over all keys, so that many distinct keys cannot flood
    the log either. At most `max_keys` keys are remembered (the least recently used go)."""

    def __init__(self, logger: logging.Logger, *, interval: float = 60.0,
                 level: int = logging.WARNING, max_keys: int = 1024, max_lines: int = 100,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._new_limit = functools.partial(RateLimitedLog, logger, interval=interval,
                                            level=level, clock=clock)
        self._interval, self._clock = interval, clock
        self._max_keys, self._max_lines = max_keys, max_lines
        self._limits: OrderedDict[Hashable, RateLimitedLog] = OrderedDict()
        self._window_start: float | None = None
        self._window_lines = 0
        self._overflow = 0  # lines dropped by the overall bound since the last one logged

    def log(self, key: Hashable, message: str, *args: object) -> bool:
        """Log message % args unless key had a line less than `interval` seconds ago, or the
        overall bound is reached; True when it was logged."""
        now = self._clock()
        if self._window_start is None or now - self._window_start >= self._interval:
            self._window_start, self._window_lines = now, 0
        limited = self._limits.get(key)
        if limited is None:
            limited = self._limits[key] = self._new_limit()
            if len(self._limits) > self._max_keys:
                self._limits.popitem(last=False)
        else:
            self._limits.move_to_end(key)
        if self._window_lines >= self._max_lines:
            self._overflow += 1
            return False
        if self._overflow:
            message += " (%d other warnings were not logged: too many at once)"
            args = (*args, self._overflow)
        if not limited.log(message, *args):
            return False
        self._overflow = 0
        self._window_lines += 1
        return True
