"""Storage a test can freeze: while frozen, every call to the metadata index and every lookup
in the blob store hangs until thawed. A request answered meanwhile touched neither: it was
answered from memory."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack
from typing import Any

from proxy.app import configured_storage
from proxy.config.settings import CacheConfig
from proxy.core.metrics import Metrics
from proxy.store.protocol import Storage
from tests.support.controlled_index import ControlledIndex


class FrozenBlobs:
    """A blob store whose lookups and writes hang while frozen; the rest is the inner
    store's."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.thawed = asyncio.Event()
        self.thawed.set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def stat(self, key: str) -> Any:
        await self.thawed.wait()
        return await self.inner.stat(key)

    async def open(self, key: str, use: bool = True) -> Any:
        await self.thawed.wait()
        return await self.inner.open(key, use)

    async def list(self, prefix: str) -> Any:
        await self.thawed.wait()
        return await self.inner.list(prefix)

    async def publish(self, key: str, spool: Any) -> Any:
        await self.thawed.wait()
        return await self.inner.publish(key, spool)

    async def delete(self, key: str, identity: Any = None) -> bool:
        await self.thawed.wait()
        return bool(await self.inner.delete(key, identity))


class FreezableStorage:
    """The configured storage (create_app's open_storage), index and blobs freezable."""

    def __init__(self) -> None:
        self.index: ControlledIndex | None = None
        self.blobs: FrozenBlobs | None = None

    async def open(self, cache: CacheConfig, metrics: Metrics,
                   opened: AsyncExitStack) -> Storage:
        storage = await configured_storage(cache)(cache, metrics, opened)
        self.index = ControlledIndex(storage.index)
        self.blobs = FrozenBlobs(storage.blobs)
        return Storage(self.blobs, self.index)  # type: ignore[arg-type]

    def freeze(self) -> None:
        """From now on, store calls hang until thaw()."""
        assert self.index is not None and self.blobs is not None, "not opened yet"
        self.index.freeze()
        self.blobs.thawed.clear()

    def thaw(self) -> None:
        """Let hung and later store calls through."""
        assert self.index is not None and self.blobs is not None, "not opened yet"
        self.index.thaw()
        self.blobs.thawed.set()
