"""Every storage backend, opened the same way, for the compliance suite and for service tests
that run on the in-memory backend."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

import proxy.store.archives
from proxy.core.executors import quick, serving
from proxy.store.disk import DiskBlobStore
from proxy.store.index import MetadataCache
from proxy.store.memory import MemoryBlobStore, MemoryIndex
from proxy.store.protocol import BlobStore, MetadataIndex

BACKENDS = ["disk", "memory"]


@dataclass
class OpenedStore:
    """A backend under test: its blob store and index, what its failed writes may have left
    in its temp area, and a way to wait for the background work a read starts (a use being
    recorded)."""

    blobs: BlobStore
    index: MetadataIndex
    leftovers: Callable[[], list[Path]]
    settle: Callable[[], Awaitable[None]]


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
        memory = MemoryBlobStore(max_size, scratch=root)
        try:
            yield OpenedStore(memory, MemoryIndex(), lambda: _files(memory.scratch),
                              _nothing_pending)
        finally:
            memory.close()
        return
    assert backend == "disk", backend
    # Every read is a use: the LRU order follows the test's reads, not the once-a-minute cap.
    monkeypatch.setattr(proxy.store.archives, "_TOUCH_INTERVAL", 0.0)
    async with serving(quick_threads=1):
        disk = DiskBlobStore.at(root / "cache", max_size)
        index = MetadataCache(root / "cache" / "index")
        try:
            yield OpenedStore(disk, index, lambda: [
                path for path in _files(disk.files.tmp_root)
                if not path.name.endswith(".lock")], _quick_pool_drained)
        finally:
            index.close()
            disk.close()


def _files(directory: Path) -> list[Path]:
    return [path for path in directory.rglob("*") if path.is_file()]
