"""Every storage backend, opened the same way, for the compliance suite and for service tests
that run on the in-memory backend."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

import proxy.store.archives
from proxy.config.settings import CacheConfig, S3Config
from proxy.core.executors import quick, serving
from proxy.core.metrics import Metrics
from proxy.store.disk import DiskBlobStore
from proxy.store.index import MetadataCache
from proxy.store.leases import FillLeases
from proxy.store.memory import MemoryBlobStore, MemoryIndex
from proxy.store.protocol import BlobStore, MetadataIndex
from proxy.store.s3 import S3BlobStore, open_s3_storage
from tests.support.seaweedfs import S3Server

BACKENDS = ["disk", "memory", "s3"]


@dataclass
class OpenedStore:
    """A backend under test: its blob store and index, what its failed writes may have left
    in its temp area, a way to wait for the background work a read starts (a use being
    recorded), and another replica's view of the same store (its own blob store and index
    objects: for disk, second instances on the same directory)."""

    blobs: BlobStore
    index: MetadataIndex
    leftovers: Callable[[], list[Path]]
    settle: Callable[[], Awaitable[None]]
    replica: Callable[[], AbstractAsyncContextManager[OpenedStore]]
    # The local file a hit on a key is served from (disk: the blob's file; s3: its hot
    # copy), or None where there is none (memory).
    local_file: Callable[[str], Path | None] = lambda _key: None


async def _nothing_pending() -> None:
    return None


async def _quick_pool_drained() -> None:
    # One quick thread: a call queued now runs after every use recorded before it.
    await quick(lambda: None)


@asynccontextmanager
async def open_store(backend: str, root: Path, monkeypatch: pytest.MonkeyPatch,
                     max_size: int | None = None,
                     s3: S3Server | None = None) -> AsyncIterator[OpenedStore]:
    """The backend named, empty, storing under root where it needs a disk (s3: in a fresh
    bucket of that server, hot copies under root)."""
    if backend == "s3":
        assert s3 is not None, "the s3 backend needs the s3_server fixture"
        async with open_s3_store(s3, s3.new_bucket(), root / "cache", monkeypatch,
                                 max_size) as opened:
            yield opened
        return
    if backend == "memory":
        async with _open_memory(MemoryIndex(), root, max_size) as opened:
            yield opened
        return
    assert backend == "disk", backend
    # Every read is a use: the LRU order follows the test's reads, not the once-a-minute cap.
    monkeypatch.setattr(proxy.store.archives, "_TOUCH_INTERVAL", 0.0)
    async with serving(quick_threads=1), _open_disk(root, max_size) as opened:
        yield opened


@asynccontextmanager
async def _open_memory(index: MemoryIndex, root: Path,
                       max_size: int | None) -> AsyncIterator[OpenedStore]:
    # Replicas share the index (the store's leases are in it), each with its own blobs.
    memory = MemoryBlobStore(max_size, scratch=root, leases=FillLeases(index))
    try:
        yield OpenedStore(memory, index, lambda: _files(memory.scratch), _nothing_pending,
                          lambda: _open_memory(index, root, max_size))
    finally:
        memory.close()


@asynccontextmanager
async def _open_disk(root: Path, max_size: int | None) -> AsyncIterator[OpenedStore]:
    disk = DiskBlobStore.at(root / "cache", max_size)
    index = MetadataCache(root / "cache" / "index")
    try:
        yield OpenedStore(disk, index, lambda: [
            path for path in _files(disk.files.tmp_root)
            if not path.name.endswith(".lock")], _quick_pool_drained,
            lambda: _open_disk(root, max_size), disk.path_of)
    finally:
        index.close()
        disk.close()


def s3_cache_config(server: S3Server, bucket: str, cache_dir: Path,
                    max_size: int | None = None, serve: str = "stream") -> CacheConfig:
    """Cache settings for a bucket of the test server, hot copies under cache_dir."""
    return CacheConfig(dir=cache_dir, max_size=max_size,
                       s3=S3Config(bucket=bucket, endpoint_url=server.endpoint_url,
                                   region=server.region, serve=serve))


def use_s3_credentials(server: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server's keys in the environment (the AWS chain's first link), and nothing else
    of the chain consulted (no files, never the instance metadata address)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", server.secret_key)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/dev/null")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@asynccontextmanager
async def open_s3_store(server: S3Server, bucket: str, cache_dir: Path,
                        monkeypatch: pytest.MonkeyPatch, max_size: int | None = None,
                        metrics: Metrics | None = None) -> AsyncIterator[OpenedStore]:
    """The S3 backend on bucket, as the app opens it."""
    use_s3_credentials(server, monkeypatch)
    monkeypatch.setattr(proxy.store.archives, "_TOUCH_INTERVAL", 0.0)
    async with serving(quick_threads=1), AsyncExitStack() as opened:
        storage = await open_s3_storage(s3_cache_config(server, bucket, cache_dir, max_size),
                                        metrics or Metrics(), opened)
        blobs = storage.blobs
        assert isinstance(blobs, S3BlobStore)
        yield OpenedStore(blobs, storage.index, lambda: [
            path for path in _files(blobs.hot.files.tmp_root)
            if not path.name.endswith(".lock")], _quick_pool_drained,
            # Another replica: the same bucket, hot copies of its own.
            lambda: open_s3_store(server, bucket, cache_dir.with_name(
                f"{cache_dir.name}-{uuid.uuid4().hex[:8]}"), monkeypatch, max_size),
            lambda key: hot_copy(blobs, key))


def hot_copy(blobs: S3BlobStore, key: str) -> Path | None:
    """The newest local hot copy of the blob at key, if there is one."""
    copies = sorted(blobs.hot.path_of(key).parent.glob(blobs.hot.path_of(key).name + "~*"),
                    key=lambda path: path.stat().st_mtime_ns)
    return copies[-1] if copies else None


def _files(directory: Path) -> list[Path]:
    return [path for path in directory.rglob("*") if path.is_file()]
