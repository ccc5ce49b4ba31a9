"""Store operations timed and counted, for backends that make no requests of their own (disk,
memory): tfproxy_store_operations_total{backend,operation,outcome} and
tfproxy_store_operation_seconds{backend,operation}, as the S3 backend records for each of its
requests (proxy.store.s3_objects). A wrapper around the seam: one counter increment and one
observation per call, on the caller's own task (no thread hop is added)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterable, Awaitable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any, TypeVar

from proxy.core.metrics import Metrics
from proxy.store.damage import Dropped
from proxy.store.file_identity import FileIdentity
from proxy.store.protocol import (
    BlobInfo,
    BlobStore,
    DamageListener,
    MetadataIndex,
    OpenBlob,
    Ready,
)

T = TypeVar("T")


class _Meter:
    def __init__(self, backend: str, metrics: Metrics) -> None:
        self._backend = backend
        self._metrics = metrics

    async def timed(self, operation: str, call: Awaitable[T]) -> T:
        """call's result; counted ok, absent (None or False) or error, and timed."""
        started = time.monotonic()
        outcome = "error"
        try:
            result = await call
            outcome = "absent" if result is None or result is False else "ok"
            return result
        finally:
            self._metrics.store_operations.labels(self._backend, operation, outcome).inc()
            self._metrics.store_latency.labels(self._backend, operation).observe(
                time.monotonic() - started)


class MeteredBlobStore:
    """A BlobStore whose publish, put, open, stat, delete, list and last_uses are counted."""

    def __init__(self, inner: BlobStore, backend: str, metrics: Metrics) -> None:
        self.inner = inner
        self._meter = _Meter(backend, metrics)

    # What is not a store operation is the inner store's own.
    disk = property(lambda self: self.inner.disk, doc="The inner store's disk.")
    used_bytes = property(lambda self: self.inner.used_bytes, doc="The inner store's.")
    file_count = property(lambda self: self.inner.file_count, doc="The inner store's.")

    def spool_path(self) -> Path:
        """The inner store's."""
        return self.inner.spool_path()

    def work_dir(self) -> Path:
        """The inner store's."""
        return self.inner.work_dir()

    def fill_notice(self, name: str) -> Path | None:
        """The inner store's."""
        return self.inner.fill_notice(name)

    async def publish(self, key: str, spool: Path) -> BlobInfo:
        """Counted as publish."""
        return await self._meter.timed("publish", self.inner.publish(key, spool))

    async def put(self, key: str, chunks: AsyncIterable[bytes]) -> BlobInfo:
        """Counted as put."""
        return await self._meter.timed("put", self.inner.put(key, chunks))

    async def stat(self, key: str) -> BlobInfo | None:
        """Counted as stat."""
        return await self._meter.timed("stat", self.inner.stat(key))

    async def open(self, key: str, use: bool = True) -> OpenBlob | None:
        """Counted as open."""
        return await self._meter.timed("open", self.inner.open(key, use))

    async def delete(self, key: str, identity: FileIdentity | None = None) -> bool:
        """Counted as delete."""
        return await self._meter.timed("delete", self.inner.delete(key, identity))

    async def drop_damaged(self, key: str, identity: FileIdentity | None,
                           expected: str | None) -> Dropped:
        """Counted as delete."""
        return await self._meter.timed("delete", self.inner.drop_damaged(key, identity,
                                                                         expected))

    async def open_shared(self, key: str) -> OpenBlob | None:
        """Counted as open."""
        return await self._meter.timed("open", self.inner.open_shared(key))

    def watch_damage(self, listener: DamageListener) -> None:
        """The inner store's."""
        self.inner.watch_damage(listener)

    async def list(self, prefix: str) -> list[BlobInfo]:
        """Counted as list."""
        return await self._meter.timed("list", self.inner.list(prefix))

    async def last_uses(self, prefix: str) -> dict[str, float]:
        """Counted as last_uses."""
        return await self._meter.timed("last_uses", self.inner.last_uses(prefix))

    def fill_lock(self, name: str, what: str,
                  ready: Ready | None = None) -> AbstractAsyncContextManager[bool]:
        """The inner store's."""
        return self.inner.fill_lock(name, what, ready)

    def reread_usage(self) -> None:
        """The inner store's."""
        self.inner.reread_usage()

    def health_problem(self) -> str | None:
        """The inner store's."""
        return self.inner.health_problem()

    def store_problem(self) -> str | None:
        """The inner store's."""
        return self.inner.store_problem()

    async def direct_url(self, key: str) -> str | None:
        """The inner store's."""
        return await self.inner.direct_url(key)


class MeteredIndex:
    """A MetadataIndex whose every call is counted (operations index_get, index_set, ...)."""

    def __init__(self, inner: MetadataIndex, backend: str, metrics: Metrics) -> None:
        self.inner = inner
        self._meter = _Meter(backend, metrics)

    async def get(self, key: str) -> dict[str, Any] | None:
        """Counted as index_get."""
        return await self._meter.timed("index_get", self.inner.get(key))

    async def set(self, key: str, value: dict[str, Any]) -> None:
        """Counted as index_set."""
        await self._meter.timed("index_set", _done(self.inner.set(key, value)))

    async def create(self, key: str, value: dict[str, Any]) -> bool:
        """Counted as index_create (absent: the key held a document already)."""
        return await self._meter.timed("index_create", self.inner.create(key, value))

    async def delete(self, key: str) -> None:
        """Counted as index_delete."""
        await self._meter.timed("index_delete", _done(self.inner.delete(key)))

    async def keys(self, prefix: str) -> list[str]:
        """Counted as index_keys."""
        return await self._meter.timed("index_keys", self.inner.keys(prefix))

    async def get_versioned(self, key: str) -> tuple[dict[str, Any], str] | None:
        """Counted as index_get."""
        return await self._meter.timed("index_get", self.inner.get_versioned(key))

    async def replace(self, key: str, value: dict[str, Any],
                      expected_version: str) -> str | None:
        """Counted as index_replace (absent: written since, or gone)."""
        return await self._meter.timed("index_replace",
                                       self.inner.replace(key, value, expected_version))

    async def delete_if(self, key: str, expected_version: str) -> bool:
        """Counted as index_delete."""
        return await self._meter.timed("index_delete",
                                       self.inner.delete_if(key, expected_version))


async def _done(call: Awaitable[None]) -> bool:
    """True once call is done: a call that returns nothing counts as ok, not absent."""
    await call
    return True
