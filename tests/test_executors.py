"""The proxy's thread pools: quick calls never queue behind slow work, and the pools live as
long as the apps on the loop."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
import time
from pathlib import Path

import pytest

from proxy.config.settings import CacheConfig
from proxy.core.executors import quick, quick_soon, serving, slow
from proxy.core.metrics import Metrics
from proxy.store.disk import open_disk_storage
from proxy.store.index import MetadataCache
from tests.support.held_work import HeldCalls

REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")


def thread_and_context() -> tuple[str, str]:
    """Where a call ran, and the context it saw."""
    return threading.current_thread().name, REQUEST_ID.get()


async def test_quick_calls_answer_while_slow_work_takes_every_slow_thread() -> None:
    async with serving(quick_threads=2, slow_threads=2):
        held = HeldCalls(lambda: None)
        jobs = [asyncio.ensure_future(slow(held)) for _ in range(5)]
        try:
            assert await held.settled(minimum=2) == 2  # the rest wait their turn
            REQUEST_ID.set("r-1")
            started = time.monotonic()
            thread, seen = await asyncio.wait_for(quick(thread_and_context), 5)
            assert time.monotonic() - started < 1.0
            assert thread.startswith("proxy-quick") and seen == "r-1"
            assert all(name.startswith("proxy-slow") for name in held.threads)
        finally:
            held.release()
            await asyncio.gather(*jobs)
        assert held.finished == 5


async def test_apps_on_one_loop_share_the_pools_until_the_last_one_stops() -> None:
    async with serving() as first:
        async with serving() as second:
            assert second is first
        thread, _ = await quick(thread_and_context)
        assert thread.startswith("proxy-quick")  # the first app still runs
    with pytest.raises(RuntimeError):
        first.quick_pool.submit(thread_and_context)  # shut down with the last app
    # Outside a serving app (one-shot commands, unit tests) the calls still run off the loop.
    thread, _ = await quick(thread_and_context)
    assert thread != threading.current_thread().name
    assert not thread.startswith("proxy-")


async def test_cleanup_handed_over_after_the_pools_shut_down_runs_at_once() -> None:
    """A close or an unlink handed to quick_soon during a shutdown is not lost."""
    done: list[int] = []
    async with serving() as pools:
        pools.shutdown()
        quick_soon(done.append, 1)
    assert done == [1]


async def test_a_starting_disk_store_opens_the_index_on_every_quick_thread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before the first request: a fresh worker's first cold package waited for a quick
    thread to start and for that thread's SQLite connection."""
    opened_on: list[str] = []
    real = MetadataCache.open_here

    def open_here(index: MetadataCache) -> None:
        opened_on.append(threading.current_thread().name)
        real(index)

    monkeypatch.setattr(MetadataCache, "open_here", open_here)
    async with serving(quick_threads=3), contextlib.AsyncExitStack() as opened:
        await open_disk_storage(CacheConfig(dir=tmp_path / "cache"), Metrics(), opened)
        assert len(set(opened_on)) == 3
        assert all(name.startswith("proxy-quick") for name in opened_on)
        async with contextlib.AsyncExitStack() as again:  # another app on the loop: once
            await open_disk_storage(CacheConfig(dir=tmp_path / "cache"), Metrics(), again)
        assert len(opened_on) == 3
