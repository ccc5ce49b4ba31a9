"""The in-memory backend: blobs and index documents in dicts, for fast service tests and as
the reference the compliance suite holds every backend to. Safe for concurrent tasks on one
event loop (every change is made between awaits); nothing is shared between processes."""

from __future__ import annotations

import contextlib
import copy
import io
import itertools
import os
import shutil
import tempfile
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from proxy.config.settings import CacheConfig
from proxy.core.executors import quick, slow
from proxy.core.metrics import Metrics
from proxy.store.damage import Dropped
from proxy.store.disk_space import DiskSpace
from proxy.store.file_identity import FileIdentity
from proxy.store.leases import FillLeases, LeaseTimings, lease_outcomes
from proxy.store.metered import MeteredBlobStore, MeteredIndex
from proxy.store.protocol import (
    BlobInfo,
    DamageListener,
    Ready,
    Storage,
    check_key,
    export_usage,
)

# Eviction frees down to this share of the limit, as the disk backend does.
_LOW_WATER = 0.9
_CHUNK = 256 << 10


@dataclass(frozen=True)
class _Blob:
    info: BlobInfo
    data: bytes


class MemoryBlob:
    """A blob opened from memory: the bytes as they were when opened."""

    def __init__(self, blob: _Blob, release: Any) -> None:
        self._blob = blob
        self._release = release
        self._closed = False

    @property
    def info(self) -> BlobInfo:
        """As opened."""
        return self._blob.info

    @property
    def local_path(self) -> Path | None:
        """Not a file: stream it."""
        return None

    def file(self) -> BinaryIO:
        """The bytes as a seekable file."""
        return io.BytesIO(self._blob.data)

    def current_identity(self) -> FileIdentity:
        """Blobs in memory never change in place."""
        return self._blob.info.identity

    async def chunks(self, start: int = 0, end: int | None = None) -> AsyncGenerator[bytes, None]:
        """Bytes start..end, in pieces."""
        stop = len(self._blob.data) if end is None else min(end, len(self._blob.data))
        view = memoryview(self._blob.data)
        for offset in range(max(0, start), stop, _CHUNK):
            yield bytes(view[offset:min(stop, offset + _CHUNK)])

    def close(self) -> None:
        """No longer read: eviction may take it."""
        if not self._closed:
            self._closed = True
            self._release()

    def quick_to_close(self) -> bool:
        """Always: a count in memory."""
        return True


class MemoryBlobStore:
    """Blobs in a dict, least recently used first, within max_size bytes. Spools and work
    directories are local files under a private temp directory (removed by close)."""

    def __init__(self, max_size: int | None = None, scratch: Path | None = None,
                 disk: DiskSpace | None = None,
                 on_evict: Callable[[int, int], None] | None = None,
                 leases: FillLeases | None = None) -> None:
        self.scratch = Path(tempfile.mkdtemp(prefix="memory-store-", dir=scratch))
        self._disk = disk or DiskSpace(self.scratch)
        self.max_size = max_size
        self._blobs: OrderedDict[str, _Blob] = OrderedDict()  # least recently used first
        self._reading: Counter[str] = Counter()
        # Replicas in one process: blob stores that share one index and its leases.
        self.leases = leases or FillLeases(MemoryIndex())
        self._generation = itertools.count(1)
        self._on_evict = on_evict
        self._used: dict[str, float] = {}  # key -> when it was last opened

    def close(self) -> None:
        """Forget everything and remove the scratch directory."""
        self._blobs.clear()
        shutil.rmtree(self.scratch, ignore_errors=True)

    @property
    def disk(self) -> DiskSpace:
        """The disk the scratch directory is on."""
        return self._disk

    @property
    def used_bytes(self) -> int:
        """Bytes held."""
        return sum(blob.info.size for blob in self._blobs.values())

    @property
    def file_count(self) -> int:
        """Blobs held."""
        return len(self._blobs)

    def spool_path(self) -> Path:
        """A fresh scratch file name."""
        return self.scratch / f"{uuid.uuid4().hex}.part"

    def fill_notice(self, _name: str) -> Path | None:
        """None: a publish copies the spool into memory."""
        return None

    def work_dir(self) -> Path:
        """A fresh scratch directory."""
        return Path(tempfile.mkdtemp(prefix="work-", dir=self.scratch))

    async def publish(self, key: str, spool: Path) -> BlobInfo:
        """Read the spool into memory, then make it the blob at key."""
        check_key(key)
        try:
            data = await slow(spool.read_bytes)
        finally:
            await quick(spool.unlink, True)
        return self._place(key, data)

    async def put(self, key: str, chunks: AsyncIterable[bytes]) -> BlobInfo:
        """Collect the stream, then make it the blob at key (nothing is visible before)."""
        check_key(key)
        parts = [chunk async for chunk in chunks]
        return self._place(key, b"".join(parts))

    def _place(self, key: str, data: bytes) -> BlobInfo:
        now = time.time_ns()
        identity = FileIdentity(0, next(self._generation), len(data), now)
        info = BlobInfo(key, len(data), now / 1e9, identity)
        self._blobs.pop(key, None)
        self._blobs[key] = _Blob(info, data)
        self._evict(keep=key)
        return info

    def _evict(self, keep: str) -> None:
        if self.max_size is None or self.used_bytes <= self.max_size:
            return
        target = int(self.max_size * _LOW_WATER)
        total = self.used_bytes
        for key in list(self._blobs):
            if total <= target:
                break
            if key == keep or self._reading[key]:
                continue
            size = self._blobs.pop(key).info.size
            total -= size
            if self._on_evict is not None:
                self._on_evict(1, size)

    async def stat(self, key: str) -> BlobInfo | None:
        """The blob at key, if any."""
        check_key(key)
        blob = self._blobs.get(key)
        return None if blob is None else blob.info

    async def open(self, key: str, use: bool = True) -> MemoryBlob | None:
        """Open the blob at key (a use: it moves up the LRU)."""
        check_key(key)
        blob = self._blobs.get(key)
        if blob is None:
            return None
        if use:
            self._blobs.move_to_end(key)
            self._used[key] = time.time()
        self._reading[key] += 1

        def release() -> None:
            self._reading[key] -= 1
            if not self._reading[key]:
                del self._reading[key]

        return MemoryBlob(blob, release)

    async def delete(self, key: str, identity: FileIdentity | None = None) -> bool:
        """Delete the blob at key if it still has identity (None: whatever is there)."""
        check_key(key)
        blob = self._blobs.get(key)
        if blob is None or (identity is not None and blob.info.identity != identity):
            return False
        del self._blobs[key]
        self._used.pop(key, None)
        return True

    async def drop_damaged(self, key: str, identity: FileIdentity | None,
                           expected: str | None) -> Dropped:
        """The blob goes (the one copy there is) if it still has identity."""
        return Dropped.BLOB if await self.delete(key, identity) else Dropped.NOTHING

    async def open_shared(self, key: str) -> MemoryBlob | None:
        """The blob itself, not recorded as a use."""
        return await self.open(key, use=False)

    def watch_damage(self, listener: DamageListener) -> None:
        """Nothing is mended here: nothing to tell."""

    async def list(self, prefix: str) -> list[BlobInfo]:
        """Every blob under prefix, in key order."""
        return [self._blobs[key].info for key in sorted(self._blobs) if key.startswith(prefix)]

    async def last_uses(self, prefix: str) -> dict[str, float]:
        """When each blob under prefix was last opened."""
        return {key: used for key, used in self._used.items() if key.startswith(prefix)}

    @asynccontextmanager
    async def fill_lock(self, name: str, what: str,
                        ready: Ready | None = None) -> AsyncIterator[bool]:
        """A lease in the index (proxy.store.leases): what an object store does, so that the
        compliance suite holds the lease logic to the same rules as the rest."""
        with self._disk.reports(what):
            async with self.leases.lock(name, what, ready) as held:
                yield held

    def reread_usage(self) -> None:
        """Nothing else records usage."""

    def health_problem(self) -> str | None:
        """A scratch disk that filled up (and has no room yet)."""
        if not os.access(self.scratch, os.W_OK):
            return f"scratch directory {self.scratch} is not writable"
        return self._disk.problem()

    def store_problem(self) -> None:
        """No store beyond this process."""
        return None

    async def direct_url(self, key: str) -> None:
        """Blobs in memory are sent by the proxy."""
        return None


class MemoryIndex:
    """Index documents in a dict (deep copies in and out, as a real store would give)."""

    def __init__(self) -> None:
        self._documents: dict[str, tuple[dict[str, Any], str]] = {}
        self._writes = itertools.count(1)  # versions: no two writes share one

    async def get(self, key: str) -> dict[str, Any] | None:
        """The document at key, or None."""
        found = await self.get_versioned(key)
        return None if found is None else found[0]

    async def set(self, key: str, value: dict[str, Any]) -> None:
        """Store (replace) the document at key."""
        self._store(key, value)

    async def create(self, key: str, value: dict[str, Any]) -> bool:
        """Store the document only if key holds none."""
        if key in self._documents:
            return False
        self._store(key, value)
        return True

    async def delete(self, key: str) -> None:
        """Remove the document at key, if any."""
        self._documents.pop(key, None)

    async def get_versioned(self, key: str) -> tuple[dict[str, Any], str] | None:
        """The document at key and its version, or None."""
        found = self._documents.get(key)
        return None if found is None else (copy.deepcopy(found[0]), found[1])

    async def replace(self, key: str, value: dict[str, Any],
                      expected_version: str) -> str | None:
        """Store value at key only if the document there still has expected_version."""
        found = self._documents.get(key)
        if found is None or found[1] != expected_version:
            return None
        return self._store(key, value)

    async def delete_if(self, key: str, expected_version: str) -> bool:
        """Remove the document at key only if it still has expected_version."""
        found = self._documents.get(key)
        if found is None or found[1] != expected_version:
            return False
        del self._documents[key]
        return True

    def _store(self, key: str, value: dict[str, Any]) -> str:
        version = str(next(self._writes))
        self._documents[key] = (copy.deepcopy(value), version)
        return version

    async def keys(self, prefix: str) -> list[str]:
        """Every key under prefix, in order."""
        return sorted(key for key in self._documents if key.startswith(prefix))

    def close(self) -> None:
        """Nothing to release."""


async def open_memory_storage(config: CacheConfig, metrics: Metrics,
                              opened: contextlib.AsyncExitStack) -> Storage:
    """An empty in-memory store and index within config.max_size (spools under
    config.dir), closed by `opened`."""
    await quick(config.dir.mkdir, parents=True, exist_ok=True)
    index = MemoryIndex()
    blobs = MemoryBlobStore(config.max_size, scratch=config.dir,
                            on_evict=lambda count, _size: metrics.evictions.inc(count),
                            leases=FillLeases(index, LeaseTimings(config.lease_seconds),
                                              lease_outcomes(metrics)))
    opened.callback(blobs.close)
    export_usage(blobs, config.max_size, metrics)
    return Storage(MeteredBlobStore(blobs, "memory", metrics),
                   MeteredIndex(index, "memory", metrics))
