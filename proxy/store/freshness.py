"""Mutable upstream documents (version lists): reused for a TTL; once expired, answered from
the old copy at once while one refresh runs in the background (stale-while-revalidate), so
clients never wait on a slow or blackholed upstream for something the proxy holds; refreshed
in the foreground only when a client asks for an entry the copy lacks (rate-limited); after a
failure, upstream is left alone for a short backoff."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

from proxy.core.errors import ProxyError, UpstreamError
from proxy.core.metrics import Metrics
from proxy.core.singleflight import SingleFlight
from proxy.store.protocol import MetadataIndex

log = logging.getLogger(__name__)
T = TypeVar("T")

# A client asking for an entry we do not list forces a refresh, at most this often.
UNKNOWN_ENTRY_REFRESH_SECONDS = 30.0
# After upstream failed, stale copies are served without asking it again for this long.
FAILURE_BACKOFF_SECONDS = 30.0


class RefreshingDocuments(Generic[T]):
    """One kind of mutable document, stored in the metadata cache as JSON-able values."""

    def __init__(self, kind: str, cache: MetadataIndex, metrics: Metrics, ttl: float,
                 encode: Callable[[T], Any], decode: Callable[[Any], T],
                 offline: bool = False) -> None:
        self._kind = kind
        self._offline = offline
        self._cache = cache
        self._metrics = metrics
        self._ttl = ttl
        self._encode = encode
        self._decode = decode
        self._fills: SingleFlight[T] = SingleFlight()
        self._failed_until: dict[str, float] = {}
        self._background: set[asyncio.Task[None]] = set()

    async def close(self) -> None:
        """Stop refreshes under way."""
        for task in list(self._background):
            task.cancel()
        await self._fills.cancel_all()

    async def get(self, key: str, fetch: Callable[[], Awaitable[T]],
                  knows: Callable[[T], bool] | None = None) -> T:
        """The document at key. `knows` says whether a copy holds what the caller wants."""
        record = await self._cache.get(key)
        if record is None:
            self._metrics.cache_lookups.labels(self._kind, "miss").inc()
            return await self._refresh(key, fetch)
        copy = self._decode(record["value"])
        age = time.time() - record["fetched_at"]
        known = knows is None or knows(copy)
        if self._offline or (age < self._ttl and (known or age < UNKNOWN_ENTRY_REFRESH_SECONDS)):
            self._metrics.cache_lookups.labels(self._kind, "hit").inc()
            return copy
        if self._failing(key):
            return self._stale(key, copy, "upstream failed recently")
        if known:
            self._metrics.cache_lookups.labels(self._kind, "revalidate").inc()
            self._refresh_in_background(key, fetch)
            return copy
        try:
            return await self._refresh(key, fetch)
        except UpstreamError as exc:
            return self._stale(key, copy, exc.message)

    def _failing(self, key: str) -> bool:
        return self._failed_until.get(key, 0.0) > time.monotonic()

    async def _refresh(self, key: str, fetch: Callable[[], Awaitable[T]]) -> T:
        return await self._fills.run(key, lambda: self._fetch_and_store(key, fetch))

    async def _fetch_and_store(self, key: str, fetch: Callable[[], Awaitable[T]]) -> T:
        try:
            value = await fetch()
        except UpstreamError:
            self._failed_until[key] = time.monotonic() + FAILURE_BACKOFF_SECONDS
            raise
        self._failed_until.pop(key, None)
        await self._cache.set(key, {"fetched_at": time.time(), "value": self._encode(value)})
        return value

    def _refresh_in_background(self, key: str, fetch: Callable[[], Awaitable[T]]) -> None:
        async def refresh() -> None:
            try:
                await self._refresh(key, fetch)
            except ProxyError as exc:  # e.g. upstream now says 404: keep serving the copy
                log.warning("refreshing %s failed; keeping the old copy: %s", key, exc.message)

        task = asyncio.ensure_future(refresh())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _stale(self, key: str, copy: T, reason: str) -> T:
        self._metrics.cache_lookups.labels(self._kind, "stale").inc()
        log.warning("serving stale %s: %s", key, reason)
        return copy
