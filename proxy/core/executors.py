"""Thread pools for the proxy's blocking calls, kept apart by how long the calls take: a cache
hit's quick calls (SQLite, an open, a small file) never queue behind slow work (hashing or
unpacking a whole package, packing a module, walking the cache), nor behind name lookups that
hang with an unreachable DNS server.

The app opens the pools for its event loop (`serving`, from its cleanup_ctx) and call sites
just `await quick(fn, *args)`, `await slow(fn, *args)` or `await dns(fn, *args)`. Outside a
serving app (unit tests, one-shot commands) there is no hit to protect, and all run on the
loop's default executor. A hit uses no thread but the quick pool's: asyncio's default
executor, where libraries run their own blocking calls (aiofiles on the fill path), may fill
up without holding up a hit.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
import sys
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Literal, ParamSpec, Protocol, TypeVar

from proxy.core.cpus import available_cpus

P = ParamSpec("P")
T = TypeVar("T")


def default_quick_threads() -> int:
    """Threads for short calls: the standard library's own default for I/O-bound pools (the
    calls mostly wait on SQLite and the file system, not on the CPU)."""
    return min(32, available_cpus() + 4)


def default_slow_threads() -> int:
    """Threads for slow work: about one per core, since hashing and (de)compression are CPU
    work (hashlib and zlib release the GIL, so threads do use the cores); at least two, so one
    long job (a big module) does not hold up every other; at most eight, to bound memory and
    disk contention."""
    return max(2, min(8, available_cpus()))


# Name lookups wait on the network, up to the resolver's own timeouts (many seconds each when
# a DNS server does not answer): a fixed few threads, enough for the few upstream hosts (the
# outbound session keeps answers for a minute); more lookups wait their turn.
DNS_THREADS = 8
# Work nobody waits for (the h1 pass after a fill): at the lowest CPU priority, so that on a
# busy machine it takes the cores only when the clients it would compete with leave them;
# two threads, for fills that finish together.
BACKGROUND_THREADS = 2
_LOWEST_PRIORITY = 19
# How long on_each_quick_thread's jobs wait for each other at most (seconds).
_PREPARE_WAIT = 2.0

log = logging.getLogger(__name__)


def _lowest_priority() -> None:
    """Make the calling thread the least urgent on the machine (Linux: a thread's own nice
    value; it can never be raised again, so the thread must serve only background work)."""
    if sys.platform != "linux":  # elsewhere PRIO_PROCESS would renice the whole process
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _LOWEST_PRIORITY)
    except OSError as exc:  # a sandbox that forbids it: background work runs at normal speed
        log.debug("cannot lower the background threads' priority: %s", exc)


class Executors:
    """The pools: `quick` for short metadata and file-system calls, `slow` for work over
    whole files, `dns` for name lookups, `background` (lowest priority) for work over whole
    files that no client waits for."""

    def __init__(self, quick_threads: int | None = None, slow_threads: int | None = None,
                 dns_threads: int | None = None) -> None:
        self.quick_threads = quick_threads or default_quick_threads()
        self.quick_pool = ThreadPoolExecutor(self.quick_threads,
                                             thread_name_prefix="proxy-quick")
        self.quick_prepared = False  # every quick thread started (on_each_quick_thread)
        self.slow_pool = ThreadPoolExecutor(slow_threads or default_slow_threads(),
                                            thread_name_prefix="proxy-slow")
        self.dns_pool = ThreadPoolExecutor(dns_threads or DNS_THREADS,
                                           thread_name_prefix="proxy-dns")
        self.background_pool = ThreadPoolExecutor(BACKGROUND_THREADS,
                                                  thread_name_prefix="proxy-background",
                                                  initializer=_lowest_priority)

    def shutdown(self) -> None:
        """Take no more work: queued jobs are dropped (their callers are gone at shutdown),
        running ones finish in their threads without holding up the event loop."""
        for pool in (self.quick_pool, self.slow_pool, self.dns_pool, self.background_pool):
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
async def serving(quick_threads: int | None = None, slow_threads: int | None = None,
                  dns_threads: int | None = None) -> AsyncIterator[Executors]:
    """The pools that quick(), slow() and dns() use on this event loop while the block runs."""
    loop = asyncio.get_running_loop()
    opened = _serving.get(loop)
    if opened is None:
        opened = _serving[loop] = _Opened(Executors(quick_threads, slow_threads, dns_threads),
                                          0)
    opened.apps += 1
    try:
        yield opened.executors
    finally:
        opened.apps -= 1
        if opened.apps == 0:
            del _serving[loop]
            opened.executors.shutdown()


Pool = Literal["quick", "slow", "dns", "background"]


def _pool(loop: asyncio.AbstractEventLoop, pool: Pool) -> ThreadPoolExecutor | None:
    opened = _serving.get(loop)
    if opened is None:
        return None  # the loop's default executor
    executors = opened.executors
    return {"quick": executors.quick_pool, "slow": executors.slow_pool,
            "dns": executors.dns_pool, "background": executors.background_pool}[pool]


def _submit(pool: Pool, fn: Callable[P, T], *args: P.args,
            **kwargs: P.kwargs) -> asyncio.Future[T]:
    loop = asyncio.get_running_loop()
    context = contextvars.copy_context()  # as asyncio.to_thread does: log context follows
    return loop.run_in_executor(_pool(loop, pool), lambda: context.run(fn, *args, **kwargs))


async def on_each_quick_thread(prepare: Callable[[], object]) -> None:
    """prepare() once on every thread of the quick pool, each started now: at start-up, once
    per set of pools. A fresh worker's first cold package waited for a thread to start, then
    for that thread's first SQLite connection, about a millisecond each on a busy machine."""
    loop = asyncio.get_running_loop()
    opened = _serving.get(loop)
    if opened is None or opened.executors.quick_prepared:
        return
    opened.executors.quick_prepared = True
    count = opened.executors.quick_threads
    together = threading.Barrier(count)

    def each() -> None:
        prepare()
        # Held until every job runs: each on a thread of its own. A thread that is busy
        # elsewhere only makes the others wait this long, once.
        with contextlib.suppress(threading.BrokenBarrierError):
            together.wait(timeout=_PREPARE_WAIT)

    await asyncio.gather(*(_submit("quick", each) for _ in range(count)))


async def quick(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """Run a short blocking call (SQLite, a stat, a small file, a directory listing) off the
    event loop. Never pass it work over whole files: hits wait for this pool."""
    return await _submit("quick", fn, *args, **kwargs)


def quick_started(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> asyncio.Future[T]:
    """Start quick(fn, ...) and return its future, to await later (or not at all)."""
    return _submit("quick", fn, *args, **kwargs)


def quick_soon(fn: Callable[P, object], *args: P.args, **kwargs: P.kwargs) -> None:
    """Start a short blocking call off the event loop without waiting for it; fn handles its
    own errors. Once the pools are shut down (or off a loop), it runs now: what is handed
    here is cleanup (a close, an unlink) that must not be lost at shutdown."""
    try:
        _submit("quick", fn, *args, **kwargs)
    except RuntimeError:
        fn(*args, **kwargs)


async def slow(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """Run blocking work over whole files or trees (hashing, unzip, packing, fsync of a
    package, walking the cache) off the event loop, in the pool that hits never wait for."""
    return await _submit("slow", fn, *args, **kwargs)


def slow_started(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> asyncio.Future[T]:
    """Start slow(fn, ...) and return its future, to await later: the caller goes on with
    other work meanwhile. Cancelling the future does not stop a job already running."""
    return _submit("slow", fn, *args, **kwargs)


class Closable(Protocol):
    """What slow_then_close releases: an open file, an open blob."""

    def close(self) -> None:
        """Release it."""
        ...


async def slow_then_close(resource: Closable, fn: Callable[P, T], *args: P.args,
                          **kwargs: P.kwargs) -> T:
    """slow(fn, ...) over an open resource, then resource.close(): never while fn may still
    use it. A caller cancelled meanwhile (a shutdown, a client that left) does not stop the
    thread, so the thread then closes it when fn is done (on the loop, if it still runs); a
    job that never started is closed at once."""
    return await _then_close("slow", resource, lambda: fn(*args, **kwargs))


async def background_then_close(resource: Closable, fn: Callable[P, T], *args: P.args,
                                **kwargs: P.kwargs) -> T:
    """slow_then_close, at the lowest CPU priority (the background pool): for work over a
    whole file that no client waits for."""
    return await _then_close("background", resource, lambda: fn(*args, **kwargs))


async def _then_close(pool: Pool, resource: Closable, fn: Callable[[], T]) -> T:
    loop = asyncio.get_running_loop()
    lock = threading.Lock()
    state = {"running": False, "abandoned": False}

    def job() -> T:
        with lock:
            if state["abandoned"]:  # the caller left before it started: closed there
                raise asyncio.CancelledError
            state["running"] = True
        try:
            return fn()
        finally:
            with lock:
                state["running"] = False
                orphaned = state["abandoned"]
            if orphaned:
                _close_on(loop, resource)

    try:
        return await _submit(pool, job)
    finally:
        with lock:
            state["abandoned"] = True
            running = state["running"]
        if not running:
            resource.close()


def _close_on(loop: asyncio.AbstractEventLoop, resource: Closable) -> None:
    try:
        loop.call_soon_threadsafe(resource.close)
    except RuntimeError:  # the loop is closed: nothing else uses the resource any more
        resource.close()


async def dns(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """Run a name lookup (getaddrinfo) off the event loop, in a bounded pool of its own: a
    resolver that does not answer holds only these threads, never the ones hits or fills
    wait for."""
    return await _submit("dns", fn, *args, **kwargs)
