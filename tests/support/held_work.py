"""Slow work whose length a test controls: a blocking function wrapped so that every call waits
(in whatever thread runs it) until the test releases it."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Generic, ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


class HeldCalls(Generic[P, T]):
    """Calls of fn that block until release() (those `holds` picks; others run at once), then
    run fn; counts the held calls and records the threads they ran in."""

    def __init__(self, fn: Callable[P, T], holds: Callable[P, bool] | None = None,
                 limit: float = 60.0) -> None:
        self._fn = fn
        self._holds = holds
        self._limit = limit  # never hold a thread forever, whatever the test does
        self._gate = threading.Event()
        self._lock = threading.Lock()
        self.started = 0
        self.finished = 0
        self.threads: list[str] = []

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> T:
        if self._holds is not None and not self._holds(*args, **kwargs):
            return self._fn(*args, **kwargs)
        with self._lock:
            self.started += 1
            self.threads.append(threading.current_thread().name)
        self._gate.wait(self._limit)
        try:
            return self._fn(*args, **kwargs)
        finally:
            with self._lock:
                self.finished += 1

    def release(self) -> None:
        """Let every held call (and every later one) run."""
        self._gate.set()

    async def settled(self, minimum: int, quiet: float = 0.5, within: float = 30.0) -> int:
        """Wait until at least `minimum` calls are held and no new one started for `quiet`
        seconds (the threads that run them are all taken); returns how many are held."""
        deadline = time.monotonic() + within
        seen, since = -1, time.monotonic()
        while time.monotonic() < deadline:
            if self.started != seen:
                seen, since = self.started, time.monotonic()
            elif seen >= minimum and time.monotonic() - since >= quiet:
                return seen
            await asyncio.sleep(0.02)
        raise AssertionError(f"only {self.started} held call(s) started within {within}s "
                             f"(wanted at least {minimum})")
