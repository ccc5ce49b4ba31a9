"""The S3 backend beyond the compliance suite, against a real S3 server (SeaweedFS): hot
copies bounded by cache.max_size, multipart uploads, the store checking what it receives,
replicas sharing one bucket, and index documents as JSON objects."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import proxy.store.s3_objects
from proxy.core.metrics import Metrics
from proxy.store.disk import DiskBlob
from proxy.store.protocol import BlobStore
from proxy.store.s3 import RemoteBlob, S3BlobStore
from proxy.store.s3_objects import StoreUnavailable
from tests.support.metrics import sample
from tests.support.seaweedfs import S3Server
from tests.support.stores import open_s3_store

KEY = "archives/registry.example/acme/thing/1.0.0/terraform-provider-thing_1.0.0_linux_amd64.zip"


async def once(data: bytes) -> AsyncIterator[bytes]:
    yield data


async def content(blobs: BlobStore, key: str) -> bytes:
    blob = await blobs.open(key)
    assert blob is not None, f"{key} is not stored"
    try:
        return b"".join([chunk async for chunk in blob.chunks()])
    finally:
        blob.close()


def hot(blobs: BlobStore) -> S3BlobStore:
    assert isinstance(blobs, S3BlobStore)
    return blobs


async def test_hot_copies_stay_within_max_size_and_evicted_ones_come_back_from_the_bucket(
        s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bucket = s3_server.new_bucket()
    keys = [f"archives/h/n/t/1.0.{n}/f.zip" for n in range(3)]
    async with open_s3_store(s3_server, bucket, tmp_path / "a", monkeypatch) as writer:
        for n, key in enumerate(keys):
            await writer.blobs.put(key, once(bytes([n]) * 1000))
    async with open_s3_store(s3_server, bucket, tmp_path / "b", monkeypatch,
                             max_size=2500) as reader:
        blobs = hot(reader.blobs)
        assert blobs.file_count == 0  # a new replica: nothing local yet
        for n, key in enumerate(keys):
            assert await content(blobs, key) == bytes([n]) * 1000
            await reader.settle()
        assert (blobs.used_bytes, blobs.file_count) == (2000, 2)  # the oldest copy went
        assert await blobs.stat(keys[0]) is not None  # the bucket still has it
        assert await content(blobs, keys[0]) == bytes([0]) * 1000
        opened = await blobs.open(keys[0])
        assert isinstance(opened, DiskBlob) and opened.local_path.exists()  # sendfile
        opened.close()


async def test_a_blob_too_big_for_hot_copies_streams_from_the_bucket_in_ranges(
        s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = bytes(range(256)) * 20
    async with open_s3_store(s3_server, s3_server.new_bucket(), tmp_path, monkeypatch,
                             max_size=1000) as store:
        await store.blobs.put(KEY, once(data))
        blob = await store.blobs.open(KEY)
        assert isinstance(blob, RemoteBlob) and blob.local_path is None
        try:
            assert b"".join([c async for c in blob.chunks(100, 2000)]) == data[100:2000]
            assert await asyncio.to_thread(lambda: blob.file().read()) == data
        finally:
            blob.close()
        assert hot(store.blobs).file_count == 0


async def test_a_large_blob_is_uploaded_in_parts_each_checked_by_the_store(
        s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(proxy.store.s3_objects, "SINGLE_PUT_LIMIT", 1 << 20)
    data = bytes(range(256)) * (36 << 10)  # 9 MiB: an 8 MiB part and a 1 MiB one
    bucket = s3_server.new_bucket()
    async with open_s3_store(s3_server, bucket, tmp_path / "a", monkeypatch) as store:
        info = await store.blobs.put(KEY, once(data))
        assert info.size == len(data)
    head = s3_server.client().head_object(  # type: ignore[attr-defined]
        Bucket=bucket, Key="tfproxy/" + KEY, ChecksumMode="ENABLED")
    assert head["ETag"].endswith('-2"')  # two parts
    assert head.get("ChecksumSHA256")
    async with open_s3_store(s3_server, bucket, tmp_path / "b", monkeypatch) as other:
        assert await content(other.blobs, KEY) == data


async def test_the_store_refuses_an_upload_whose_bytes_do_not_match_their_checksum(
        s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wrong = proxy.store.s3_objects._sha256_b64(b"something else")
    monkeypatch.setattr(proxy.store.s3_objects, "_sha256_b64", lambda _body: wrong)
    async with open_s3_store(s3_server, s3_server.new_bucket(), tmp_path,
                             monkeypatch) as store:
        with pytest.raises(StoreUnavailable, match="refused put"):
            await store.blobs.put(KEY, once(b"the real bytes" * 100))
        assert await store.blobs.stat(KEY) is None
        assert store.leftovers() == []


async def test_a_replica_never_serves_its_copy_of_a_blob_another_replaced(
        s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bucket = s3_server.new_bucket()
    async with open_s3_store(s3_server, bucket, tmp_path / "a", monkeypatch) as first, \
            open_s3_store(s3_server, bucket, tmp_path / "b", monkeypatch) as second:
        await first.blobs.put(KEY, once(b"old" * 500))
        assert await content(second.blobs, KEY) == b"old" * 500  # a hot copy in b
        await first.blobs.put(KEY, once(b"new" * 500))
        assert await content(second.blobs, KEY) == b"new" * 500
        assert hot(second.blobs).file_count == 1  # the old copy was dropped
        assert await first.blobs.delete(KEY)
        assert await second.blobs.open(KEY) is None


async def test_index_documents_are_json_objects_that_every_replica_reads(
        s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bucket = s3_server.new_bucket()
    document = {"sums": b"\x00\xffbinary", "list": [1, "two"], "nested": {"x": None}}
    async with open_s3_store(s3_server, bucket, tmp_path / "a", monkeypatch) as first:
        await first.index.set("sums/registry.example/acme/thing/1.0.0/abc", document)
        assert await first.index.create("lease/x", {"owner": 1})
    raw = s3_server.client().get_object(  # type: ignore[attr-defined]
        Bucket=bucket, Key="tfproxy/index/sums/registry.example/acme/thing/1.0.0/abc")
    assert json.loads(raw["Body"].read())["list"] == [1, "two"]
    async with open_s3_store(s3_server, bucket, tmp_path / "b", monkeypatch) as second:
        assert await second.index.get("sums/registry.example/acme/thing/1.0.0/abc") \
            == document
        assert not await second.index.create("lease/x", {"owner": 2})
        assert await second.index.keys("") == ["lease/x",
                                               "sums/registry.example/acme/thing/1.0.0/abc"]


async def test_a_record_the_bucket_says_is_gone_is_not_answered_from_the_local_copy(
        s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bucket, key = s3_server.new_bucket(), "package/registry.example/acme/thing/1.0.0/linux_amd64"
    async with open_s3_store(s3_server, bucket, tmp_path / "a", monkeypatch) as first, \
            open_s3_store(s3_server, bucket, tmp_path / "b", monkeypatch) as second:
        await first.index.set(key, {"shasum": "ab" * 32})
        assert await second.index.get(key) == {"shasum": "ab" * 32}  # kept locally too
        down = hot(second.blobs).objects
        down._unreachable("get", OSError("down"))  # an outage: the local copy answers
        assert await second.index.get(key) == {"shasum": "ab" * 32}
        down._down_since = None
        await first.index.delete(key)  # dropped (or pruned) by another replica
        assert await second.index.get(key) is None
        down._unreachable("get", OSError("down"))
        with pytest.raises(StoreUnavailable):  # not the record the bucket no longer has
            await second.index.get(key)


async def test_store_requests_are_counted_and_timed_by_operation_and_outcome(
        s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    metrics = Metrics()
    async with open_s3_store(s3_server, s3_server.new_bucket(), tmp_path, monkeypatch,
                             metrics=metrics) as store:
        await store.blobs.put(KEY, once(b"x" * 100))
        assert await store.blobs.stat(KEY + ".missing") is None
    exposition = metrics.render().decode()
    assert sample(exposition, "tfproxy_store_operations_total", backend="s3",
                  operation="put", outcome="ok") == 1
    assert sample(exposition, "tfproxy_store_operations_total", backend="s3",
                  operation="head", outcome="absent") == 1
    assert (sample(exposition, "tfproxy_store_operation_seconds_count", backend="s3",
                   operation="put") or 0) >= 1


async def test_listings_follow_every_page(s3_server: S3Server, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(proxy.store.s3_objects, "LIST_PAGE", 2)
    keys = [f"archives/h/n/t/1.0.{n}/f.zip" for n in range(5)]
    async with open_s3_store(s3_server, s3_server.new_bucket(), tmp_path,
                             monkeypatch) as store:
        for key in keys:
            await store.blobs.put(key, once(key.encode()))
            await store.index.set(f"package/{key}", {"n": 1})
        assert [info.key for info in await store.blobs.list("archives/h/")] == keys
        assert await store.index.keys("package/") == [f"package/{key}" for key in keys]
