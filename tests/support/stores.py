"""Every storage backend, opened the same way, for the compliance suite and for service tests
that run on the in-memory backend."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

import proxy.store.archives
from proxy.core.executors import quick, serving
from proxy.store.disk import DiskBlobStore
from proxy.store.index import MetadataCache
from proxy.store.leases import FillLeases
from proxy.store.memory import MemoryBlobStore, MemoryIndex
from proxy.store.protocol import BlobStore, MetadataIndex

BACKENDS = ["disk", "memory"]


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


async def _nothing_pending() -> None:
    return None


async def _quick_pool_drained() -> None:
    # One quick thread: a call queued now runs after every use recorded before it.
    await quick(lambda: None)


@asynccontextmanager
async def open_store(backend: str, root: Path, monkeypatch: pytest.MonkeyPatch,
                     max_size: int | None = None) -> AsyncIterator[OpenedStore]:
    """The backend named, empty, storing under root where it needs a disk."""
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
            lambda: _open_disk(root, max_size))
    finally:
        index.close()
        disk.close()


def _files(directory: Path) -> list[Path]:
    return [path for path in directory.rglob("*") if path.is_file()]
