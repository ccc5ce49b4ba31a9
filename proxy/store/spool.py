"""A fill in front of any store: upstream bytes go to a local spool file while they are hashed
(clients follow it as it grows: proxy.core.spool), are checked against the signed sha256, then the
spool is published through the store (the disk backend renames it: no copy). A fill that
fails publishes nothing, and its followers learn that before they get the last byte."""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
import zipfile
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proxy.core.errors import IntegrityError, UpstreamError
from proxy.core.executors import quick, quick_soon, quick_started, slow, slow_started
from proxy.core.spool import GrowingFile, close_when_opened
from proxy.store.disk_space import free_bytes, is_out_of_space
from proxy.store.protocol import BlobInfo, BlobStore
from proxy.store.usage import mark_in_use


@dataclass(frozen=True)
class StoredArchive:
    """A verified provider package, published."""

    info: BlobInfo  # its identity as published: what a later hit compares against
    sha256: str


class SpoolStart:
    """A spool begun while upstream is asked for the download (`async with
    SpoolStart(store) as start` around the request): the spool's file is made and opened on
    the quick pool meanwhile. Only the cache disk's free space (one statvfs, on the event
    loop) stands before a cold package's headers: making a file can wait milliseconds on the
    file system's journal, and the first bytes go to their clients from memory (the fill
    writes, and readers that fall behind read, once it is made). Left without a spool taken
    from it (the download failed first, or could not fit), its file is removed before the
    block ends (the answer that follows leaves nothing behind), or once made if the block
    was cancelled."""

    def __init__(self, store: BlobStore) -> None:
        self._store = store
        self._temp = store.spool_path()
        self._made = quick_started(_make_spool_file, self._temp)
        self._taken = False

    async def __aenter__(self) -> SpoolStart:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        if self._taken:  # the spool's fill removes it
            return
        try:
            fd = await asyncio.shield(self._made)
        except asyncio.CancelledError:
            _remove_once_made(self._made, self._temp)
            raise
        except OSError:
            return  # never made
        await asyncio.shield(quick(_discard, fd, self._temp))

    async def spool(self, size: int | None) -> GrowingFile[BlobInfo]:
        """The spool for a download of size (None: unknown). One that cannot fit is refused
        (InsufficientStorage: a 507 before any headers)."""
        # On the event loop: microseconds in a local cache directory, where a hop to the
        # quick pool for it waited milliseconds for a core in about a tenth of traced cold
        # misses, right before the headers.
        free = free_bytes(self._store.disk.directory)
        if size is not None:
            self._store.disk.require_room("package", size, free)
        made = self._made
        if made.done() and not made.cancelled() and (failed := made.exception()) is not None:
            raise failed  # no file can be made (no inode left, no permission): before headers
        self._taken = True
        return spool_of(self._store, self._temp, size, self._made)


def _remove_once_made(made: asyncio.Future[int], temp: Path) -> None:
    """Close and remove the spool file being made: now if it is made, else once it is
    (synchronous, so that a cancelled block or fill runs it too)."""
    made.add_done_callback(close_when_opened)
    if not made.done():
        made.add_done_callback(lambda _made: quick_soon(temp.unlink, True))
    temp.unlink(missing_ok=True)


def _discard(fd: int, temp: Path) -> None:
    """Close and remove a spool file nobody took (blocking)."""
    os.close(fd)
    temp.unlink(missing_ok=True)


def _make_spool_file(temp: Path) -> int:
    """Make the spool file, open for writing (blocking)."""
    return os.open(temp, _WRITE_FLAGS | os.O_EXCL, 0o666)


def spool_of(store: BlobStore, temp: Path, size: int | None,
             made: asyncio.Future[int] | None = None) -> GrowingFile[BlobInfo]:
    """The spool at temp (being made: made), to be published to store: its readers' handles
    are marked in use, and a reader that comes after it was published reads the published
    blob."""
    return GrowingFile(temp, size, mark_in_use, lambda final: _published(store, final),
                       made=made)


async def _published(store: BlobStore, final: BlobInfo) -> AsyncIterator[bytes]:
    blob = await store.open(final.key)
    if blob is None:
        raise UpstreamError("the package left the cache before it could be sent")
    try:
        async for chunk in blob.chunks():
            yield chunk
    finally:
        blob.close()


async def store_package(store: BlobStore, key: str, chunks: AsyncIterator[bytes],
                        expected_sha256: str, progress: GrowingFile[BlobInfo] | None = None,
                        published: Callable[[StoredArchive], Awaitable[None]] | None = None,
                        is_zip: bool = True) -> StoredArchive:
    """Write a provider zip (or another archive: not is_zip) to a spool (readers may follow
    it through `progress`), check sha256 and that it is a zip, publish it at key, then await
    `published` (recording what vouches for the blob) before the readers get the end of it."""
    temp = progress.temp if progress is not None else store.spool_path()
    on_disk = progress.advance if progress is not None else _ignore
    size = 0
    spool: _SpoolWriter | None = None
    # Opened while the first chunk goes to the followers (a thread hop less before a cold
    # package's first byte); the spool is written from the first batch on. A spool made
    # already is not made again (a failure that removed it first leaves no file behind).
    opening: asyncio.Future[int] | None
    if progress is not None and progress.made is not None:
        opening = progress.made  # made and opened by its SpoolStart
    else:
        flags = _WRITE_FLAGS if progress is None else _WRITE_FLAGS & ~os.O_CREAT
        opening = quick_started(os.open, temp, flags, 0o666)
    try:
        batch: list[bytes] = []
        batched = 0
        batch_started = 0.0
        if progress is not None:
            # The first reader's headers before the download's bytes: reading what upstream
            # buffered does not give way, and a cold package's first byte (the headers, for a
            # client) waited milliseconds behind it on a busy machine.
            await progress.first_reader()
        async for chunk in chunks:
            if progress is not None:
                progress.arrived(chunk)  # followers have it from memory now
                if not size:
                    # The next chunks may be buffered already, and reading them does not
                    # give way: the followers send the first one now (a client's first byte).
                    await asyncio.sleep(0)
            if spool is None:
                spool = _SpoolWriter(await _opened(opening), on_disk)
                opening = None
            size += len(chunk)
            if not batch:
                batch_started = time.monotonic()
            batch.append(chunk)
            batched += len(chunk)
            # The next batch starts once the one before is on disk; while it is not, bytes
            # keep coming (followers get them from memory) up to _AHEAD, then the fill waits.
            # A slow upstream's bytes go to disk after _LINGER even in a small batch: other
            # processes' clients of this fill follow the spool file, not this memory.
            if batched >= _AHEAD or (spool.ready() and (
                    batched >= _BATCH or time.monotonic() - batch_started >= _LINGER)):
                await spool.write(batch)
                batch, batched = [], 0
        if spool is None:  # nothing came
            spool = _SpoolWriter(await _opened(opening), on_disk)
            opening = None
        await spool.write(batch)
        await spool.wait()
        # The bytes went to the disk during the download (see _FLUSH_EVERY): what is left to
        # flush before publishing is the tail, not the whole package.
        await spool.flushed()
        await slow(os.fsync, spool.fd)
        actual = spool.digest.hexdigest()
        fd, spool = spool.fd, None
        await quick(os.close, fd)
        if actual != expected_sha256:
            raise IntegrityError("checksum", f"package sha256 {actual} does not match the "
                                 f"signed checksum {expected_sha256}")
        # Reading the zip's directory is quick; the full h1 pass comes after publishing,
        # so that readers following the download are not held up by it.
        if is_zip and not await quick(zipfile.is_zipfile, temp):
            raise IntegrityError("archive", "package is not a valid zip")
        info = await store.publish(key, temp)
        stored = StoredArchive(info, actual)
        if published is not None:
            # A client that has the whole file (a `warm` about to stop the proxy) then
            # finds it recorded.
            await published(stored)
    except BaseException as exc:
        # Synchronous on purpose: this also runs when the fill is cancelled.
        if spool is not None:
            spool.close()
            spool = None
        if opening is not None:  # once open, closed and removed: never leaked
            _remove_once_made(opening, temp)
        else:
            temp.unlink(missing_ok=True)
        error = exc
        if is_out_of_space(exc):
            error = store.disk.ran_out(
                "package", progress.size if progress is not None else None, size)
        if progress is not None:  # every client following the download learns it now
            progress.fail(error if isinstance(error, Exception)
                          else UpstreamError("the download was interrupted"))
        if error is not exc:
            raise error from exc
        raise
    finally:
        if spool is not None:
            spool.close()
    if progress is not None:
        progress.complete(info)
    return stored


# Bytes hashed and written per job on the slow pool, at least: few hops, and hashlib
# releases the GIL over each chunk, so the loop receives the next ones meanwhile.
_BATCH = 1 << 20
# At most this much waits for the disk (and the hash) while a batch is written: past it, the
# fill waits for them. More kept peak memory up (20 clients on a 1 GiB fill: 4 MiB here cost
# 12 MiB of RSS) for no measurable speed.
_AHEAD = 2 << 20
_LINGER = 0.05  # seconds
_PIECE = 256 << 10  # hashed, then written, while it is in the CPU's cache
# Written bytes are flushed to the disk (fdatasync, beside the writes, not in their way) each
# time this many more are written: the fsync before publishing, which the last byte of every
# follower waits for, then flushes only the tail (a 100 MiB package at once took ~45 ms).
_FLUSH_EVERY = 8 << 20
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC


class _SpoolWriter:
    """Hashes a fill's bytes and appends them to its spool on the slow pool, one batch at a
    time, while the loop receives the next batch (and hands it to the followers); tells
    on_disk the size of each batch once it is written."""

    def __init__(self, fd: int, on_disk: Callable[[int], None]) -> None:
        self.fd = fd
        self.digest = hashlib.sha256()
        self._on_disk = on_disk
        self._pending: asyncio.Future[int] | None = None
        self._flushing: asyncio.Future[None] | None = None
        self._unflushed = 0

    def ready(self) -> bool:
        """Whether no batch is being written: the next one can start at once."""
        return self._pending is None or self._pending.done()

    async def write(self, batch: list[bytes]) -> None:
        """Start on batch once the one before is on disk."""
        await self.wait()
        self._raise_flush_error()
        if batch:
            self._pending = slow_started(_hash_and_write, self.digest, self.fd, batch)
            self._pending.add_done_callback(self._written)

    def _written(self, done: asyncio.Future[int]) -> None:
        if not done.cancelled() and done.exception() is None:
            self._on_disk(done.result())
            self._unflushed += done.result()
            if self._unflushed >= _FLUSH_EVERY and self.fd >= 0 and self._flush_ended_well():
                self._unflushed = 0
                self._flushing = slow_started(os.fdatasync, self.fd)

    def _flush_ended_well(self) -> bool:
        """Whether no flush is under way and none failed (its error is kept for the fill)."""
        flushing = self._flushing
        return flushing is None or (flushing.done() and not flushing.cancelled()
                                    and flushing.exception() is None)

    def _raise_flush_error(self) -> None:
        """Raise what the last flush that ended raised (a disk that fails its writes)."""
        flushing = self._flushing
        if flushing is not None and flushing.done():
            flushing.result()

    async def flushed(self) -> None:
        """Return once the flush under way (if any) is done; raise what it did."""
        flushing = self._flushing
        if flushing is not None:
            await asyncio.shield(flushing)  # as wait(): never close the file under it

    async def wait(self) -> None:
        """Return once the batch under way (if any) is on disk; raise what writing it did."""
        pending = self._pending
        if pending is None:
            return
        # Shielded, and kept until it is done: a cancelled fill must not close the file
        # under a thread still writing to it (see close).
        await asyncio.shield(pending)
        self._pending = None

    def close(self) -> None:
        """Close the spool now, or once the batch still being written and the flush under way
        are done (on cancellation)."""
        fd, self.fd = self.fd, -1  # no new flush starts on it
        jobs = [job for job in (self._pending, self._flushing) if job is not None]
        for job in jobs:
            if job.done() and not job.cancelled():
                job.exception()  # retrieved: the fill already failed, or it is closing
        busy = [job for job in jobs if not job.done()]
        self._pending = self._flushing = None
        if not busy:
            os.close(fd)
            return
        left = len(busy)

        def one_done(done: asyncio.Future[Any]) -> None:
            nonlocal left
            if not done.cancelled():
                done.exception()  # retrieved: the fill already failed, or it is closing
            left -= 1
            if left == 0:
                os.close(fd)
        for job in busy:
            job.add_done_callback(one_done)


def _ignore(_count: int) -> None:
    pass


async def _opened(opening: asyncio.Future[int] | None) -> int:
    """The spool's descriptor, once open (shielded: a cancelled fill must not leave it open
    for nobody to close; the failure path closes it)."""
    assert opening is not None
    return await asyncio.shield(opening)


def _hash_and_write(digest: hashlib._Hash, fd: int, batch: list[bytes]) -> int:
    """Hash the batch and write it (blocking), a piece at a time: each piece is written
    while hashing just brought it into the CPU's cache (hashing the whole batch first, then
    writing it, made the copy into the page cache several times dearer)."""
    total = 0
    for chunk in batch:
        view = memoryview(chunk)
        for start in range(0, len(view), _PIECE):
            piece = view[start:start + _PIECE]
            digest.update(piece)
            while piece:
                # A write may take only part of it (a disk filling up): the rest is
                # written, or the next attempt raises.
                piece = piece[os.write(fd, piece):]
        total += len(view)
    return total
