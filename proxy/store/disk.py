"""The disk backend: blobs are files under the cache directory (proxy.store.archives: temp
file + rename publish, eviction over a usage ledger shared by every process, fill locks),
index documents a diskcache (proxy.store.index). A key is the file's path below the cache
directory, so a cache written before the storage seam existed reads as is."""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import BinaryIO

import aiofiles

from proxy.config.settings import CacheConfig
from proxy.core.executors import on_each_quick_thread, quick, slow
from proxy.core.metrics import Metrics
from proxy.store.archives import ArchiveStore, FillLock
from proxy.store.damage import Dropped
from proxy.store.disk_space import DiskSpace
from proxy.store.file_identity import FileIdentity, identity_of
from proxy.store.index import MetadataCache
from proxy.store.layout import AREAS
from proxy.store.metered import MeteredBlobStore, MeteredIndex
from proxy.store.protocol import (
    BlobInfo,
    DamageListener,
    Ready,
    Storage,
    check_key,
    export_usage,
)
from proxy.store.usage import open_to_check

log = logging.getLogger(__name__)

_CHUNK = 256 << 10
# FileResponse opens what it sends by name. On Linux, the name of an open descriptor names
# exactly the file that was opened (and marked in use), even once it is deleted: no bare 404
# if it leaves the cache meanwhile. Elsewhere, the mark keeps eviction away from the path.
_OPEN_FILES = Path("/proc/self/fd")
_NAMES_OPEN_FILES = _OPEN_FILES.is_dir()


def probe_index(cache_dir: Path) -> None:
    """Open and close the index under cache_dir: raises what opening it at start-up would
    (OSError or sqlite3.Error, e.g. on a full disk), so that a parent can refuse once before
    its workers would each refuse."""
    MetadataCache(index_dir(cache_dir)).close()


def index_dir(cache_dir: Path) -> Path:
    """Where the index of the cache directory lives."""
    return cache_dir / "index"


def _info(key: str, identity: FileIdentity) -> BlobInfo:
    return BlobInfo(key, identity.size, identity.mtime_ns / 1e9, identity)


class DiskBlob:
    """A stored file opened to be read, marked in use until closed."""

    def __init__(self, key: str, handle: BinaryIO, path: Path) -> None:
        self._handle = handle
        self._path = path
        self._info = _info(key, identity_of(os.fstat(handle.fileno())))
        self._copy = False

    @property
    def info(self) -> BlobInfo:
        """As opened."""
        return self._info

    @property
    def local_path(self) -> Path:
        """The open file's own name where the system has one (/proc/self/fd), else its
        path in the cache."""
        return _OPEN_FILES / str(self._handle.fileno()) if _NAMES_OPEN_FILES else self._path

    def file(self) -> BinaryIO:
        """The open file itself."""
        return self._handle

    def current_identity(self) -> FileIdentity:
        """The file's identity now (blocking: an fstat); a copy's is its original's."""
        if self._copy:
            return self._info.identity
        return identity_of(os.fstat(self._handle.fileno()))

    def copy_of(self, info: BlobInfo) -> DiskBlob:
        """This open file, described as a local copy of the blob info describes (a blob
        elsewhere, which never changes in place)."""
        self._info, self._copy = info, True
        return self

    async def chunks(self, start: int = 0, end: int | None = None) -> AsyncGenerator[bytes, None]:
        """Bytes start..end, read on the quick pool."""
        offset = max(0, start)
        stop = self._info.size if end is None else min(end, self._info.size)
        while offset < stop:
            chunk = await quick(_read_at, self._handle, offset, min(_CHUNK, stop - offset))
            if not chunk:
                raise OSError(f"{self._path.name} ended {stop - offset} bytes early")
            offset += len(chunk)
            yield chunk

    def close(self) -> None:
        """Close it: eviction may take it again."""
        self._handle.close()

    def quick_to_close(self) -> bool:
        """Unless the file was removed meanwhile (evicted, replaced): its last close frees
        its blocks, milliseconds for a big file on some file systems."""
        try:
            return os.fstat(self._handle.fileno()).st_nlink > 0
        except (OSError, ValueError):  # closed already: close() does nothing
            return True


def _read_at(file: BinaryIO, offset: int, size: int) -> bytes:
    return os.pread(file.fileno(), size, offset)


class DiskBlobStore:
    """The BlobStore over an ArchiveStore: keys are paths below the cache directory."""

    def __init__(self, files: ArchiveStore) -> None:
        self.files = files

    @classmethod
    def at(cls, cache_dir: Path, max_size: int | None = None,
           on_evict: Callable[[int, int], None] | None = None,
           disk: DiskSpace | None = None) -> DiskBlobStore:
        """The store of cache_dir (blocks briefly: makes this process's temp directory)."""
        return cls(ArchiveStore(cache_dir, max_size, on_evict=on_evict, disk=disk))

    def close(self) -> None:
        """Remove this process's temp directory."""
        self.files.close()

    @property
    def disk(self) -> DiskSpace:
        """The cache directory's disk."""
        return self.files.disk

    @property
    def used_bytes(self) -> int:
        """Bytes stored by every process sharing the cache (latest view)."""
        return self.files.used_bytes

    @property
    def file_count(self) -> int:
        """Files stored by every process sharing the cache (latest view)."""
        return self.files.file_count

    def path_of(self, key: str) -> Path:
        """Where the blob at key lives (ValueError for an unsafe key)."""
        return self.files.path_for(check_key(key).split("/"))

    def spool_path(self) -> Path:
        """A temp file in this process's temp directory: published by a rename."""
        return self.files.temp_file()

    def work_dir(self) -> Path:
        """A work directory in this process's temp directory."""
        return self.files.work_dir()

    def fill_notice(self, name: str) -> Path | None:
        """Beside the lock files: a publish renames the spool, so followers can tell."""
        return self.files.notice_path(name)

    async def publish(self, key: str, spool: Path) -> BlobInfo:
        """Rename the spool into place (no copy); its identity is the blob's (a rename
        changes none of it)."""
        parts = check_key(key).split("/")
        self.files.path_for(parts)
        identity = identity_of(await quick(os.stat, spool))
        await self.files.publish(spool, parts)
        return _info(key, identity)

    async def put(self, key: str, chunks: AsyncIterable[bytes]) -> BlobInfo:
        """Write the stream to a spool, flush it, publish it; on failure remove the spool."""
        self.path_of(key)
        spool = self.spool_path()
        try:
            async with aiofiles.open(spool, "wb") as handle:
                async for chunk in chunks:
                    await handle.write(chunk)
                await handle.flush()
                await slow(os.fsync, handle.fileno())
            return await self.publish(key, spool)
        except BaseException:
            spool.unlink(missing_ok=True)  # synchronous: also when cancelled
            raise

    async def stat(self, key: str) -> BlobInfo | None:
        """One stat of the file."""
        identity = await self.files.identity(self.path_of(key))
        return None if identity is None else _info(key, identity)

    async def open(self, key: str, use: bool = True) -> DiskBlob | None:
        """Open the file, marked in use (eviction by any process leaves it alone), and record
        a use (its access time, at most once a minute; with use False, the access time is
        left as it is where the system allows)."""
        path = self.path_of(key)
        # On the event loop, as the stat before it (ArchiveStore.identity): an open, a
        # non-blocking flock and an fstat in a local directory take microseconds, where two
        # hops to the quick pool took 0.15-0.45 ms before a hit's first byte.
        handle = (self.files.open_to_send if use else open_to_check)(path)
        if handle is None:
            return None
        try:
            blob = DiskBlob(key, handle, path)
        except BaseException:
            handle.close()
            raise
        if use:
            self.files.touch(path)
        return blob

    async def delete(self, key: str, identity: FileIdentity | None = None) -> bool:
        """Delete the file unless another replaced it since identity was read."""
        return await self.files.discard(self.path_of(key), identity)

    async def drop_damaged(self, key: str, identity: FileIdentity | None,
                           expected: str | None) -> Dropped:
        """The file goes (the one copy there is) if it still has identity."""
        return Dropped.BLOB if await self.delete(key, identity) else Dropped.NOTHING

    async def open_shared(self, key: str) -> DiskBlob | None:
        """The file itself (there is no other copy), not recorded as a use."""
        return await self.open(key, use=False)

    def watch_damage(self, listener: DamageListener) -> None:
        """Damage is found by the readers of files: nothing to tell."""

    def listed(self, prefix: str) -> list[BlobInfo]:
        """list, blocking (commands that work on the cache directory)."""
        return sorted((info for info, _used in self._listed(prefix)),
                      key=lambda info: info.key)

    async def list(self, prefix: str) -> list[BlobInfo]:
        """Every file whose key starts with prefix (a walk: on the slow pool)."""
        return await slow(self.listed, prefix)

    async def last_uses(self, prefix: str) -> dict[str, float]:
        """The files' access times: open records a use there (at most once a minute)."""
        return await slow(lambda: {info.key: used for info, used in self._listed(prefix)})

    def _listed(self, prefix: str) -> Iterator[tuple[BlobInfo, float]]:
        """Every file under prefix and its access time."""
        top = self.files.cache_dir
        # Walk only below the prefix's directory part: every key under prefix is there.
        directory = prefix.rpartition("/")[0]
        if directory:
            try:
                check_key(directory)
            except ValueError:
                return
            starts = [directory] if directory.split("/")[0] in AREAS else []
        else:
            starts = list(AREAS)
        for start in starts:
            for root, _dirs, files in os.walk(top / start):
                for name in files:
                    path = Path(root) / name
                    key = path.relative_to(top).as_posix()
                    if not key.startswith(prefix):
                        continue
                    try:
                        found = path.stat()
                    except FileNotFoundError:
                        continue  # evicted meanwhile
                    yield _info(key, identity_of(found)), found.st_atime

    @asynccontextmanager
    async def fill_lock(self, name: str, what: str,
                        ready: Ready | None = None) -> AsyncIterator[bool]:
        """One of the striped flock files: shared by every process using the directory."""
        with self.files.disk.reports(what):
            async with FillLock(self.files.lock_path(name), ready) as held:
                yield held

    def reread_usage(self) -> None:
        """Read the usage record every process updates."""
        self.files.reread_usage()

    def health_problem(self) -> str | None:
        """The temp directory refuses a write, or the disk filled up."""
        # A name of its own per call: probes run at once (Kubernetes, a load balancer and
        # monitoring) must not remove each other's file.
        probe = self.files.tmp / f".readyz-{os.getpid()}-{uuid.uuid4().hex}"
        try:
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as exc:
            return f"cache directory {self.files.tmp} is not writable: {exc.strerror}"
        return self.files.disk.problem()

    def store_problem(self) -> None:
        """No store beyond this disk."""
        return None

    async def direct_url(self, key: str) -> None:
        """Files are sent by the proxy."""
        return None


async def open_disk_storage(config: CacheConfig, metrics: Metrics,
                            opened: contextlib.AsyncExitStack) -> Storage:
    """The cache directory's store and index, closed by `opened`: temp files that dead
    processes left are swept, the cache is measured (and evicted down to its limit), and
    its usage exported as metrics."""
    cache_dir = config.dir
    disk = DiskSpace(cache_dir, on_full=lambda kind: metrics.disk_full.labels(kind).inc())
    blobs = DiskBlobStore.at(cache_dir, config.max_size,
                             on_evict=lambda count, _size: metrics.evictions.inc(count),
                             disk=disk)
    opened.callback(blobs.close)
    swept = await slow(blobs.files.sweep_temp)
    if swept:
        log.info("removed %d unfinished download(s) left by an earlier run", swept)
    used = await slow(blobs.files.measure)
    export_usage(blobs, config.max_size, metrics)
    log.info("cache holds %d bytes of packages and modules", used)
    if config.max_size is not None and used > config.max_size:
        await blobs.files.evict()
    index = MetadataCache(index_dir(cache_dir), disk)
    opened.callback(index.close)
    # Before the first request: its index reads find their threads and connections ready.
    await on_each_quick_thread(index.open_here)
    return Storage(MeteredBlobStore(blobs, "disk", metrics), MeteredIndex(index, "disk", metrics))



async def open_disk_for_commands(config: CacheConfig,
                                 opened: contextlib.AsyncExitStack) -> Storage:
    """The cache directory's store and index as commands use them beside running servers:
    without the sweeping, measuring and evicting a starting server does (a `cache list` must
    delete nothing, and need not walk the whole cache first)."""
    blobs = DiskBlobStore.at(config.dir)
    opened.callback(blobs.close)
    index = MetadataCache(index_dir(config.dir))
    opened.callback(index.close)
    return Storage(blobs, index)
