"""Hits on the S3 backend, counted in bucket requests against a real S3 server (SeaweedFS):
a warm archive hit from a replica with a local hot copy makes one HEAD (the look that makes
sure the object was not replaced or deleted by another replica), a warm metadata hit none;
an open reuses the HEAD of the stat just before it, and a stale one ends in a clean look
at the bucket again, never a wrong blob."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient

from proxy.app import create_app
from proxy.config import Config
from proxy.core.metrics import Metrics
from proxy.store.protocol import BlobStore
from tests.support.fake_registry import FakeRegistry
from tests.support.metrics import total
from tests.support.mirror_paths import BASE, ZIP
from tests.support.seaweedfs import S3Server
from tests.support.stores import open_s3_store, s3_cache_config, use_s3_credentials

KEY = "archives/registry.example/acme/thing/1.0.0/terraform-provider-thing_1.0.0_linux_amd64.zip"
REG = "/providers/registry.terraform.io/hashicorp/null"
MODULE = "/modules/registry.terraform.io/acme/tarball/aws"
HITS = 5


async def bucket_requests(client: TestClient, **labels: str) -> float:  # type: ignore[type-arg]
    """How many requests the proxy has made of the bucket so far (with these labels)."""
    exposition = await (await client.get("/metrics")).text()
    return total(exposition, "tfproxy_store_operations_total", backend="s3", **labels) or 0.0


async def settled(client: TestClient) -> float:  # type: ignore[type-arg]
    """The bucket requests made so far, once the background work of earlier requests (a
    fill recording what it stored, last-use marks) is over."""
    count = await bucket_requests(client)
    for _ in range(50):
        await asyncio.sleep(0.1)
        count, previous = await bucket_requests(client), count
        if count == previous:
            return count
    pytest.fail("the bucket requests never settled")


async def replica(aiohttp_client, config: Config, server: S3Server, bucket: str,  # type: ignore[no-untyped-def]
                  cache_dir: Path) -> TestClient:  # type: ignore[type-arg]
    """A proxy on the bucket, with hot copies of its own under cache_dir."""
    return await aiohttp_client(create_app(dataclasses.replace(  # type: ignore[no-any-return]
        config, cache=s3_cache_config(server, bucket, cache_dir))))


async def hit(client: TestClient, path: str) -> bytes:  # type: ignore[type-arg]
    response = await client.get(path)
    assert response.status == 200, (path, await response.text())
    return await response.read()


async def test_a_warm_archive_hit_makes_one_bucket_request_on_every_replica(
        aiohttp_client, proxy_config: Config, registry: FakeRegistry,  # type: ignore[no-untyped-def]
        s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    use_s3_credentials(s3_server, monkeypatch)
    bucket = s3_server.new_bucket()
    whole = registry.releases[("hashicorp", "null", "3.2.1")].zips["linux_amd64"]
    filler = await replica(aiohttp_client, proxy_config, s3_server, bucket, tmp_path / "a")
    other = await replica(aiohttp_client, proxy_config, s3_server, bucket, tmp_path / "b")
    assert await hit(filler, f"{BASE}/{ZIP}") == whole  # the fill
    assert await hit(other, f"{BASE}/{ZIP}") == whole  # its hot copy fetched
    for client in (filler, other):
        assert await hit(client, f"{BASE}/{ZIP}") == whole  # last-use marks written
        before = await settled(client)
        heads = await bucket_requests(client, operation="head")
        for _ in range(HITS):
            assert await hit(client, f"{BASE}/{ZIP}") == whole
        # One HEAD each: not one for the stat and another for the open.
        assert await bucket_requests(client) - before == HITS
        assert await bucket_requests(client, operation="head") - heads == HITS
    assert len(registry.archive_requests()) == 1


async def test_warm_metadata_hits_make_no_bucket_request(
        aiohttp_client, proxy_config: Config, registry: FakeRegistry,  # type: ignore[no-untyped-def]
        s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    use_s3_credentials(s3_server, monkeypatch)
    client = await replica(aiohttp_client, proxy_config, s3_server, s3_server.new_bucket(),
                           tmp_path / "a")
    paths = [f"{BASE}/index.json", f"{BASE}/3.2.1.json", f"{REG}/versions",
             f"{REG}/3.2.1/download/darwin/arm64", f"{MODULE}/versions"]
    assert await hit(client, f"{BASE}/{ZIP}")  # one platform with its h1, the others none
    for _ in range(50):  # the fill records the h1 just after the last byte
        document = await (await client.get(f"{BASE}/3.2.1.json")).json()
        if len(document["archives"]["linux_amd64"]["hashes"]) == 2:
            break
        await asyncio.sleep(0.1)
    for path in paths:
        await hit(client, path)
    before = await settled(client)
    for _ in range(HITS):
        for path in paths:
            await hit(client, path)
    assert await bucket_requests(client) == before


@pytest.fixture
async def two_replicas(s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                       ) -> AsyncIterator[tuple[BlobStore, BlobStore, Metrics]]:
    """A writer and a reader replica of one bucket; the reader's metrics."""
    bucket = s3_server.new_bucket()
    metrics = Metrics()
    async with open_s3_store(s3_server, bucket, tmp_path / "a", monkeypatch) as writer, \
            open_s3_store(s3_server, bucket, tmp_path / "b", monkeypatch,
                          metrics=metrics) as reader:
        yield writer.blobs, reader.blobs, metrics


async def once(data: bytes) -> AsyncIterator[bytes]:
    yield data


async def content(blobs: BlobStore, key: str) -> bytes | None:
    blob = await blobs.open(key)
    if blob is None:
        return None
    try:
        return b"".join([chunk async for chunk in blob.chunks()])
    finally:
        blob.close()


def heads(metrics: Metrics) -> float:
    return total(metrics.render().decode(), "tfproxy_store_operations_total", backend="s3",
                 operation="head") or 0.0


async def test_an_open_right_after_a_stat_uses_its_head(
        two_replicas: tuple[BlobStore, BlobStore, Metrics],
        monkeypatch: pytest.MonkeyPatch) -> None:
    writer, reader, metrics = two_replicas
    await writer.put(KEY, once(b"bytes" * 300))
    assert await content(reader, KEY) == b"bytes" * 300  # a hot copy
    before = heads(metrics)
    for _ in range(HITS):
        assert await reader.stat(KEY) is not None
        assert await content(reader, KEY) == b"bytes" * 300
    assert heads(metrics) - before == HITS
    # An open on its own (no stat just before it) asks the bucket.
    monkeypatch.setattr("proxy.store.s3_heads.REUSE_SECONDS", 0.0)
    assert await content(reader, KEY) == b"bytes" * 300
    assert heads(metrics) - before == HITS + 1


async def test_an_object_replaced_between_the_stat_and_the_open_is_looked_up_again(
        two_replicas: tuple[BlobStore, BlobStore, Metrics]) -> None:
    writer, reader, _metrics = two_replicas
    await writer.put(KEY, once(b"old" * 500))
    stated = await reader.stat(KEY)  # no hot copy of it yet
    assert stated is not None
    await writer.put(KEY, once(b"new" * 500))
    assert await content(reader, KEY) == b"new" * 500
    again = await reader.stat(KEY)
    assert again is not None and again.identity != stated.identity


async def test_an_object_deleted_between_the_stat_and_the_open_is_not_opened(
        two_replicas: tuple[BlobStore, BlobStore, Metrics]) -> None:
    writer, reader, _metrics = two_replicas
    await writer.put(KEY, once(b"gone" * 500))
    assert await reader.stat(KEY) is not None  # no hot copy of it yet
    assert await writer.delete(KEY)
    assert await content(reader, KEY) is None
    assert await reader.stat(KEY) is None
    await writer.put(KEY, once(b"back" * 500))  # published anew: found anew
    assert await reader.stat(KEY) is not None
    assert await content(reader, KEY) == b"back" * 500
