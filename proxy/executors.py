"""Thread pools for the proxy's blocking calls, kept apart by how long the calls take: a cache
hit's quick lookup (SQLite, a stat, a small file) never queues behind slow work (hashing or
unpacking a whole package, packing a module, walking the cache).

The app opens the pools for its event loop (`serving`, from its cleanup_ctx) and call sites
just `await quick(fn, *args)` or `await slow(fn, *args)`. Outside a serving app (unit tests,
one-shot commands) there is no hit to protect, and both run on the loop's default executor.
Libraries keep their own use of the default executor (aiofiles, aiohttp's FileResponse, the
threaded DNS resolver): nothing slow of the proxy's runs there any more.
"""

from __future__ import annotations

import asyncio
import contextvars
import os
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


def _cpus() -> int:
    return os.cpu_count() or 1


def default_quick_threads() -> int:
    """Threads for short calls: the standard library's own default for I/O-bound pools (the
    calls mostly wait on SQLite and the file system, not on the CPU)."""
    return min(32, _cpus() + 4)


def default_slow_threads() -> int:
    """Threads for slow work: about one per core, since hashing and (de)compression are CPU
    work (hashlib and zlib release the GIL, so threads do use the cores); at least two, so one
    long job (a big module) does not hold up every other; at most eight, to bound memory and
    disk contention."""
    return max(2, min(8, _cpus()))


class Executors:
    """The two pools: `quick` for short metadata and file-system calls, `slow` for work over
    whole files."""

    def __init__(self, quick_threads: int | None = None,
                 slow_threads: int | None = None) -> None:
        self.quick_pool = ThreadPoolExecutor(quick_threads or default_quick_threads(),
                                             thread_name_prefix="proxy-quick")
        self.slow_pool = ThreadPoolExecutor(slow_threads or default_slow_threads(),
                                            thread_name_prefix="proxy-slow")

    def shutdown(self) -> None:
        """Take no more work: queued jobs are dropped (their callers are gone at shutdown),
        running ones finish in their threads without holding up the event loop."""
        for pool in (self.quick_pool, self.slow_pool):
            pool.shutdown(wait=False, cancel_futures=True)


@dataclass
class _Opened:
    executors: Executors
    apps: int


# The pools of the apps serving on each event loop. Found by loop so that call sites stay
# one-liners; an entry lives only while an app on that loop runs (tests run several apps on
# one loop: they share the pools, and the last one to stop shuts them down).
_serving: dict[asyncio.AbstractEventLoop, _Opened] = {}


@asynccontextmanager
async def serving(quick_threads: int | None = None,
                  slow_threads: int | None = None) -> AsyncIterator[Executors]:
    """The pools that quick() and slow() use on this event loop while the block runs."""
    loop = asyncio.get_running_loop()
    opened = _serving.get(loop)
    if opened is None:
        opened = _serving[loop] = _Opened(Executors(quick_threads, slow_threads), 0)
    opened.apps += 1
    try:
        yield opened.executors
    finally:
        opened.apps -= 1
        if opened.apps == 0:
            del _serving[loop]
            opened.executors.shutdown()


def _pool(loop: asyncio.AbstractEventLoop, slow: bool) -> ThreadPoolExecutor | None:
    opened = _serving.get(loop)
    if opened is None:
        return None  # the loop's default executor
    return opened.executors.slow_pool if slow else opened.executors.quick_pool


def _submit(slow: bool, fn: Callable[P, T], *args: P.args,
            **kwargs: P.kwargs) -> asyncio.Future[T]:
    loop = asyncio.get_running_loop()
    context = contextvars.copy_context()  # as asyncio.to_thread does: log context follows
    return loop.run_in_executor(_pool(loop, slow), lambda: context.run(fn, *args, **kwargs))


async def quick(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """Run a short blocking call (SQLite, a stat, a small file, a directory listing) off the
    event loop. Never pass it work over whole files: hits wait for this pool."""
    return await _submit(False, fn, *args, **kwargs)


def quick_soon(fn: Callable[P, object], *args: P.args, **kwargs: P.kwargs) -> None:
    """Start a short blocking call off the event loop without waiting for it; fn handles its
    own errors."""
    _submit(False, fn, *args, **kwargs)


async def slow(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """Run blocking work over whole files or trees (hashing, unzip, packing, fsync of a
    package, walking the cache) off the event loop, in the pool that hits never wait for."""
    return await _submit(True, fn, *args, **kwargs)
