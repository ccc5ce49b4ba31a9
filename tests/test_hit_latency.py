"""A cache hit's latency does not depend on slow work running meanwhile (hashing whole packages
after a burst of downloads, name lookups that hang, whatever fills asyncio's default executor):
hits and slow work never share the threads they wait for."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import BinaryIO, NoReturn

import aiohttp
import pytest
import trustme
from aiohttp import web
from aiohttp.test_utils import TestClient

import proxy.verification.stored_hashes
import proxy.web.responses
from proxy.app import create_app
from proxy.config import load_config
from proxy.core.executors import default_quick_threads, quick_started
from proxy.verification.hashes import h1_of_zip
from tests.support.fake_registry import FakeRegistry
from tests.support.held_work import HeldCalls
from tests.support.raw_http import served

Client = TestClient[web.Request, web.Application]
Make = Callable[..., Awaitable[Client]]
MIRROR = "/mirror/registry.terraform.io/hashicorp"
TARBALL = "/modules/registry.terraform.io/acme/tarball/aws"
HUNG_ZONE = ".hung.example"
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


async def timed_get(client: Client, path: str,
                    limit: float = HIT_TIMEOUT) -> tuple[float, int]:
    """Seconds until the whole answer arrived (`limit` if it did not), and its status."""
    async def fetch() -> int:
        response = await client.get(path)
        await response.read()
        return response.status

    started = time.monotonic()
    try:
        status = await asyncio.wait_for(fetch(), limit)
    except TimeoutError:
        return limit, 0
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
        monkeypatch.setattr(proxy.verification.stored_hashes, "h1_of_zip", held)
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


def fails_to_resolve(host: object, *_args: object, **_kwargs: object) -> NoReturn:
    """What a hung lookup ends in: no answer (and never a real query for the test's names)."""
    raise socket.gaierror(socket.EAI_AGAIN, f"Temporary failure in name resolution: {host}")


def is_hung_name(host: object, *_args: object, **_kwargs: object) -> bool:
    return str(host).endswith(HUNG_ZONE)


async def test_cached_answers_do_not_wait_for_hung_name_lookups(
        make: Make, registry: FakeRegistry, monkeypatch: pytest.MonkeyPatch) -> None:
    # Module sources on more hosts than asyncio's default pool has threads, all fetched at
    # once.
    count = default_executor_threads() + 2
    client = await make(upstream_extra=f"max_concurrent_fills = {count}")
    hits = [f"{MIRROR}/null/index.json",
            f"{MIRROR}/null/terraform-provider-null_3.2.1_linux_amd64.zip",
            f"{TARBALL}/1.0.0/tarball-aws-1.0.0.tar.gz"]
    for path in hits:  # cached: from here on they are hits
        assert (await client.get(path)).status == 200, path
    # A DNS server that does not answer: every lookup of these names hangs (for 30 s, unless
    # released).
    real = socket.getaddrinfo
    lookups = HeldCalls(fails_to_resolve, holds=is_hung_name, limit=30.0)
    monkeypatch.setattr(socket, "getaddrinfo", lambda *args, **kwargs: (
        lookups(*args, **kwargs) if is_hung_name(*args) else real(*args, **kwargs)))
    modules = [("acme", f"hung{i}", "aws", "1.0.0") for i in range(count)]
    for i, key in enumerate(modules):
        registry.add_module(*key, f"https://m{i}{HUNG_ZONE}/module.tar.gz")
    misses: list[asyncio.Task[tuple[float, int]]] = []
    try:
        misses = [asyncio.ensure_future(timed_get(
            client, f"/modules/registry.terraform.io/acme/hung{i}/aws/1.0.0/"
                    f"hung{i}-aws-1.0.0.tar.gz", limit=60.0)) for i in range(count)]
        hung = await lookups.settled(minimum=2)

        timings = {path: await timed_get(client, path) for path in hits}

        assert lookups.finished == 0, "the lookups ended before the hits were timed"
        slow_hits = {path: round(seconds, 3) for path, (seconds, _status) in timings.items()
                     if seconds >= HIT_BOUND}
        assert not slow_hits, (f"hits took {slow_hits} s (gave up at {HIT_TIMEOUT} s) while "
                               f"{hung} name lookups hung")
        assert all(status == 200 for _seconds, status in timings.values()), timings
        # The lookups wait in a (bounded) pool of their own.
        assert all(name.startswith("proxy-dns") for name in lookups.threads), lookups.threads
    finally:
        lookups.release()
        answered = await asyncio.gather(*misses)
        for key in modules:
            del registry.modules[key]
    assert [status for _seconds, status in answered] == [502] * count


async def test_cached_answers_need_nothing_from_the_default_executor(
        make: Make, registry: FakeRegistry, write_config: Callable[..., Path],
        upstream_ca: trustme.CA) -> None:
    """Whatever fills asyncio's default executor (a library's blocking calls), a hit does
    not wait for it: over plain HTTP (sendfile) and over TLS (the file read in pieces)."""
    hits = [f"{MIRROR}/null/index.json",
            f"{MIRROR}/null/terraform-provider-null_3.2.1_linux_amd64.zip",
            f"{TARBALL}/1.0.0/tarball-aws-1.0.0.tar.gz"]
    config = load_config(write_config(), environ={})
    client = await make()
    loop = asyncio.get_running_loop()
    gate = threading.Event()
    async with served(create_app(config), upstream_ca) as tls, \
            aiohttp.ClientSession() as session:

        async def tls_get(path: str) -> tuple[float, int]:
            async def fetch() -> int:
                async with session.get(tls.url(path), ssl=tls.client_tls) as response:
                    await response.read()
                    return response.status
            started = time.monotonic()
            try:
                status = await asyncio.wait_for(fetch(), HIT_TIMEOUT)
            except TimeoutError:
                return HIT_TIMEOUT, 0
            return time.monotonic() - started, status

        for path in hits:  # cached (one cache for both): from here on they are hits
            assert (await client.get(path)).status == 200, path
            assert (await tls_get(path))[1] == 200, path
        # Every thread of the default executor taken, and more work queued behind them.
        jammed = [loop.run_in_executor(None, gate.wait, 60.0)
                  for _ in range(2 * default_executor_threads())]
        try:
            timings = {("http", path): await timed_get(client, path) for path in hits}
            timings |= {("https", path): await tls_get(path) for path in hits}
        finally:
            gate.set()
            await asyncio.gather(*jammed)
    slow_hits = {key: round(seconds, 3) for key, (seconds, _status) in timings.items()
                 if seconds >= HIT_BOUND}
    assert not slow_hits, (f"hits took {slow_hits} s (gave up at {HIT_TIMEOUT} s) while the "
                           "default executor was busy")
    assert all(status == 200 for _seconds, status in timings.values()), timings


async def test_a_stored_package_is_sent_and_closed_without_a_thread_job(
        make: Make, monkeypatch: pytest.MonkeyPatch) -> None:
    """A hit's open, lock, stats and close of a stored package run on the event loop
    (microseconds in a local cache directory, where each hop to a thread and back took
    0.1-0.5 ms before the first byte, and even a hop not waited for cost a small hit about
    half its CPU): with every quick-pool thread taken, its bytes still go out at once
    (sendfile over plain HTTP), and nothing is left for a thread to close."""
    path = f"{MIRROR}/null/terraform-provider-null_3.2.1_linux_amd64.zip"
    client = await make()
    first = await client.get(path)  # the fill: from here on a hit
    whole = await first.read()
    assert first.status == 200
    handed: list[str] = []
    real_quick_soon = proxy.web.responses.quick_soon

    def quick_soon(fn: Callable[..., object], *args: object) -> None:
        handed.append(getattr(fn, "__qualname__", repr(fn)))
        real_quick_soon(fn, *args)

    monkeypatch.setattr(proxy.web.responses, "quick_soon", quick_soon)
    gate = threading.Event()
    jammed = [quick_started(gate.wait, 60.0) for _ in range(2 * default_quick_threads())]
    try:
        seconds, status = await timed_get(client, path)
    finally:
        gate.set()
        await asyncio.gather(*jammed)
    assert (status, round(seconds, 3) < HIT_BOUND) == (200, True), \
        f"the hit took {seconds:.3f} s (gave up at {HIT_TIMEOUT} s) behind a taken quick pool"
    assert handed == [], "the hit left closing its file to a thread"
    assert (await (await client.get(path)).read()) == whole
