"""Metadata store: a diskcache index of small JSON-able records, used off the event loop
(the disk backend's MetadataIndex, see proxy.store.protocol)."""

from __future__ import annotations

import sqlite3
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import diskcache

from proxy.core.executors import quick
from proxy.store.disk_space import DiskSpace, is_out_of_space

T = TypeVar("T")

# The version of a record written without one (by an older release, or an import).
_UNVERSIONED = "unversioned"


class MetadataCache:
    """Key -> dict records (version lists, verified package facts, signature material)."""

    def __init__(self, directory: Path, disk: DiskSpace | None = None) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self._disk = disk or DiskSpace(directory)
        # Records are small; the size limit is for archives, which live outside diskcache.
        self._cache = diskcache.Cache(str(directory), size_limit=2**40, eviction_policy="none")

    def open_here(self) -> None:
        """Open this thread's connection to the index now (blocking; diskcache opens one per
        thread on first use): see proxy.core.executors.on_each_quick_thread."""
        self._cache.get("")

    async def get(self, key: str) -> dict[str, Any] | None:
        """The record at key, or None."""
        value = await quick(self._cache.get, key)
        return value if isinstance(value, dict) else None

    async def set(self, key: str, value: dict[str, Any]) -> None:
        """Store (replace) the record at key."""
        await self._write(lambda: self._cache.set(key, value, tag=_new_version()))

    async def create(self, key: str, value: dict[str, Any]) -> bool:
        """Store the record only if key holds none (atomic across processes: leases);
        returns whether this call created it."""
        return bool(await self._write(lambda: self._cache.add(key, value, tag=_new_version())))

    async def delete(self, key: str) -> None:
        """Remove the record at key, if any."""
        await self._write(lambda: self._cache.delete(key))

    # Versions are diskcache tags: a fresh random one with every write, compared and
    # written in one SQLite transaction (atomic across the processes sharing the directory).

    async def get_versioned(self, key: str) -> tuple[dict[str, Any], str] | None:
        """The record at key and its version, or None."""
        return await quick(self._versioned, key)

    async def replace(self, key: str, value: dict[str, Any],
                      expected_version: str) -> str | None:
        """Store value at key only if the record there still has expected_version; returns
        the new version, or None."""
        def write() -> str | None:
            with self._cache.transact():
                current = self._versioned(key)
                if current is None or current[1] != expected_version:
                    return None
                version = _new_version()
                self._cache.set(key, value, tag=version)
                return version

        return await self._write(write)

    async def delete_if(self, key: str, expected_version: str) -> bool:
        """Remove the record at key only if it still has expected_version."""
        def write() -> bool:
            with self._cache.transact():
                current = self._versioned(key)
                if current is None or current[1] != expected_version:
                    return False
                return bool(self._cache.delete(key))

        return await self._write(write)

    def _versioned(self, key: str) -> tuple[dict[str, Any], str] | None:
        value, tag = self._cache.get(key, tag=True)
        if not isinstance(value, dict):
            return None
        return value, tag if isinstance(tag, str) else _UNVERSIONED

    async def keys(self, prefix: str) -> list[str]:
        """Every key that starts with prefix, in order."""
        return await quick(lambda: sorted(
            key for key in self._cache.iterkeys()
            if isinstance(key, str) and key.startswith(prefix)))

    async def _write(self, write: Callable[[], T]) -> T:
        try:
            return await quick(write)
        except (OSError, sqlite3.Error) as exc:
            if not is_out_of_space(exc):
                raise
            raise self._disk.ran_out("index") from exc

    def close(self) -> None:
        """Release the SQLite handles."""
        self._cache.close()


def _new_version() -> str:
    return uuid.uuid4().hex
