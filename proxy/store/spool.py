"""A fill in front of any store: upstream bytes go to a local spool file while they are hashed
(clients follow it as it grows: GrowingFile), are checked against the signed sha256, then the
spool is published through the store (the disk backend renames it: no copy). A fill that
fails publishes nothing, and its followers learn that before they get the last byte."""

from __future__ import annotations

import asyncio
import hashlib
import os
import zipfile
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import aiofiles

from proxy.core.errors import IntegrityError, UpstreamError
from proxy.core.executors import quick, slow
from proxy.store.disk_space import is_out_of_space
from proxy.store.file_identity import FileIdentity
from proxy.store.protocol import BlobInfo, BlobStore
from proxy.store.usage import mark_in_use

# Followers of a download read in pieces this large: memory per client stays small.
_CHUNK = 256 << 10


@dataclass(frozen=True)
class StoredArchive:
    """A verified provider package, published."""

    key: str
    size: int
    sha256: str
    identity: FileIdentity  # as published: what a later hit compares against


class GrowingFile:
    """A download under way: readers follow the spool as it grows, and learn at the end
    whether it verified (then it was published) or not (then they must abort)."""

    def __init__(self, store: BlobStore, temp: Path, size: int | None) -> None:
        self.temp = temp
        self.size = size
        self.written = 0
        self.final: BlobInfo | None = None
        self.error: BaseException | None = None
        self._store = store
        self._changed = asyncio.Event()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def advance(self, count: int) -> None:
        """More bytes are in the spool."""
        self.written += count
        self._wake()

    def complete(self, final: BlobInfo) -> None:
        """Verified and published as final."""
        self.final = final
        self._wake()

    def fail(self, error: BaseException) -> None:
        """Not verified: nothing was published."""
        self.error = error
        self._wake()

    @property
    def done(self) -> bool:
        """Whether the download ended, either way."""
        return self.final is not None or self.error is not None

    async def wait_done(self) -> BlobInfo:
        """The published blob, once there; raises the fill's error."""
        while not self.done:
            await self._changed.wait()
        if self.error is not None:
            raise self.error
        assert self.final is not None
        return self.final

    async def chunks(self) -> AsyncGenerator[bytes, None]:
        """Every byte of the file as it arrives; raises at the end if it did not verify. The
        last byte is held back until the file verified, so a reader of a bad download never
        receives a complete body."""
        try:
            handle = await aiofiles.open(self.temp, "rb")
        except FileNotFoundError:
            # Already published (or removed after a failure): read what was published.
            async for chunk in self._published():
                yield chunk
            return
        mark_in_use(handle.fileno())  # the same file once published on disk: eviction skips it
        offset = 0
        try:
            while True:
                changed = self._changed
                if self.error is not None:
                    raise self.error
                readable = self.written if self.final is not None else self.written - 1
                if offset < readable:
                    data = await handle.read(min(_CHUNK, readable - offset))
                    if not data:
                        raise OSError("temp file shorter than reported")
                    offset += len(data)
                    yield data
                    continue
                if self.final is not None:
                    return
                await changed.wait()
        finally:
            await handle.close()

    async def _published(self) -> AsyncIterator[bytes]:
        final = await self.wait_done()
        blob = await self._store.open(final.key)
        if blob is None:
            raise UpstreamError("the package left the cache before it could be sent")
        try:
            async for chunk in blob.chunks():
                yield chunk
        finally:
            blob.close()


async def store_package(store: BlobStore, key: str, chunks: AsyncIterator[bytes],
                        expected_sha256: str, progress: GrowingFile | None = None,
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
        stored = StoredArchive(key, size, actual, info.identity)
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
