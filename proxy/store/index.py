"""Metadata store: a diskcache index of small JSON-able records, used off the event loop
(the disk backend's MetadataIndex, see proxy.store.protocol)."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import diskcache

from proxy.core.executors import quick
from proxy.store.disk_space import DiskSpace, is_out_of_space

T = TypeVar("T")


class MetadataCache:
    """Key -> dict records (version lists, verified package facts, signature material)."""

    def __init__(self, directory: Path, disk: DiskSpace | None = None) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self._disk = disk or DiskSpace(directory)
        # Records are small; the size limit is for archives, which live outside diskcache.
        self._cache = diskcache.Cache(str(directory), size_limit=2**40, eviction_policy="none")

    async def get(self, key: str) -> dict[str, Any] | None:
        """The record at key, or None."""
        value = await quick(self._cache.get, key)
        return value if isinstance(value, dict) else None

    async def set(self, key: str, value: dict[str, Any]) -> None:
        """Store (replace) the record at key."""
        await self._write(lambda: self._cache.set(key, value))

    async def create(self, key: str, value: dict[str, Any]) -> bool:
        """Store the record only if key holds none (atomic across processes: leases);
        returns whether this call created it."""
        return bool(await self._write(lambda: self._cache.add(key, value)))

    async def delete(self, key: str) -> None:
        """Remove the record at key, if any."""
        await self._write(lambda: self._cache.delete(key))

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
