"""Mutable upstream documents (version lists): reused for a TTL, refreshed early when a client
asks for an entry we do not know (rate-limited), and served stale when upstream fails, with
a short backoff so that an outage does not make every request wait for a timeout."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

from proxy.cache import MetadataCache
from proxy.errors import UpstreamError
from proxy.metrics import Metrics
from proxy.singleflight import SingleFlight

log = logging.getLogger(__name__)
T = TypeVar("T")

# A client asking for an entry we do not list forces a refresh, at most this often.
UNKNOWN_ENTRY_REFRESH_SECONDS = 30.0
# After upstream failed, stale copies are served without asking it again for this long.
FAILURE_BACKOFF_SECONDS = 30.0


class RefreshingDocuments(Generic[T]):
    """One kind of mutable document, stored in the metadata cache as JSON-able values."""

    def __init__(self, kind: str, cache: MetadataCache, metrics: Metrics, ttl: float,
                 encode: Callable[[T], Any], decode: Callable[[Any], T]) -> None:
        self._kind = kind
        self._cache = cache
        self._metrics = metrics
        self._ttl = ttl
        self._encode = encode
        self._decode = decode
        self._fills: SingleFlight[T] = SingleFlight()
        self._failed_until: dict[str, float] = {}

    async def close(self) -> None:
        """Stop refreshes under way."""
        await self._fills.cancel_all()

    async def get(self, key: str, fetch: Callable[[], Awaitable[T]],
                  knows: Callable[[T], bool] | None = None) -> T:
        """The document at key: cached while fresh (and, with `knows`, while it knows what
        the caller wants), else fetched; stale on upstream failure."""
        record = await self._cache.get(key)
        now = time.time()
        stale: T | None = None
        if record is not None:
            stale = self._decode(record["value"])
            age = now - record["fetched_at"]
            if age < self._ttl and (knows is None or knows(stale)
                                    or age < UNKNOWN_ENTRY_REFRESH_SECONDS):
                self._metrics.cache_lookups.labels(self._kind, "hit").inc()
                return stale
            if self._failed_until.get(key, 0.0) > time.monotonic():
                return self._serve_stale(key, stale, "upstream failed recently")
        try:
            value = await self._fills.run(key, fetch)
        except UpstreamError as exc:
            if stale is None:
                raise
            self._failed_until[key] = time.monotonic() + FAILURE_BACKOFF_SECONDS
            return self._serve_stale(key, stale, exc.message)
        self._failed_until.pop(key, None)
        self._metrics.cache_lookups.labels(self._kind, "miss").inc()
        await self._cache.set(key, {"fetched_at": now, "value": self._encode(value)})
        return value

    def _serve_stale(self, key: str, stale: T, reason: str) -> T:
        self._metrics.cache_lookups.labels(self._kind, "stale").inc()
        log.warning("serving stale %s: %s", key, reason)
        return stale
