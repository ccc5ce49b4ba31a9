"""Mutable upstream documents (version lists): reused for a TTL; once expired, answered from
the old copy at once while one refresh runs in the background (stale-while-revalidate), so
clients never wait on a slow or blackholed upstream for something the proxy holds; refreshed
in the foreground only when a client asks for an entry the copy lacks (rate-limited); after a
failure, upstream is left alone for a short backoff."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from proxy.core.errors import ProxyError, UpstreamError
from proxy.core.held import keep_recent
from proxy.core.metrics import Metrics
from proxy.core.singleflight import SingleFlight
from proxy.store.protocol import MetadataIndex

log = logging.getLogger(__name__)
T = TypeVar("T")

# A client asking for an entry we do not list forces a refresh, at most this often.
UNKNOWN_ENTRY_REFRESH_SECONDS = 30.0
# After upstream failed, stale copies are served without asking it again for this long.
FAILURE_BACKOFF_SECONDS = 30.0
# Copies held in memory (hits read no index), the most recently used ones.
HELD_COPIES = 4096
# Offline, nothing expires, but an import into the shared store must still show: a held copy
# is read from the store again after this long (in the background: it is answered meanwhile).
OFFLINE_RECHECK_SECONDS = 5.0


@dataclass(frozen=True)
class _Held(Generic[T]):
    fetched_at: float  # when upstream sent it (the stored record's time)
    copy: T
    read_at: float  # monotonic, when this process last read or wrote the record


class RefreshingDocuments(Generic[T]):
    """One kind of mutable document, stored in the metadata cache as JSON-able values."""

    def __init__(self, kind: str, cache: MetadataIndex, metrics: Metrics, ttl: float,
                 encode: Callable[[T], Any], decode: Callable[[Any], T],
                 offline: bool = False,
                 on_stale: Callable[[str], None] | None = None) -> None:
        self._kind = kind
        self._on_stale = on_stale  # told the origin host of each stale answer
        self._offline = offline
        self._cache = cache
        self._metrics = metrics
        self._ttl = ttl
        self._encode = encode
        self._decode = decode
        self._fills: SingleFlight[T] = SingleFlight()
        self._failed_until: dict[str, float] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._held: OrderedDict[str, _Held[T]] = OrderedDict()
        self._rechecks: SingleFlight[None] = SingleFlight()
        self._on_change: list[Callable[[], None]] = []

    def on_change(self, listener: Callable[[], None]) -> None:
        """Call listener() whenever a copy held here is replaced or dropped (answers derived
        from the old one, and kept elsewhere, must go)."""
        self._on_change.append(listener)

    async def close(self) -> None:
        """Stop refreshes under way."""
        for task in list(self._background):
            task.cancel()
        await self._fills.cancel_all()
        await self._rechecks.cancel_all()

    async def get(self, key: str, fetch: Callable[[], Awaitable[T]],
                  knows: Callable[[T], bool] | None = None, origin: str = "") -> T:
        """The document at key (the same object while its record is unchanged), fetched from
        the upstream host origin. `knows` says whether a copy holds what the caller wants."""
        held = self._held.get(key)
        if held is not None and self._still_good(held, knows):
            self._held.move_to_end(key)
            self._metrics.cache_lookups.labels(self._kind, "hit").inc()
            return held.copy
        if held is not None and self._offline:
            self._rechecks.start(key, lambda: self._recheck(key))
            self._metrics.cache_lookups.labels(self._kind, "hit").inc()
            return held.copy
        record = await self._cache.get(key)
        if record is None:
            self._metrics.cache_lookups.labels(self._kind, "miss").inc()
            return await self._refresh(key, fetch)
        copy = self._hold_record(key, held, record)
        age = time.time() - record["fetched_at"]
        known = knows is None or knows(copy)
        if self._offline or (age < self._ttl and (known or age < UNKNOWN_ENTRY_REFRESH_SECONDS)):
            self._metrics.cache_lookups.labels(self._kind, "hit").inc()
            return copy
        if self._failing(key):
            return self._stale(key, copy, "upstream failed recently", origin)
        if known:
            self._metrics.cache_lookups.labels(self._kind, "revalidate").inc()
            self._refresh_in_background(key, fetch)
            return copy
        try:
            return await self._refresh(key, fetch)
        except UpstreamError as exc:
            return self._stale(key, copy, exc.message, origin)

    async def kept(self, key: str) -> T | None:
        """The copy kept of the document at key, however old, without asking upstream;
        None when there is none."""
        held = self._held.get(key)
        if held is not None:
            return held.copy
        record = await self._cache.get(key)
        return None if record is None else self._hold_record(key, None, record)

    def _still_good(self, held: _Held[T], knows: Callable[[T], bool] | None) -> bool:
        """Whether a held copy answers without reading the store: online while it is fresh
        (and has what is asked for; another process's refresh then shows within the TTL),
        offline for a few seconds."""
        if self._offline:
            return time.monotonic() - held.read_at < OFFLINE_RECHECK_SECONDS
        return time.time() - held.fetched_at < self._ttl and (knows is None or knows(held.copy))

    async def _recheck(self, key: str) -> None:
        """Offline: read a held copy's record again (an import may have replaced it); one
        that is gone is no longer held."""
        try:
            record = await self._cache.get(key)
            held = self._held.get(key)
            if record is None:
                if self._held.pop(key, None) is not None:
                    self._changed()
            else:
                self._hold_record(key, held, record)
        except Exception as exc:  # the held copy is answered meanwhile; tried again later
            log.debug("reading %s again failed: %s", key, exc)

    def _hold_record(self, key: str, held: _Held[T] | None, record: dict[str, Any]) -> T:
        """Keep the copy a record just read from the store holds: the held object itself
        while the record is unchanged (its identity marks it unchanged to what is derived
        from it), else the record decoded."""
        if held is not None and held.fetched_at == record["fetched_at"]:
            return self._hold(key, held.fetched_at, held.copy)
        return self._hold(key, record["fetched_at"], self._decode(record["value"]))

    def _hold(self, key: str, fetched_at: float, copy: T) -> T:
        """Keep a copy just read from (or written to) the store in memory."""
        before = self._held.get(key)
        keep_recent(self._held, key, _Held(fetched_at, copy, time.monotonic()), HELD_COPIES)
        if before is None or before.copy is not copy:
            self._changed()
        return copy

    def _changed(self) -> None:
        for listener in self._on_change:
            listener()

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
        fetched_at = time.time()
        await self._cache.set(key, {"fetched_at": fetched_at, "value": self._encode(value)})
        return self._hold(key, fetched_at, value)

    def _refresh_in_background(self, key: str, fetch: Callable[[], Awaitable[T]]) -> None:
        async def refresh() -> None:
            try:
                await self._refresh(key, fetch)
            except ProxyError as exc:  # e.g. upstream now says 404: keep serving the copy
                log.warning("refreshing %s failed; keeping the old copy: %s", key, exc.message)

        task = asyncio.ensure_future(refresh())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _stale(self, key: str, copy: T, reason: str, origin: str) -> T:
        self._metrics.cache_lookups.labels(self._kind, "stale").inc()
        if self._on_stale is not None:
            self._on_stale(origin)
        log.warning("serving stale %s: %s", key, reason)
        return copy
