"""One task per key, shared by every caller that asks while it runs."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

T = TypeVar("T")


class SingleFlight(Generic[T]):
    """Concurrent calls with the same key share one run of the factory.

    The run is a task of its own: a caller that is cancelled (a client that disconnects) does
    not cancel it. Results and failures are not remembered once the run ends.
    """

    def __init__(self) -> None:
        self._running: dict[Hashable, asyncio.Task[T]] = {}

    def __len__(self) -> int:
        return len(self._running)

    def start(self, key: Hashable, factory: Callable[[], Awaitable[T]]) -> asyncio.Task[T]:
        """The run for `key`, started if none is under way; the caller need not wait for it
        (a prefetch), and its failure is not reported to anyone who does not."""
        task = self._running.get(key)
        if task is None:
            task = asyncio.ensure_future(factory())
            self._running[key] = task
            task.add_done_callback(lambda done: self._forget(key, done))
        return task

    async def run(self, key: Hashable, factory: Callable[[], Awaitable[T]]) -> T:
        """Join the run for `key`, starting it if none is under way."""
        return await asyncio.shield(self.start(key, factory))

    def _forget(self, key: Hashable, task: asyncio.Task[T]) -> None:
        if self._running.get(key) is task:
            del self._running[key]
        if not task.cancelled():
            task.exception()  # mark retrieved: callers that left must not trigger a warning

    async def cancel_all(self) -> None:
        """Cancel every run under way and wait for them to unwind (shutdown)."""
        tasks = list(self._running.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
