"""A fill in front of any store: upstream bytes go to a local spool file while they are hashed
(clients follow it as it grows: proxy.core.spool), are checked against the signed sha256, then the
spool is published through the store (the disk backend renames it: no copy). A fill that
fails publishes nothing, and its followers learn that before they get the last byte."""

from __future__ import annotations

import hashlib
import os
import zipfile
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import aiofiles

from proxy.core.errors import IntegrityError, UpstreamError
from proxy.core.executors import quick, slow
from proxy.core.spool import GrowingFile
from proxy.store.disk_space import is_out_of_space
from proxy.store.protocol import BlobInfo, BlobStore
from proxy.store.usage import mark_in_use


@dataclass(frozen=True)
class StoredArchive:
    """A verified provider package, published."""

    info: BlobInfo  # its identity as published: what a later hit compares against
    sha256: str


async def new_spool(store: BlobStore, size: int | None) -> GrowingFile[BlobInfo]:
    """A fresh, empty spool that readers may follow while a fill writes it (their handles
    are marked in use, as a stored file's are); a reader that comes after it was published
    reads the published blob."""
    spool: GrowingFile[BlobInfo] = GrowingFile(
        store.spool_path(), size, mark_in_use, lambda final: _published(store, final))
    await quick(spool.temp.touch)
    return spool


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
                        published: Callable[[StoredArchive], Awaitable[None]] | None = None
                        ) -> StoredArchive:
    """Write a provider zip to a spool (readers may follow it through `progress`), check
    sha256 and that it is a zip, publish it at key, then await `published` (recording what
    vouches for the blob) before the readers get the end of it."""
    temp = progress.temp if progress is not None else store.spool_path()
    digest = hashlib.sha256()
    size = 0
    try:
        # Unbuffered: each write is on disk (in the page cache) for followers at once.
        async with aiofiles.open(temp, "wb", buffering=0) as handle:
            async for chunk in chunks:
                digest.update(chunk)
                size += len(chunk)
                # An unbuffered write may take only part of the chunk (a disk filling up):
                # the rest is written, or the next attempt raises.
                pending = memoryview(chunk)
                while pending:
                    pending = pending[await handle.write(pending):]
                if progress is not None:
                    progress.advance(len(chunk))
            await slow(os.fsync, handle.fileno())  # flushes a whole package
        actual = digest.hexdigest()
        if actual != expected_sha256:
            raise IntegrityError("checksum", f"package sha256 {actual} does not match the "
                                 f"signed checksum {expected_sha256}")
        # Reading the zip's directory is quick; the full h1 pass comes after publishing,
        # so that readers following the download are not held up by it.
        if not await quick(zipfile.is_zipfile, temp):
            raise IntegrityError("archive", "package is not a valid zip")
        info = await store.publish(key, temp)
        stored = StoredArchive(info, actual)
        if published is not None:
            # A client that has the whole file (a `warm` about to stop the proxy) then
            # finds it recorded.
            await published(stored)
    except BaseException as exc:
        # Synchronous on purpose: this also runs when the fill is cancelled.
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
    if progress is not None:
        progress.complete(info)
    return stored
