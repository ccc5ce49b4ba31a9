"""Metadata store: a diskcache index of small JSON-able records, used off the event loop."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import diskcache

from proxy.executors import quick


class MetadataCache:
    """Key -> dict records (version lists, verified package facts, signature material)."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        # Records are small; the size limit is for archives, which live outside diskcache.
        self._cache = diskcache.Cache(str(directory), size_limit=2**40, eviction_policy="none")

    async def get(self, key: str) -> dict[str, Any] | None:
        """The record at key, or None."""
        value = await quick(self._cache.get, key)
        return value if isinstance(value, dict) else None

    async def set(self, key: str, value: dict[str, Any]) -> None:
        """Store (replace) the record at key."""
        await quick(self._cache.set, key, value)

    async def delete(self, key: str) -> None:
        """Remove the record at key, if any."""
        await quick(self._cache.delete, key)

    def close(self) -> None:
        """Release the SQLite handles."""
        self._cache.close()
