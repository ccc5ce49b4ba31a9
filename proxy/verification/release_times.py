"""When each version was released, as far as this proxy can vouch for it (the version
policy's cooldown counts from it: proxy.config.policy).

Providers and CLI releases: the creation time of the verified OpenPGP signature over the
version's SHA256SUMS (a signed fact), but never earlier than the last time this proxy (any
replica) saw upstream's version list without that version: a signature dated in the past
cannot shorten the cooldown of a version the proxy watched appear. Modules carry no
signature: the time this proxy (or the bundle that carried it) first saw the version in
upstream's list, recorded once and kept. A version neither is known for is not dated (it
counts as new).

Sightings are one index record per address (`sightings/KIND/ADDRESS`): when the list was
last fetched, and for each version when it was first seen and the fetch before that."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from proxy.store import layout
from proxy.store.protocol import MetadataIndex

# Sightings records held in memory, and how long before another replica's are read again.
_HELD = 4096
_FRESH_SECONDS = 30.0


class ReleaseTimes:
    """Sightings of versions in upstream's lists, and the release times they bound."""

    def __init__(self, index: MetadataIndex, clock: Callable[[], float] = time.time) -> None:
        self._index = index
        self._clock = clock
        self._held: dict[str, tuple[float, dict[str, Any]]] = {}

    async def listed(self, kind: str, address: str, versions: Iterable[str]) -> None:
        """Upstream's list for address, fetched just now, names versions."""
        key = layout.sightings_record(kind, address)
        record = await self._index.get(key) or {}
        seen = dict(record.get("versions") or {})
        previous, now = record.get("fetched_at"), self._clock()
        for version in versions:
            if version not in seen:  # first seen now; the last look without it: `previous`
                seen[version] = [now, previous if isinstance(previous, int | float) else None]
        updated = {"fetched_at": now, "versions": seen}
        await self._index.set(key, updated)
        self._hold(key, updated)

    async def first_seen(self, kind: str, address: str, version: str) -> float | None:
        """When this proxy (or a bundle) first saw version in upstream's list."""
        found = (await self._versions(kind, address)).get(version)
        return _number(found[0]) if isinstance(found, list) and found else None

    async def not_before(self, kind: str, address: str, version: str) -> float | None:
        """The last time this proxy saw upstream's list without version, if it did."""
        found = (await self._versions(kind, address)).get(version)
        return _number(found[1]) if isinstance(found, list) and len(found) > 1 else None

    async def signed_release(self, kind: str, address: str, version: str,
                             signed_at: float | None) -> float | None:
        """A signed release's time: its signature's, not earlier than the last look at
        upstream's list without it; None when the signature's is not known."""
        if signed_at is None:
            return None
        bound = await self.not_before(kind, address, version)
        return signed_at if bound is None else max(signed_at, bound)

    async def sightings(self, kind: str, address: str) -> dict[str, float]:
        """Every version's first sighting (for export and `policy check`)."""
        return first_sightings({"versions": await self._versions(kind, address)})

    async def _versions(self, kind: str, address: str) -> dict[str, Any]:
        key = layout.sightings_record(kind, address)
        held = self._held.get(key)
        if held is not None and time.monotonic() - held[0] < _FRESH_SECONDS:
            return dict(held[1].get("versions") or {})
        record = await self._index.get(key) or {}
        self._hold(key, record)
        return dict(record.get("versions") or {})

    def _hold(self, key: str, record: dict[str, Any]) -> None:
        if len(self._held) >= _HELD:
            self._held.clear()
        self._held[key] = (time.monotonic(), record)


def with_carried(record: dict[str, Any] | None, dates: dict[str, float]) -> dict[str, Any]:
    """A sightings record with the first sightings a bundle carried (version -> time)
    merged in: for each version the earlier of the two."""
    record = record if isinstance(record, dict) else {}
    seen = dict(record.get("versions") or {})
    for version, when in dates.items():
        mine = seen.get(version)
        first = _number(mine[0]) if isinstance(mine, list) and mine else None
        if first is None or when < first:
            seen[version] = [when, mine[1] if isinstance(mine, list) and len(mine) > 1
                             else None]
    return {**record, "versions": seen}


def first_sightings(record: object) -> dict[str, float]:
    """Every version's first sighting in a sightings record (what export carries)."""
    versions = record.get("versions") if isinstance(record, dict) else None
    if not isinstance(versions, dict):
        return {}
    return {str(version): first for version, found in versions.items()
            if isinstance(found, list) and found and (first := _number(found[0])) is not None}


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) \
        else None
