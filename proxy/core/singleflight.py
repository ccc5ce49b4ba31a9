"""One fill per artifact: concurrent callers with the same key share one run, which is a task
of its own (detached from every caller), optionally exclusive across processes, and may hand
its callers a value before it ends (a growing spool they read while the fill writes it).

Keys are artifact identities: origin host, namespace, type, version, os and arch of a
package; a module's address and version; a SHA256SUMS id. Results and failures are not
remembered once the run ends: the next caller starts a new run.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from contextlib import AbstractAsyncContextManager
from typing import Any, Generic, TypeVar

T = TypeVar("T")

# Holds the cross-process part of a fill (a lock file today, a store lease later).
Exclusive = Callable[[Hashable], AbstractAsyncContextManager[Any]]
# Hands callers their answer before the fill ends; the first call wins.
Offer = Callable[[T], None]


class _Flight(Generic[T]):
    """One run: its task, and the answer its callers wait for (offered early, or its end)."""

    def __init__(self, task: asyncio.Task[T], answer: asyncio.Future[T]) -> None:
        self.task = task
        self.answer = answer


class SingleFlight(Generic[T]):
    """Concurrent calls with the same key share one run of the fill.

    The run is a task of its own: a caller that is cancelled (a client that disconnects) does
    not cancel it. With `exclusive`, each run holds exclusive(key) while it fills, so that
    processes sharing the store fill an artifact one at a time.
    """

    def __init__(self, exclusive: Exclusive | None = None) -> None:
        self._exclusive = exclusive
        self._flights: dict[Hashable, _Flight[T]] = {}
        # Every run under way, including one a newer run for its key replaced (see `stale`).
        self._tasks: set[asyncio.Task[T]] = set()

    def __len__(self) -> int:
        return len(self._flights)

    def start(self, key: Hashable, fill: Callable[[], Awaitable[T]]) -> asyncio.Future[T]:
        """The answer of the run for `key`, started if none is under way; the caller need not
        wait for it (a prefetch), and its failure is not reported to anyone who does not."""
        return self._join(key, lambda _offer: fill(), None).answer

    async def run(self, key: Hashable, fill: Callable[[], Awaitable[T]]) -> T:
        """Join the run for `key`, starting it if none is under way."""
        return await asyncio.shield(self.start(key, fill))

    async def run_streaming(self, key: Hashable, fill: Callable[[Offer[T]], Awaitable[T]],
                            stale: Callable[[T], bool] | None = None) -> T:
        """Join the run for `key`, starting it if none is under way. The fill may `offer` its
        callers an answer before it ends (a spool they follow); otherwise they get its result.
        A run whose offered answer is `stale` (its file already left the store) is not joined:
        a new run starts, and the old one finishes on its own."""
        return await asyncio.shield(self._join(key, fill, stale).answer)

    def _join(self, key: Hashable, fill: Callable[[Offer[T]], Awaitable[T]],
              stale: Callable[[T], bool] | None) -> _Flight[T]:
        flight = self._flights.get(key)
        if flight is not None and not (stale is not None and _answered(flight.answer)
                                       and stale(flight.answer.result())):
            return flight
        answer: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        answer.add_done_callback(retrieved)  # callers that left must not leave a warning

        def offer(value: T) -> None:
            if not answer.done():
                answer.set_result(value)

        task = asyncio.ensure_future(self._fill(key, fill, offer))
        flight = _Flight(task, answer)
        self._flights[key] = flight
        self._tasks.add(task)
        task.add_done_callback(lambda done: self._ended(key, flight))
        return flight

    async def _fill(self, key: Hashable, fill: Callable[[Offer[T]], Awaitable[T]],
                    offer: Offer[T]) -> T:
        if self._exclusive is None:
            return await fill(offer)
        async with self._exclusive(key):
            return await fill(offer)

    def _ended(self, key: Hashable, flight: _Flight[T]) -> None:
        self._tasks.discard(flight.task)
        if self._flights.get(key) is flight:
            del self._flights[key]
        task, answer = flight.task, flight.answer
        if task.cancelled():
            answer.cancel()  # a no-op once an answer was offered
            return
        error = task.exception()  # also marks it retrieved
        if answer.done():
            return
        if error is not None:
            answer.set_exception(error)
        else:
            answer.set_result(task.result())

    async def cancel_all(self, finish: Callable[[T], bool] | None = None) -> None:
        """Cancel every run under way and wait for them to unwind (shutdown). A run that
        already offered an answer that `finish` accepts is let finish instead (what is left
        of it is short and worth having, as the hash of a file it published)."""
        finishing = {flight.task for flight in self._flights.values()
                     if finish is not None and _answered(flight.answer)
                     and finish(flight.answer.result())}
        tasks = list(self._tasks)
        for task in tasks:
            if task not in finishing:
                task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


def _answered(answer: asyncio.Future[Any]) -> bool:
    return answer.done() and not answer.cancelled() and answer.exception() is None


def retrieved(future: asyncio.Future[Any]) -> None:
    """A done callback: future's exception counts as seen (asyncio warns of one that no one
    retrieved), for futures whose caller may have left before they failed."""
    if not future.cancelled():
        future.exception()
