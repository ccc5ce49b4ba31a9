"""Where an import goes: the store that cache.dir or cache.s3 names, read and changed by the
import's planning code alike. A plan is applied all or nothing: verified files are published
first, then the index records that vouch for them (a provider package with no record is not
served, so an import cut short is never served), and a failure at any step undoes what this
import published, so that a refused import leaves the store as it was.

The disk cache keeps its own fast path (proxy.store.disk_import: files renamed into place,
records written in one transaction); any other backend is changed through the storage seam
(proxy.store.protocol), from this synchronous command on an event loop of its own."""

from __future__ import annotations

import asyncio
import logging
import shutil
import sqlite3
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from contextlib import AsyncExitStack, contextmanager
from copy import deepcopy
from pathlib import Path
from typing import Any, Protocol, TypeVar

from botocore.exceptions import BotoCoreError, ClientError

from proxy.airgap.manifest import BundleError
from proxy.airgap.publish import apply_changes, measure, regular_sha256
from proxy.config.settings import Config
from proxy.core.errors import InsufficientStorage, ProxyError
from proxy.core.executors import slow, slow_then_close
from proxy.core.metrics import Metrics
from proxy.store.damage import DamagedFile
from proxy.store.disk import DiskBlobStore
from proxy.store.disk_import import CacheChanges, IndexReader, cache_work, existing_index
from proxy.store.protocol import BlobInfo, Storage
from proxy.store.s3 import open_s3_storage
from proxy.store.s3_objects import Conflict
from proxy.verification.hashes import sha256_of_file

log = logging.getLogger(__name__)
T = TypeVar("T")
# What talking to a store over the seam may raise (an object store: unreachable, refusing a
# request, a conditional write lost; the local disk of spools and hot copies).
_STORE_ERRORS = (ProxyError, Conflict, OSError, sqlite3.Error, BotoCoreError, ClientError,
                 LookupError)


class ImportTarget(Protocol):
    """The store an import plans against and then changes."""

    def spool_path(self) -> Path:
        """A fresh local file name to copy a file to before it is checked and published."""
        ...

    def work_dir(self) -> Path:
        """A fresh local directory to stage a bundle's members in."""
        ...

    def record(self, key: str) -> Any:
        """The index record at key as the store holds it (None: none)."""
        ...

    def blob_sha256(self, key: str) -> str | None:
        """The sha256 of the blob at key (None: no blob; "": not a regular file)."""
        ...

    def put_file(self, staged: Path, key: str) -> None:
        """Publish the verified file staged as the blob at key when applied."""
        ...

    def set_record(self, key: str, value: Any) -> None:
        """Write the index record at key when applied."""
        ...

    def planned(self, key: str) -> Any:
        """The value planned for record key (None: none planned)."""
        ...

    def apply(self) -> None:
        """Publish every planned file, then write every planned record; a failure undoes all
        of it and raises BundleError."""
        ...


@contextmanager
def import_target(config: Config) -> Iterator[ImportTarget]:
    """The store of config (the bucket of cache.s3 if set, else the cache directory)."""
    if config.cache.s3 is None:
        with cache_work(config.cache.dir) as store, existing_index(config.cache.dir) as index:
            yield DiskTarget(store, index)
        return
    with asyncio.Runner() as runner:
        opened = AsyncExitStack()
        try:
            storage = runner.run(_opened(open_s3_storage(config.cache, Metrics(), opened)))
            yield SeamTarget(runner, storage)
        finally:
            runner.run(opened.aclose())


async def _opened(opening: Awaitable[T]) -> T:
    try:
        return await opening
    except _STORE_ERRORS as exc:
        raise BundleError(f"cannot open the cache: {_reason(exc)} (nothing was imported)") \
            from None


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ProxyError):
        return exc.message
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.filename}: {exc.strerror}" if exc.filename else exc.strerror
    return repr(exc)[:300]


class DiskTarget:
    """The cache directory: files moved into place, records in one diskcache transaction."""

    def __init__(self, store: DiskBlobStore, index: IndexReader | None) -> None:
        self._store = store
        self._index = index
        self._changes = CacheChanges(store)

    def spool_path(self) -> Path:
        """A temp file in the cache's temp area (published by a rename)."""
        return self._store.spool_path()

    def work_dir(self) -> Path:
        """A work directory in the cache's temp area."""
        return self._store.work_dir()

    def record(self, key: str) -> Any:
        """The record in the cache's index (None: none, or no index yet)."""
        return self._index.get(key) if self._index is not None else None

    def blob_sha256(self, key: str) -> str | None:
        """The sha256 of the file at key's path."""
        return regular_sha256(self._store.path_of(key))

    def put_file(self, staged: Path, key: str) -> None:
        """Move staged into place when applied."""
        self._changes.put_file(staged, key)

    def set_record(self, key: str, value: Any) -> None:
        """Write the record when applied."""
        self._changes.set_record(key, value)

    def planned(self, key: str) -> Any:
        """The value planned for record key."""
        return self._changes.record(key)

    def apply(self) -> None:
        """Apply the changes (all of it undone on a failure), then count the cache again so
        that running proxies hold the new files against cache.max_size."""
        apply_changes(self._changes)
        measure(self._store, self._changes)


class SeamTarget:
    """Any store, through the seam (BlobStore, MetadataIndex), from a synchronous command:
    each call runs on the command's own event loop."""

    def __init__(self, runner: asyncio.Runner, storage: Storage) -> None:
        self._runner = runner
        self._storage = storage
        self._files: list[tuple[Path, str]] = []
        self._records: dict[str, Any] = {}

    def _run(self, work: Coroutine[Any, Any, T]) -> T:
        try:
            return self._runner.run(work)
        except InsufficientStorage as exc:
            raise BundleError(f"cannot use the cache: {exc.message}") from None
        except _STORE_ERRORS as exc:
            raise BundleError(f"cannot read the cache: {_reason(exc)} (nothing was "
                              "imported)") from None

    def spool_path(self) -> Path:
        """A local spool of the store, consumed by its publish."""
        return self._storage.blobs.spool_path()

    def work_dir(self) -> Path:
        """A local work directory of the store."""
        return self._storage.blobs.work_dir()

    def record(self, key: str) -> Any:
        """The store's document at key."""
        return self._run(self._storage.index.get(key))

    def blob_sha256(self, key: str) -> str | None:
        """The sha256 of the blob at key, read whole."""
        return self._run(self._sha256(key))

    async def _sha256(self, key: str) -> str | None:
        try:
            blob = await self._storage.blobs.open(key)
        except DamagedFile as damage:  # not what its record vouches for: replaced
            return damage.sha256 or "damaged"
        if blob is None:
            return None
        return await slow_then_close(blob, _hash_blob_file, blob.file, blob.local_path is None)

    def put_file(self, staged: Path, key: str) -> None:
        """Publish staged as the blob at key when applied."""
        self._files.append((staged, key))

    def set_record(self, key: str, value: Any) -> None:
        """Write the document at key when applied."""
        self._records[key] = value

    def planned(self, key: str) -> Any:
        """The value planned for record key."""
        return self._records.get(key)

    def apply(self) -> None:
        """Publish the blobs, then the records; on a failure undo every step before it."""
        try:
            self._runner.run(self._apply())
        except _STORE_ERRORS as exc:
            raise BundleError(f"cannot write to the cache: {_reason(exc)} (nothing was "
                              "imported)") from None

    async def _apply(self) -> None:
        # Each step's undo is noted before the step: a write whose answer was lost may have
        # taken effect.
        undo: list[Callable[[], Awaitable[object]]] = []
        backups: list[Path] = []
        try:
            for staged, key in self._files:
                await self._publish(staged, key, undo, backups)
            for key, value in self._records.items():
                await self._write(key, value, undo)
        except BaseException:
            for step in reversed(undo):
                try:
                    await step()
                except _STORE_ERRORS as exc:  # keep undoing the rest
                    log.warning("could not undo a step of the failed import: %s",
                                _reason(exc))
            raise
        finally:
            for backup in backups:
                backup.unlink(missing_ok=True)

    async def _publish(self, staged: Path, key: str, undo: list[Callable[[], Awaitable[object]]],
                       backups: list[Path]) -> None:
        """Publish one blob, noting how to undo it: the blob it made deleted (only while it
        is still the one this import wrote), or the one it replaced put back."""
        blobs = self._storage.blobs
        backup = await self._backup(key)
        if backup is not None:
            backups.append(backup)

            async def restore() -> None:
                spool = blobs.spool_path()
                await slow(shutil.copyfile, backup, spool)
                await blobs.publish(key, spool)
            undo.append(restore)
            await blobs.publish(key, staged)
            return
        published: list[BlobInfo] = []

        async def remove() -> None:
            # Unknown when publishing failed: whatever it left there, if anything.
            made = published[0] if published else await blobs.stat(key)
            if made is not None:
                await blobs.delete(key, made.identity)
        undo.append(remove)
        published.append(await blobs.publish(key, staged))

    async def _backup(self, key: str) -> Path | None:
        """A local copy of the blob at key (None: there is none, or it is damaged: nothing
        worth putting back), to put back on undo."""
        try:
            blob = await self._storage.blobs.open(key)
        except DamagedFile:
            return None
        if blob is None:
            return None
        backup = self._storage.blobs.spool_path()
        try:
            await slow_then_close(blob, _copy_blob_file, blob.file, blob.local_path is None,
                                  backup)
        except BaseException:
            backup.unlink(missing_ok=True)
            raise
        return backup

    async def _write(self, key: str, value: Any,
                     undo: list[Callable[[], Awaitable[object]]]) -> None:
        """Write one record, noting how to undo it: deleted, or what it held put back."""
        index = self._storage.index
        before = await index.get(key)
        undo.append((lambda: index.delete(key)) if before is None
                    else (lambda: index.set(key, before)))
        await index.set(key, value)


def _hash_blob_file(opener: Callable[[], Any], owned: bool) -> str:
    handle = opener()
    try:
        handle.seek(0)
        return sha256_of_file(handle)
    finally:
        if owned:  # a remote blob's temp file; a local blob's file closes with the blob
            handle.close()


def _copy_blob_file(opener: Callable[[], Any], owned: bool, target: Path) -> None:
    handle = opener()
    try:
        handle.seek(0)
        with open(target, "wb") as out:
            shutil.copyfileobj(handle, out, 1 << 20)
    finally:
        if owned:
            handle.close()


def plan_list(target: ImportTarget, record_key: str, entries: list[Any],
              identity: Callable[[Any], str]) -> None:
    """Add entries to a stored list (version lists), keeping what is there; entries for the
    same version merge their platforms. A new list is dated 0, so that an online proxy
    refreshes it soon; offline, age does not matter."""
    record = target.planned(record_key)
    if record is None:
        record = target.record(record_key)
    current: list[Any] = deepcopy(list(record["value"])) if isinstance(record, dict) else []
    for entry in entries:
        same = next((c for c in current if identity(c) == identity(entry)), None)
        if same is None:
            current.append(entry)
        elif isinstance(same, dict) and isinstance(entry, dict):
            same["platforms"] = list(dict.fromkeys([*same.get("platforms", []),
                                                     *entry.get("platforms", [])]))
    if not isinstance(record, dict) or current != record["value"]:
        target.set_record(record_key, {
            "fetched_at": record.get("fetched_at", 0) if isinstance(record, dict) else 0,
            "value": current})
