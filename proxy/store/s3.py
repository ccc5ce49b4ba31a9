"""The S3 backend: blobs are objects in a bucket shared by every replica (proxy.store.s3_objects),
index documents small JSON objects beside them (proxy.store.s3_index). Hits are served from
hot copies: whole local files under cache.dir, in a disk store bounded by cache.max_size, so
a hit is a sendfile like on the disk backend, and keeps being served while the bucket is
unreachable.

A hot copy is fetched whole before its first byte is sent (not streamed while it is written):
the store's SHA-256 of the object is checked at the end of the download, so no client ever
gets bytes that fail it, and every later hit is a local file. A blob too big for the hot
copies is streamed from the bucket with ranged GETs instead.

A hot copy's name is the blob's key plus `~TAG-MTIME`, TAG from the object's ETag: the name
alone says which object it is a copy of, so a replaced object is never served from the copy
of the old one, and the copy vouches for itself when the bucket cannot be asked."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import tempfile
import time
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Callable
from pathlib import Path
from typing import BinaryIO

import aiofiles

from proxy.config.settings import CacheConfig, S3Config
from proxy.core.errors import InsufficientStorage
from proxy.core.executors import quick
from proxy.core.metrics import Metrics
from proxy.core.singleflight import SingleFlight
from proxy.store import layout
from proxy.store.disk import DiskBlob, DiskBlobStore
from proxy.store.disk_space import DiskSpace, is_out_of_space
from proxy.store.file_identity import FileIdentity
from proxy.store.index import MetadataCache
from proxy.store.leases import FillLeases, LeaseTimings, lease_outcomes
from proxy.store.protocol import BlobInfo, Ready, Storage, check_key, export_usage
from proxy.store.s3_heads import RecentHeads
from proxy.store.s3_index import S3Index
from proxy.store.s3_marks import AccessMarks
from proxy.store.s3_objects import Conflict, ObjectInfo, ObjectStore, StoreUnavailable

log = logging.getLogger(__name__)
_DEVICE = 0x5333  # "S3": an identity from an object, never a local file's
_COPY = "~"
_PROBE_EVERY = 2.0
_PRESIGNED_FOR = 900


def _tag(info: ObjectInfo) -> str:
    return hashlib.sha256(info.etag.encode()).hexdigest()[:15]


def _identity(tag: str, size: int, mtime: int) -> FileIdentity:
    return FileIdentity(_DEVICE, int(tag, 16), size, mtime * 10**9)


def _blob_info(info: ObjectInfo) -> BlobInfo:
    return BlobInfo(info.key, info.size, float(info.mtime),
                    _identity(_tag(info), info.size, info.mtime))


def _copy_key(info: ObjectInfo) -> str:
    return f"{info.key}{_COPY}{_tag(info)}-{info.mtime}"


def _from_copy(key: str, copy: BlobInfo) -> BlobInfo | None:
    """The blob a hot copy is of, as its name tells; None for another file."""
    tag, _, mtime = copy.key.removeprefix(key + _COPY).partition("-")
    if not copy.key.startswith(key + _COPY) or len(tag) != 15 or not mtime.isdigit():
        return None
    return BlobInfo(key, copy.size, float(mtime), _identity(tag, copy.size, int(mtime)))


class RemoteBlob:
    """A blob read from the bucket itself, with ranged GETs (one too big for hot copies)."""

    def __init__(self, info: ObjectInfo, objects: ObjectStore, scratch: Path) -> None:
        self._object = info
        self._info = _blob_info(info)
        self._objects = objects
        self._scratch = scratch
        self._loop = asyncio.get_running_loop()

    @property
    def info(self) -> BlobInfo:
        """As found."""
        return self._info

    @property
    def local_path(self) -> None:
        """Not a local file: stream it."""
        return None

    def file(self) -> BinaryIO:
        """The whole object in a temp file (blocking: call it off the loop)."""
        handle = tempfile.TemporaryFile(dir=self._scratch)
        try:
            asyncio.run_coroutine_threadsafe(self._copy_to(handle), self._loop).result()
            handle.seek(0)
        except BaseException:
            handle.close()
            raise
        return handle

    async def _copy_to(self, handle: BinaryIO) -> None:
        async for chunk in self.chunks():
            await quick(handle.write, chunk)

    def current_identity(self) -> FileIdentity:
        """Objects never change in place."""
        return self._info.identity

    async def chunks(self, start: int = 0, end: int | None = None) -> AsyncGenerator[bytes, None]:
        """Bytes start..end, as one ranged GET of exactly this object."""
        stop = self._object.size if end is None else min(end, self._object.size)
        async for chunk in self._objects.read_range(self._object, max(0, start), stop):
            yield chunk

    def close(self) -> None:
        """Nothing held."""


class S3BlobStore:
    """The BlobStore over a bucket, with hot copies of what was read in a disk store."""

    def __init__(self, objects: ObjectStore, hot: DiskBlobStore, leases: FillLeases,
                 redirect: bool = False, marks: AccessMarks | None = None) -> None:
        self.objects = objects
        self.hot = hot
        self.leases = leases
        self.marks = marks or AccessMarks(objects)
        self._redirect = redirect
        self._fetches: SingleFlight[None] = SingleFlight()
        self._stats = RecentHeads()  # what stats found, for the opens that follow them

    @property
    def disk(self) -> DiskSpace:
        """The disk of cache.dir: spools, work directories and hot copies."""
        return self.hot.disk

    @property
    def used_bytes(self) -> int:
        """Bytes of hot copies (the bucket is not measured)."""
        return self.hot.used_bytes

    @property
    def file_count(self) -> int:
        """Hot copies held."""
        return self.hot.file_count

    def spool_path(self) -> Path:
        """A local temp file, uploaded by publish."""
        return self.hot.spool_path()

    def work_dir(self) -> Path:
        """A local work directory."""
        return self.hot.work_dir()

    async def publish(self, key: str, spool: Path) -> BlobInfo:
        """Upload the verified spool to its final key (the store checks its SHA-256), then
        keep the spool as the blob's hot copy."""
        check_key(key)
        try:
            etag = await self.objects.upload(key, spool)
            found = await self.objects.head(key)
            if found is None:
                raise StoreUnavailable(f"{key} was not in the bucket right after its upload")
            if found.etag == etag:  # else another writer's object replaced ours already
                await self._keep_copy(found, spool)
            self._stats.forget(key)
            self.marks.written(key)
            return _blob_info(found)
        finally:
            await quick(spool.unlink, True)

    async def put(self, key: str, chunks: AsyncIterable[bytes]) -> BlobInfo:
        """Write the stream to a spool, then publish it; on failure remove the spool."""
        check_key(key)
        spool = self.spool_path()
        try:
            async with aiofiles.open(spool, "wb") as handle:
                async for chunk in chunks:
                    await handle.write(chunk)
            return await self.publish(key, spool)
        except BaseException:
            spool.unlink(missing_ok=True)  # synchronous: also when cancelled
            raise

    async def _find(self, key: str) -> ObjectInfo | tuple[BlobInfo, str] | None:
        """The object at key (one HEAD); while the bucket is unreachable, the blob its
        newest hot copy says it is a copy of, and that copy's key (StoreUnavailable if
        there is none)."""
        check_key(key)
        try:
            return await self.objects.head(key)
        except StoreUnavailable:
            copy = await self._newest_copy(key)
            if copy is None:
                raise
            return copy

    async def stat(self, key: str) -> BlobInfo | None:
        """One HEAD (which the open that follows uses too); the newest hot copy's word for
        it when the bucket is unreachable."""
        found = await self._find(key)
        self._stats.found(key, found if isinstance(found, ObjectInfo) else None)
        if isinstance(found, ObjectInfo):
            return _blob_info(found)
        return None if found is None else found[0]

    async def open(self, key: str, use: bool = True) -> DiskBlob | RemoteBlob | None:
        """The blob's hot copy, fetched whole first if there is none (once, however many
        ask); a blob too big for hot copies is read from the bucket. While the bucket is
        unreachable, the newest hot copy is served. A use (unless use is False): its
        last-use mark is written in the background (at most hourly)."""
        opened = await self._open(key, use)
        if opened is not None and use:
            self.marks.used(key)
        return opened

    async def _open(self, key: str, use: bool) -> DiskBlob | RemoteBlob | None:
        stated = self._stats.recent(key)
        for _attempt in range(2):
            found = stated or await self._find(key)
            stated = None
            if found is None:
                return None
            if isinstance(found, tuple):  # the bucket is unreachable
                opened = await self.hot.open(found[1], use)
                if opened is None:
                    raise StoreUnavailable(self.objects.problem() or "the object store is "
                                           "unreachable, and the local copy went")
                return opened.copy_of(found[0])
            info = _blob_info(found)
            opened = await self.hot.open(_copy_key(found), use)
            if opened is not None:
                return opened.copy_of(info)
            if self._too_big(found):
                return RemoteBlob(found, self.objects, self.hot.files.tmp)
            try:
                await self._fetches.run(_copy_key(found),
                                        functools.partial(self._fetch, found))
            except Conflict:
                self._stats.forget(key)
                continue  # replaced since the HEAD: look again
            except LookupError:
                self._stats.forget(key)
                return None
            except InsufficientStorage:
                return RemoteBlob(found, self.objects, self.hot.files.tmp)
            opened = await self.hot.open(_copy_key(found), use)
            if opened is not None:
                return opened.copy_of(info)
        return None

    async def _fetch(self, found: ObjectInfo) -> None:
        spool = self.spool_path()
        try:
            await self.objects.download(found, spool)
            await self._keep_copy(found, spool, required=True)
        except OSError as exc:
            if is_out_of_space(exc):
                raise self.disk.ran_out("package", found.size) from exc
            raise
        finally:
            await quick(spool.unlink, True)

    async def _keep_copy(self, found: ObjectInfo, spool: Path, required: bool = False) -> None:
        """The spool as the hot copy of found, older copies of its key dropped."""
        if self._too_big(found):
            return
        try:
            await self.hot.publish(_copy_key(found), spool)
        except (OSError, InsufficientStorage) as exc:
            if required:
                raise
            log.info("no hot copy of %s kept: %s", found.key, exc)
        for other in await self.hot.list(found.key + _COPY):
            if other.key != _copy_key(found):
                await self.hot.delete(other.key, other.identity)

    def _too_big(self, found: ObjectInfo) -> bool:
        limit = self.hot.files.max_size
        return limit is not None and found.size > limit

    async def _newest_copy(self, key: str) -> tuple[BlobInfo, str] | None:
        copies = [(info, copy.key) for copy in await self.hot.list(key + _COPY)
                  if (info := _from_copy(key, copy)) is not None]
        return max(copies, key=lambda pair: pair[0].mtime, default=None)

    async def delete(self, key: str, identity: FileIdentity | None = None) -> bool:
        """Delete the object if it still has identity, and its hot copies and last-use
        mark."""
        check_key(key)
        self._stats.forget(key)
        found = await self.objects.head(key)
        gone = False
        if found is not None and (identity is None or _blob_info(found).identity == identity):
            try:
                await self.objects.delete(key, found.etag)
                gone = True
            except Conflict:
                gone = False
        if found is None or gone:
            await self.marks.forget(key)
            for copy in await self.hot.list(key + _COPY):
                await self.hot.delete(copy.key, copy.identity)
        return gone

    async def list(self, prefix: str) -> list[BlobInfo]:
        """Every object under prefix (all pages), in key order."""
        return [_blob_info(found) for found in await self.objects.list(prefix)]

    async def last_uses(self, prefix: str) -> dict[str, float]:
        """What the last-use marks under prefix say (one listing, a GET per mark)."""
        return await self.marks.last_uses(prefix)

    @contextlib.asynccontextmanager
    async def fill_lock(self, name: str, what: str,
                        ready: Ready | None = None) -> AsyncIterator[bool]:
        """A lease in the bucket's index (proxy.store.leases): one fill at a time across
        replicas. Taken under the hot store's flock, so that the processes sharing cache.dir
        queue there instead of polling the bucket."""
        async with self.hot.fill_lock(name, what, ready) as local:
            if not local:  # published while waiting
                yield False
                return
            async with self.leases.lock(name, what, ready) as held:
                yield held

    def reread_usage(self) -> None:
        """The hot copies' usage, as every process sharing cache.dir recorded it."""
        self.hot.reread_usage()

    def health_problem(self) -> str | None:
        """The bucket did not answer lately, or cache.dir takes no writes."""
        return self.objects.problem() or self.hot.health_problem()

    async def direct_url(self, key: str) -> str | None:
        """With cache.s3.serve = "redirect", a presigned URL of the object (None while the
        bucket is unreachable: the hot copy is served)."""
        if not self._redirect or self.objects.problem() is not None:
            return None
        return await self.objects.presigned_get(check_key(key), _PRESIGNED_FOR)


async def open_s3_storage(config: CacheConfig, metrics: Metrics,
                          opened: contextlib.AsyncExitStack,
                          clock: Callable[[], float] = time.time) -> Storage:
    """The bucket of config.s3 as the store and index, hot copies under config.dir (bounded
    by config.max_size), closed by `opened`; clock: the time last-use marks record."""
    s3: S3Config | None = config.s3
    assert s3 is not None, "open_s3_storage needs cache.s3"
    objects = await ObjectStore.connect(s3, metrics, opened)
    hot_dir = config.dir / layout.HOT_COPIES_DIR
    disk = DiskSpace(config.dir, on_full=lambda kind: metrics.disk_full.labels(kind).inc())
    hot = await quick(DiskBlobStore.at, hot_dir, config.max_size,
                      lambda count, _size: metrics.evictions.inc(count), disk)
    opened.callback(hot.close)
    await quick(hot.files.sweep_temp)
    await quick(hot.files.measure)
    if config.max_size is not None and hot.used_bytes > config.max_size:
        await hot.files.evict()
    mirror = await quick(MetadataCache, hot_dir / "index", disk)
    opened.callback(mirror.close)
    index = S3Index(objects, mirror)
    leases = FillLeases(index, LeaseTimings(config.lease_seconds), lease_outcomes(metrics))
    marks = AccessMarks(objects, clock)
    opened.push_async_callback(marks.close)
    blobs = S3BlobStore(objects, hot, leases, redirect=s3.serve == "redirect", marks=marks)
    export_usage(blobs, config.max_size, metrics)
    try:
        await objects.probe()
    except StoreUnavailable as exc:  # start anyway: /readyz says why until it answers
        log.warning("%s", exc.message)
    except LookupError:
        raise StoreUnavailable(f"cache.s3.bucket: no bucket {s3.bucket!r} at the object "
                               "store") from None
    watcher = asyncio.create_task(_watch(objects))
    opened.push_async_callback(_stop, watcher)
    return Storage(blobs, index)


async def _watch(objects: ObjectStore) -> None:
    """While the bucket is taken as unreachable, ask it again every few seconds."""
    while True:
        await asyncio.sleep(_PROBE_EVERY)
        if objects.problem() is not None:
            with contextlib.suppress(StoreUnavailable, LookupError, Conflict):
                await objects.probe()


async def _stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
