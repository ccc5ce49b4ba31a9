"""Protocol answers held in memory, so that a hit reads nothing from the store: the most
recently used ones (bounded). A held answer that may have changed elsewhere (another process
sharing the store, an import, a fill of a platform) is answered at once even past its bound,
and rebuilt in the background, once however many ask (stale-while-revalidate): no hit waits
for the store."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from proxy.core.held import Derived, keep_recent
from proxy.core.json_bodies import JsonBody, json_body
from proxy.core.singleflight import SingleFlight

log = logging.getLogger(__name__)
T = TypeVar("T")
S = TypeVar("S")


@dataclass(frozen=True)
class Built(Generic[T]):
    """An answer just built: whether it may be held, and until when it is taken as current
    (monotonic; None: nothing in it changes any more)."""

    value: T
    keep: bool
    until: float | None


def current_for(seconds: float) -> float:
    """The `until` of an answer current for `seconds` from now."""
    return time.monotonic() + seconds


@dataclass(frozen=True)
class _Held(Generic[T]):
    value: T
    until: float | None


class HeldAnswers(Generic[T]):
    """Answers by key: held ones at once, others built now (and held if they may be)."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._held: OrderedDict[Hashable, _Held[T]] = OrderedDict()
        # Builds under way by key, and the keys forgotten meanwhile: a build that a forget
        # raced is not held (it may have read what was there before the change).
        self._building: dict[Hashable, int] = {}
        self._raced: set[Hashable] = set()
        self._rebuilds: SingleFlight[None] = SingleFlight()

    async def get(self, key: Hashable, build: Callable[[], Awaitable[Built[T]]]) -> T:
        """The held answer (rebuilt in the background once past its bound), else build()'s."""
        held = self._held.get(key)
        if held is None:
            return (await self._build(key, build)).value
        self._held.move_to_end(key)
        if held.until is not None and time.monotonic() >= held.until:
            self._rebuilds.start(key, lambda: self._rebuild(key, held, build))
        return held.value

    def held(self, key: Hashable) -> T | None:
        """key's held answer, if there is one (without counting it as used)."""
        held = self._held.get(key)
        return None if held is None else held.value

    def forget(self, key: Hashable) -> None:
        """What key's answer shows changed here: the next request builds it anew."""
        self._held.pop(key, None)
        if key in self._building:
            self._raced.add(key)

    async def close(self) -> None:
        """Stop rebuilds under way (shutdown)."""
        await self._rebuilds.cancel_all()

    async def _build(self, key: Hashable, build: Callable[[], Awaitable[Built[T]]]) -> Built[T]:
        self._building[key] = self._building.get(key, 0) + 1
        try:
            built = await build()
        finally:
            under_way = self._building.pop(key) - 1
            raced = key in self._raced
            if under_way:
                self._building[key] = under_way
            else:
                self._raced.discard(key)
        if built.keep and not raced:
            keep_recent(self._held, key, _Held(built.value, built.until), self._limit)
        return built

    async def _rebuild(self, key: Hashable, stale: _Held[T],
                       build: Callable[[], Awaitable[Built[T]]]) -> None:
        """Build key's answer again; one that may not be held, or a failure, drops the stale
        one, so the next request builds it in the foreground (and gets the error)."""
        try:
            built = await self._build(key, build)
        except Exception as exc:  # answered to the next request, in the foreground
            log.debug("rebuilding %s failed: %s", key, exc)
            built = None
        if (built is None or not built.keep) and self._held.get(key) is stale:
            del self._held[key]


# Offline, a document follows what the store holds (an import may add to it): it is taken as
# current this long, then rebuilt in the background.
OFFLINE_DOCUMENT_SECONDS = 5.0


class VersionListAnswers(Generic[S]):
    """Documents about a version list, as sent: online, serialized once per version list
    read (the same object until it is read or refreshed again); offline, from what the store
    holds, taken as current for OFFLINE_DOCUMENT_SECONDS."""

    def __init__(self, offline: bool, limit: int) -> None:
        self._offline = offline
        self._derived: Derived[JsonBody] = Derived(limit)
        self._held: HeldAnswers[JsonBody] = HeldAnswers(limit)

    async def get(self, key: str, version_list: Callable[[], Awaitable[S]],
                  build: Callable[[S], Awaitable[dict[str, Any]]],
                  tag: Callable[[S], Awaitable[Hashable]] | None = None) -> JsonBody:
        """The document for key: build(the list) makes it, version_list() reads the list;
        tag(the list), when given, names what else the document depends on (the versions
        the version policy shows now): a new tag builds it again."""
        if self._offline:
            return await self._held.get(key, lambda: self._build_offline(version_list, build))
        source = await version_list()
        now = None if tag is None else await tag(source)
        held = self._derived.get(key, source, now)
        if held is not None:
            return held
        return self._derived.put(key, source, json_body(await build(source)), now)

    async def close(self) -> None:
        """Stop rebuilds under way (shutdown)."""
        await self._held.close()

    @staticmethod
    async def _build_offline(version_list: Callable[[], Awaitable[S]],
                             build: Callable[[S], Awaitable[dict[str, Any]]]
                             ) -> Built[JsonBody]:
        return Built(json_body(await build(await version_list())), keep=True,
                     until=current_for(OFFLINE_DOCUMENT_SECONDS))
