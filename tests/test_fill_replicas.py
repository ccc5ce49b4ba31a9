"""Replicas sharing one store: concurrent misses spread over them download an artifact once,
and a replica waiting for another's fill serves the artifact as soon as it is published, not
when the filler is done with it. Over both ways a store coordinates fills: flock on a shared
directory (disk), and leases in the index (the in-memory backend, as an object store does)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp.test_utils import TestClient

import proxy.verification.stored_hashes
from proxy.app import create_app
from proxy.config import Config
from proxy.config.settings import CacheConfig
from proxy.core.metrics import Metrics
from proxy.store.leases import FillLeases
from proxy.store.memory import MemoryBlobStore, MemoryIndex, open_memory_storage
from proxy.store.protocol import Storage
from proxy.verification.hashes import h1_of_zip
from tests.support.fake_registry import FakeRegistry
from tests.support.held_work import HeldCalls
from tests.support.metrics import sample
from tests.support.mirror_paths import BASE, ZIP

UPSTREAM_ZIP = f"/files/hashicorp/null/3.2.1/{ZIP}"


@pytest.fixture(params=["disk", "memory"])
async def replicas(request: pytest.FixtureRequest, aiohttp_client, proxy_config: Config,  # type: ignore[no-untyped-def]
                   tmp_path: Path) -> AsyncIterator[list[TestClient]]:  # type: ignore[type-arg]
    """Two apps on one store: one cache directory, or one in-memory store."""
    if request.param == "disk":
        yield [await aiohttp_client(create_app(proxy_config)) for _ in range(2)]
        return
    index = MemoryIndex()
    blobs = MemoryBlobStore(None, scratch=tmp_path, leases=FillLeases(index))

    async def shared(_config: CacheConfig, _metrics: Metrics,
                     _opened: contextlib.AsyncExitStack) -> Storage:
        return Storage(blobs, index)

    try:
        yield [await aiohttp_client(create_app(proxy_config, open_storage=shared))
               for _ in range(2)]
    finally:
        blobs.close()


async def fetch(client: TestClient, path: str = f"{BASE}/{ZIP}") -> tuple[int, bytes]:  # type: ignore[type-arg]
    response = await client.get(path)
    return response.status, await response.read()


async def test_concurrent_misses_on_several_replicas_download_once(
        replicas: list[TestClient], registry: FakeRegistry) -> None:  # type: ignore[type-arg]
    whole = registry.releases[("hashicorp", "null", "3.2.1")].zips["linux_amd64"]
    registry.slow_paths[UPSTREAM_ZIP] = 0.3  # the misses overlap
    answers = await asyncio.wait_for(asyncio.gather(
        *(fetch(replicas[n % 2]) for n in range(6))), 30)
    assert answers == [(200, whole)] * 6
    assert registry.paths().count(UPSTREAM_ZIP) == 1


async def test_a_waiting_replica_serves_the_package_once_published_not_after_its_hashing(
        replicas: list[TestClient], registry: FakeRegistry,  # type: ignore[type-arg]
        monkeypatch: pytest.MonkeyPatch) -> None:
    whole = registry.releases[("hashicorp", "null", "3.2.1")].zips["linux_amd64"]
    registry.slow_paths[UPSTREAM_ZIP] = 0.5  # the second replica asks while it downloads
    # The filler's h1 pass (after publishing, still under its fill lock) takes long.
    hashing = HeldCalls(h1_of_zip)
    monkeypatch.setattr(proxy.verification.stored_hashes, "h1_of_zip", hashing)
    try:
        first = asyncio.ensure_future(fetch(replicas[0]))
        for _ in range(1000):  # until the first replica's download started
            if UPSTREAM_ZIP in registry.paths():
                break
            await asyncio.sleep(0.01)
        second = asyncio.ensure_future(fetch(replicas[1]))
        assert await asyncio.wait_for(first, 10) == (200, whole)
        await hashing.settled(minimum=1, quiet=0.1)
        assert await asyncio.wait_for(second, 5) == (200, whole)
        assert hashing.finished == 0, "served only once the filler was done"
    finally:
        hashing.release()
    assert registry.paths().count(UPSTREAM_ZIP) == 1


async def test_fill_lease_outcomes_are_exported(
        aiohttp_client, proxy_config: Config, registry: FakeRegistry) -> None:  # type: ignore[no-untyped-def]
    client = await aiohttp_client(create_app(proxy_config, open_storage=open_memory_storage))
    before = await (await client.get("/metrics")).text()
    for outcome in ("acquired", "waited", "taken_over", "lost"):
        assert sample(before, "tfproxy_fill_leases_total", outcome=outcome) == 0
    assert (await fetch(client))[0] == 200
    after = await (await client.get("/metrics")).text()
    assert sample(after, "tfproxy_fill_leases_total", outcome="acquired") == 1
    assert sample(after, "tfproxy_fill_leases_total", outcome="taken_over") == 0


async def _download_started(registry: FakeRegistry) -> None:
    for _ in range(1000):
        if UPSTREAM_ZIP in registry.paths():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the package's download never started")


async def test_a_process_waiting_for_another_process_fill_sends_its_bytes_as_they_arrive(
        replicas: list[TestClient], registry: FakeRegistry,  # type: ignore[type-arg]
        request: pytest.FixtureRequest) -> None:
    whole = registry.releases[("hashicorp", "null", "3.2.1")].zips["linux_amd64"]
    registry.faults.add("slowzip")  # a slow upstream: the fill takes seconds
    first = asyncio.ensure_future(fetch(replicas[0]))
    await _download_started(registry)
    response = await replicas[1].get(f"{BASE}/{ZIP}")
    try:
        assert response.status == 200
        start = await asyncio.wait_for(response.content.readany(), 10)
        if request.node.callspec.params["replicas"] == "disk":
            # The other process's spool, followed: bytes long before its fill ended.
            assert start and not first.done()
        body = start + await asyncio.wait_for(response.content.read(), 30)
    finally:
        response.release()
    assert body == whole
    assert await asyncio.wait_for(first, 30) == (200, whole)
    assert registry.paths().count(UPSTREAM_ZIP) == 1


async def test_a_fill_followed_from_another_process_that_fails_verification_is_cut_short(
        aiohttp_client, proxy_config: Config, registry: FakeRegistry) -> None:  # type: ignore[no-untyped-def]
    # Two apps on one cache directory (the disk backend's fills are followed across
    # processes; an object store's waiters wait for the publish).
    replicas = [await aiohttp_client(create_app(proxy_config)) for _ in range(2)]
    whole = registry.releases[("hashicorp", "null", "3.2.1")].zips["linux_amd64"]
    registry.faults.update({"slowzip", "corrupt"})
    first = asyncio.ensure_future(fetch(replicas[0]))
    await _download_started(registry)
    response = await replicas[1].get(f"{BASE}/{ZIP}")
    received = b""
    try:
        assert response.status == 200  # following: the headers went before the end
        with pytest.raises(aiohttp.ClientPayloadError):
            while chunk := await asyncio.wait_for(response.content.readany(), 30):
                received += chunk
    finally:
        response.release()
    assert 0 < len(received) < len(whole)  # some bytes, never the whole (bad) body
    with pytest.raises(aiohttp.ClientPayloadError):  # the filler's own client: cut too
        await asyncio.wait_for(first, 30)
    assert registry.paths().count(UPSTREAM_ZIP) == 1  # followed, not downloaded again
    registry.faults.clear()
    assert await fetch(replicas[1]) == (200, whole)  # nothing bad was stored
