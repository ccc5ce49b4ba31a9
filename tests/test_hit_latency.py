"""A cache hit's latency does not depend on slow work running meanwhile (hashing whole packages
after a burst of downloads): hits and slow work never share the threads they wait for."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from typing import BinaryIO

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

import proxy.stored_hashes
from proxy.hashes import h1_of_zip
from tests.support.fake_registry import FakeRegistry
from tests.support.held_work import HeldCalls

Client = TestClient[web.Request, web.Application]
Make = Callable[..., Awaitable[Client]]
MIRROR = "/mirror/registry.terraform.io/hashicorp"
# A hit takes milliseconds; this leaves room for a loaded 2-core machine. The slow work lasts
# until the test releases it, and a hit stuck behind it is given up on after HIT_TIMEOUT.
HIT_BOUND = 1.0
HIT_TIMEOUT = 5.0


def default_executor_threads() -> int:
    """How many threads asyncio's default executor has on this machine (ThreadPoolExecutor's
    default size)."""
    return min(32, (os.cpu_count() or 1) + 4)


def is_busy_package(source: BinaryIO | object) -> bool:
    """Whether h1_of_zip is hashing one of the packages that make the load."""
    return "terraform-provider-busy_" in str(getattr(source, "name", source))


async def timed_get(client: Client, path: str) -> tuple[float, int]:
    """Seconds until the whole answer arrived (HIT_TIMEOUT if it did not), and its status."""
    async def fetch() -> int:
        response = await client.get(path)
        await response.read()
        return response.status

    started = time.monotonic()
    try:
        status = await asyncio.wait_for(fetch(), HIT_TIMEOUT)
    except TimeoutError:
        return HIT_TIMEOUT, 0
    return time.monotonic() - started, status


async def test_cached_answers_do_not_wait_for_package_hashing(
        make: Make, registry: FakeRegistry, monkeypatch: pytest.MonkeyPatch) -> None:
    # More packages than asyncio's default pool has threads: their h1 passes alone would
    # take every thread of a pool they shared with lookups.
    count = default_executor_threads() + 2
    busy = registry.add_release("hashicorp", "busy", "1.0.0",
                                platforms=tuple(f"linux_cpu{i}" for i in range(count)))
    client = await make()
    hits = [f"{MIRROR}/null/index.json", f"{MIRROR}/null/3.1.0.json",
            f"{MIRROR}/null/terraform-provider-null_3.2.1_linux_amd64.zip"]
    held = HeldCalls(h1_of_zip, holds=is_busy_package)
    downloads: list[asyncio.Task[tuple[int, bytes]]] = []

    async def download(path: str) -> tuple[int, bytes]:
        response = await client.get(path)
        return response.status, await response.read()

    try:
        for path in hits:  # cached: from here on they are hits
            assert (await client.get(path)).status == 200, path
        monkeypatch.setattr(proxy.stored_hashes, "h1_of_zip", held)
        downloads = [asyncio.ensure_future(download(
            f"{MIRROR}/busy/{busy.filename(platform)}")) for platform in busy.platforms]
        # Every thread that runs h1 is taken (and stays so until released).
        hashing = await held.settled(minimum=2)

        registry.requests.clear()
        timings = {path: await timed_get(client, path) for path in hits}

        assert held.finished == 0, "the slow work ended before the hits were timed"
        slow_hits = {path: round(seconds, 3) for path, (seconds, _status) in timings.items()
                     if seconds >= HIT_BOUND}
        assert not slow_hits, (f"hits took {slow_hits} s (gave up at {HIT_TIMEOUT} s) while "
                               f"{hashing} of {count} package hashes held their threads")
        assert all(status == 200 for _seconds, status in timings.values()), timings
        assert [p for p in registry.paths() if "/null/" in p] == [], "not answered from cache"
    finally:
        held.release()
        results = await asyncio.gather(*downloads, return_exceptions=True)
        del registry.releases[("hashicorp", "busy", "1.0.0")]
    # The load was real work that completes once released.
    assert results == [(200, busy.zips[p]) for p in busy.platforms]
