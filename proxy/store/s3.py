"""The S3 backend: blobs are objects in a bucket shared by every replica (proxy.store.s3_objects),
index documents small JSON objects beside them (proxy.store.s3_index). Hits are served from
hot copies: whole local files under cache.dir, in a disk store bounded by cache.max_size, so
a hit is a sendfile like on the disk backend, and keeps being served while the bucket is
unreachable.

A hot copy holds verified bytes. It is fetched whole before its first byte is sent (not
streamed while it is written), hashed as it is written, compared with the sha256 that the
blob's index record vouches for and flushed to the disk before it is renamed into place (a
copy kept from a publish is the verified spool itself). Its local identity is recorded
(proxy.store.s3_copies), and every hit compares the open file with it, as the disk backend
does with its files: a copy written to since it was checked is read again, and if it is not
the vouched bytes it is dropped and fetched again from the bucket, never served. A blob too
big for the hot copies is streamed from the bucket with ranged GETs instead.

Damage found on a read is told apart before anything shared is deleted (drop_damaged): a
damaged hot copy is dropped alone; the object in the bucket is deleted only once its own
bytes, read from the bucket, fail the check. An object whose bytes fail it when a hot copy is
made is remembered as damaged, so that the record check that follows reads it again and drops
it (online, the package is then fetched again from upstream).

A hot copy's name is the blob's key plus `~TAG-MTIME`, TAG from the object's ETag: the name
alone says which object it is a copy of, so a replaced object is never served from the copy
of the old one, and the copy vouches for itself when the bucket cannot be asked."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import os
import tempfile
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Callable
from pathlib import Path
from typing import BinaryIO

import aiofiles

from proxy.config.settings import CacheConfig, S3Config
from proxy.core.digits import is_decimal
from proxy.core.errors import InsufficientStorage
from proxy.core.executors import quick, slow
from proxy.core.metrics import Metrics
from proxy.core.singleflight import SingleFlight
from proxy.store import layout
from proxy.store.damage import DamagedFile, Dropped
from proxy.store.disk import DiskBlob, DiskBlobStore
from proxy.store.disk_space import DiskSpace, is_out_of_space
from proxy.store.file_identity import FileIdentity, identity_of
from proxy.store.index import MetadataCache
from proxy.store.leases import FillLeases, LeaseTimings, lease_outcomes
from proxy.store.protocol import (
    BlobInfo,
    DamageListener,
    MetadataIndex,
    Ready,
    Storage,
    check_key,
    export_usage,
)
from proxy.store.s3_copies import HotCopies
from proxy.store.s3_heads import RecentHeads
from proxy.store.s3_index import S3Index
from proxy.store.s3_marks import AccessMarks
from proxy.store.s3_objects import Conflict, ObjectInfo, ObjectStore, StoreUnavailable

log = logging.getLogger(__name__)
_DEVICE = 0x5333  # "S3": an identity from an object, never a local file's
_COPY = "~"
# Seconds between probes of the bucket while it answers, and while it does not.
_PROBE_UP = 4.0
_PROBE_DOWN = 2.0
_PRESIGNED_FOR = 900
_DAMAGED_KEPT = 1024  # objects remembered as damaged, newest first


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
    if not copy.key.startswith(key + _COPY) or len(tag) != 15 or not is_decimal(mtime):
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

    def quick_to_close(self) -> bool:
        """Always: nothing held."""
        return True


class S3BlobStore:
    """The BlobStore over a bucket, with hot copies of what was read in a disk store."""

    def __init__(self, objects: ObjectStore, hot: DiskBlobStore, leases: FillLeases,
                 copies: HotCopies, index: MetadataIndex | None = None,
                 redirect: bool = False, marks: AccessMarks | None = None,
                 metrics: Metrics | None = None) -> None:
        self.objects = objects
        self.hot = hot
        self.leases = leases
        self.copies = copies
        # Where the sha256 each blob must have is recorded (None: hot copies are checked
        # against nothing but their own recorded hash).
        self._index = index
        self.marks = marks or AccessMarks(objects)
        self._redirect = redirect
        self._metrics = metrics
        self._fetches: SingleFlight[None] = SingleFlight()
        self._stats = RecentHeads()  # what stats found, for the opens that follow them
        # Objects whose bytes failed the check when a hot copy was made: key -> ETag.
        self._damaged: OrderedDict[str, str] = OrderedDict()
        self._listeners: list[DamageListener] = []

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

    def fill_notice(self, _name: str) -> Path | None:
        """None: a publish uploads the spool; the blob's identity is the object's."""
        return None

    def watch_damage(self, listener: DamageListener) -> None:
        """listener is told of each damaged hot copy this store drops by itself."""
        self._listeners.append(listener)

    async def publish(self, key: str, spool: Path) -> BlobInfo:
        """Upload the verified spool to its final key (the store checks each part's
        SHA-256), then keep the spool as the blob's hot copy."""
        check_key(key)
        try:
            uploaded = await self.objects.upload(key, spool)
            found = await self.objects.head(key)
            if found is None:
                raise StoreUnavailable(f"{key} was not in the bucket right after its upload")
            self._damaged.pop(key, None)
            if found.etag == uploaded.etag:  # else another writer's object replaced ours
                await self._keep_copy(found, spool, uploaded.sha256)
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
                await handle.flush()
                await slow(os.fsync, handle.fileno())
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
        it when the bucket is unreachable. An object found damaged is described with an
        identity no record holds: whoever checks it against its record reads it again."""
        found = await self._find(key)
        self._stats.found(key, found if isinstance(found, ObjectInfo) else None)
        if isinstance(found, ObjectInfo):
            info = _blob_info(found)
            if self._damaged.get(key) == found.etag:
                return BlobInfo(key, info.size, info.mtime, info.identity._replace(inode=0))
            return info
        return None if found is None else found[0]

    async def open(self, key: str, use: bool = True) -> DiskBlob | RemoteBlob | None:
        """The blob's hot copy, fetched whole first if there is none (once, however many
        ask); a blob too big for hot copies is read from the bucket. While the bucket is
        unreachable, the newest hot copy is served. A use (unless use is False): its
        last-use mark is written in the background (at most hourly). Raises DamagedFile for
        an object whose bytes are not what its record vouches for. A check (use False) gets
        a hot copy as it is, for the caller to read and judge."""
        opened = await self._open(key, use)
        if opened is not None and use:
            self.marks.used(key)
        return opened

    async def _open(self, key: str, use: bool) -> DiskBlob | RemoteBlob | None:
        stated = self._stats.recent(key)
        for _attempt in range(3):
            found = stated or await self._find(key)
            stated = None
            if found is None:
                return None
            if isinstance(found, tuple):  # the bucket is unreachable
                opened = await self._open_copy(key, found[1], use)
                if opened is None:
                    raise StoreUnavailable(self.objects.problem() or "the object store is "
                                           "unreachable, and the local copy went")
                return opened.copy_of(found[0])
            info = _blob_info(found)
            if self._damaged.get(key) == found.etag:
                raise _damaged_object(found, None, None)
            opened = await self._open_copy(key, _copy_key(found), use)
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
            opened = await self._open_copy(key, _copy_key(found), use)
            if opened is not None:
                return opened.copy_of(info)
        return None

    async def open_shared(self, key: str) -> RemoteBlob | None:
        """The object in the bucket itself, read with ranged GETs (no hot copy made or
        read); None if there is none."""
        check_key(key)
        found = await self.objects.head(key)
        return None if found is None else RemoteBlob(found, self.objects, self.hot.files.tmp)

    async def _open_copy(self, key: str, copy_key: str, use: bool) -> DiskBlob | None:
        """The hot copy at copy_key, open, if it is the file that was checked; a copy
        written to since is read again, and dropped if its bytes are not the vouched ones
        (None then: fetch it again). A check (use False) gets the copy as it is."""
        opened = await self.hot.open(copy_key, use)
        if opened is None:
            return None
        local = opened.info.identity  # the file's own, before it is described as the blob
        if not use or await self.copies.checked(copy_key, local) is not None:
            return opened
        try:
            expected = await self._vouched_sha256(key)
            actual = await slow(_sha256_of_open, opened.file())
        except BaseException:
            await quick(opened.close)
            raise
        if expected is not None and actual == expected \
                and await quick(opened.current_identity) == local:
            await self.copies.record(copy_key, local, actual)  # an older release's copy
            return opened
        await quick(opened.close)
        await self._drop_copy(copy_key, local)
        if expected is not None:
            self._report_copy(key, f"the local hot copy {copy_key.rpartition('/')[2]} has "
                                   f"sha256 {actual}, not the {expected} its record vouches "
                                   "for; dropped it, fetching it again from the bucket")
        return None

    async def _fetch(self, found: ObjectInfo) -> None:
        spool = self.spool_path()
        try:
            actual = await self.objects.download(found, spool)  # flushed to the disk
            expected = await self._vouched_sha256(found.key)
            if expected is not None and actual != expected:
                self._remember_damaged(found)
                raise _damaged_object(found, actual, expected)
            await self._keep_copy(found, spool, actual, required=True)
        except OSError as exc:
            if is_out_of_space(exc):
                raise self.disk.ran_out("package", found.size) from exc
            raise
        finally:
            await quick(spool.unlink, True)

    async def _vouched_sha256(self, key: str) -> str | None:
        """The sha256 the record vouching for the blob at key holds; None without one."""
        where = layout.vouching_sha256(key)
        if where is None or self._index is None:
            return None
        record = await self._index.get(where[0])
        value = None if record is None else record.get(where[1])
        return value.lower() if isinstance(value, str) and value else None

    async def _keep_copy(self, found: ObjectInfo, spool: Path, sha256: str,
                         required: bool = False) -> None:
        """The spool (flushed, its bytes hashed to sha256) as the hot copy of found, older
        copies of its key dropped. Recorded before it is renamed into place (a rename keeps
        the identity): a process that opens it at once finds it checked."""
        if self._too_big(found):
            return
        copy_key = _copy_key(found)
        try:
            await self.copies.record(copy_key, identity_of(await quick(os.stat, spool)), sha256)
            await self.hot.publish(copy_key, spool)
        except (OSError, InsufficientStorage) as exc:
            await self.copies.forget(copy_key)
            if required:
                raise
            log.info("no hot copy of %s kept: %s", found.key, exc)
        for other in await self.hot.list(found.key + _COPY):
            if other.key != copy_key:
                await self._drop_copy(other.key, other.identity)

    async def _drop_copy(self, copy_key: str, identity: FileIdentity | None) -> None:
        await self.hot.delete(copy_key, identity)
        await self.copies.forget(copy_key)

    def _remember_damaged(self, found: ObjectInfo) -> None:
        self._damaged[found.key] = found.etag
        self._damaged.move_to_end(found.key)
        while len(self._damaged) > _DAMAGED_KEPT:
            self._damaged.popitem(last=False)

    def _report_copy(self, key: str, message: str) -> None:
        log.warning("integrity failure (hot_copy): %s: %s", key, message)
        if self._metrics is not None:
            self._metrics.integrity_failures.labels("hot_copy").inc()
        for listener in self._listeners:
            listener(key, message)

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
        gone = found is None
        if found is not None and (identity is None or _blob_info(found).identity == identity):
            gone = await self._delete_object(found)
        if gone:
            await self.marks.forget(key)
            await self._drop_copies(key)
        return gone and found is not None

    async def _delete_object(self, found: ObjectInfo) -> bool:
        try:
            await self.objects.delete(found.key, found.etag)
        except Conflict:
            return False
        self._damaged.pop(found.key, None)
        return True

    async def _drop_copies(self, key: str) -> int:
        copies = await self.hot.list(key + _COPY)
        for copy in copies:
            await self._drop_copy(copy.key, copy.identity)
        return len(copies)

    async def drop_damaged(self, key: str, identity: FileIdentity | None,
                           expected: str | None) -> Dropped:
        """This replica's hot copies of the blob go; the object in the bucket goes only if
        it still has identity and its own bytes, read from the bucket now, are not expected
        (None: what its record vouches for). Intact, it stays, and the bytes just read become
        the new hot copy."""
        check_key(key)
        self._stats.forget(key)
        copies = await self._drop_copies(key)
        local = Dropped.LOCAL_COPY if copies else Dropped.NOTHING
        found = await self.objects.head(key)
        if found is None or (identity is not None
                             and _blob_info(found).identity.inode != identity.inode):
            return local  # gone, or replaced since it was read: not the bytes judged
        expected = expected or await self._vouched_sha256(key)
        if expected is None:
            log.warning("%s: no record says what its bytes must be; the object in the bucket "
                        "is kept", key)
            return local
        spool = self.spool_path()
        try:
            try:
                actual = await self.objects.download(found, spool)
            except (Conflict, LookupError):
                return local
            if actual == expected.lower():
                self._damaged.pop(key, None)
                await self._keep_copy(found, spool, actual)
                return local
        finally:
            await quick(spool.unlink, True)
        if not await self._delete_object(found):
            return local
        await self.marks.forget(key)
        log.error("%s: the object in the bucket has sha256 %s, not %s; deleted it", key,
                  actual, expected)
        return Dropped.BLOB

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
        """cache.dir takes no writes (the bucket's state is store_problem's: hot copies are
        served without it)."""
        return self.hot.health_problem()

    def store_problem(self) -> str | None:
        """Why the bucket is taken as unreachable now, or None."""
        return self.objects.problem()

    async def direct_url(self, key: str) -> str | None:
        """With cache.s3.serve = "redirect", a presigned URL of the object (None while the
        bucket is unreachable: the hot copy is served)."""
        if not self._redirect or self.objects.problem() is not None:
            return None
        return await self.objects.presigned_get(check_key(key), _PRESIGNED_FOR)


def _damaged_object(found: ObjectInfo, actual: str | None, expected: str | None) -> DamagedFile:
    what = f"has sha256 {actual}, not the {expected} its record vouches for" \
        if actual is not None else "failed its check when it was last read"
    return DamagedFile(f"(the object in the bucket) {what}", _blob_info(found).identity,
                       actual, expected)


def _sha256_of_open(handle: BinaryIO) -> str:
    digest = hashlib.sha256()
    handle.seek(0)
    while chunk := handle.read(1 << 20):
        digest.update(chunk)
    handle.seek(0)
    return digest.hexdigest()


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
    leases = FillLeases(index, LeaseTimings.for_duration(config.lease_seconds),
                        lease_outcomes(metrics))
    marks = AccessMarks(objects, clock)
    opened.push_async_callback(marks.close)
    blobs = S3BlobStore(objects, hot, leases, HotCopies(mirror), index,
                        redirect=s3.serve == "redirect", marks=marks, metrics=metrics)
    export_usage(blobs, config.max_size, metrics)
    try:
        await objects.probe()
    except StoreUnavailable as exc:  # start anyway: hot copies serve, /readyz says why
        log.warning("%s", exc.message)
    except LookupError:
        raise StoreUnavailable(f"cache.s3.bucket: no bucket {s3.bucket!r} at the object "
                               "store") from None
    watcher = asyncio.create_task(_watch(objects))
    opened.push_async_callback(_stop, watcher)
    return Storage(blobs, index)


async def _watch(objects: ObjectStore) -> None:
    """Ask the bucket whether it answers on a schedule, whatever the traffic (more often
    while it does not): an outage shows within seconds in /status.json, /readyz and
    tfproxy_store_up, not only once a request failed."""
    while True:
        await asyncio.sleep(_PROBE_DOWN if objects.problem() is not None else _PROBE_UP)
        with contextlib.suppress(StoreUnavailable, LookupError, Conflict):
            await objects.probe()


async def _stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
