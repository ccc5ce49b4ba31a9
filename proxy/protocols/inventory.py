"""What the cache holds, for the status page's inventory (`/status/cache`): every provider,
module and CLI release stored, each version with its platforms (or files), size and last
use: the data `cache list` shows (proxy.store.contents), plus the CLI releases, searched and
paged. Listing walks the store (on S3, lists the bucket): a listing is held for a few
seconds, so that a page left open, or many viewers, cannot make it walk again and again."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from proxy.core.errors import NotFound
from proxy.core.models import version_sort_key
from proxy.core.releases import product_named
from proxy.core.singleflight import SingleFlight
from proxy.store import layout
from proxy.store.contents import held_blobs
from proxy.store.protocol import Storage

PAGE_SIZE = 50
HELD_SECONDS = 10.0
MAX_QUERY = 200
KINDS = ("provider", "module", "cli")


@dataclass(frozen=True)
class Held:
    """One version of an artifact the cache holds."""

    kind: str  # provider, module, cli
    address: str  # HOST/NAMESPACE/TYPE, HOST/NAMESPACE/NAME/SYSTEM, or the CLI's name
    version: str
    platforms: tuple[str, ...]  # os_arch of each package (providers, CLI releases)
    size: int
    files: int
    last_used: float  # epoch seconds
    recorded: bool  # a record vouches for every file (else it is fetched again when asked)

    def text(self) -> str:
        """What a search looks in."""
        return f"{self.kind} {self.address} {self.version} {' '.join(self.platforms)}".lower()


class Inventory:
    """The cache's contents, listed at most every HELD_SECONDS."""

    def __init__(self, storage: Storage) -> None:
        self._storage = storage
        self._held: tuple[float, list[Held]] | None = None
        self._listing: SingleFlight[list[Held]] = SingleFlight()

    async def close(self) -> None:
        """Stop a listing under way (shutdown)."""
        await self._listing.cancel_all()

    async def page(self, query: str = "", number: int = 1) -> dict[str, Any]:
        """One page of what the cache holds whose kind, address, version or platform
        contains query (without regard to case), newest versions first per address."""
        wanted = query.strip().lower()[:MAX_QUERY]
        entries = [entry for entry in await self._entries() if wanted in entry.text()]
        pages = max(1, math.ceil(len(entries) / PAGE_SIZE))
        number = min(max(1, number), pages)
        shown = entries[(number - 1) * PAGE_SIZE:number * PAGE_SIZE]
        return {
            "query": query[:MAX_QUERY], "page": number, "pages": pages, "matching": len(entries),
            "totals": _totals(entries),
            "entries": [{"kind": e.kind, "address": e.address, "version": e.version,
                         "platforms": list(e.platforms), "files": e.files, "bytes": e.size,
                         "last_used": _iso(e.last_used), "recorded": e.recorded}
                        for e in shown],
        }

    async def _entries(self) -> list[Held]:
        held = self._held
        if held is not None and time.monotonic() - held[0] < HELD_SECONDS:
            return held[1]
        entries = await self._listing.run("inventory", self._list)
        self._held = (time.monotonic(), entries)
        return entries

    async def _list(self) -> list[Held]:
        groups: dict[tuple[str, str, str], list[tuple[str | None, int, float, bool]]] = {}
        for blob in await held_blobs(self._storage):
            groups.setdefault((blob.kind, blob.address, blob.version), []).append(
                (blob.platform, blob.info.size, blob.last_used, blob.recorded))
        uses = await self._storage.blobs.last_uses(layout.RELEASE_AREA + "/")
        for info in await self._storage.blobs.list(layout.RELEASE_AREA + "/"):
            named = layout.parse_release_file(info.key)
            if named is None:
                continue
            product, version, filename = named
            try:
                platform = product_named(product).platform_of(version, filename)
            except NotFound:
                continue
            groups.setdefault(("cli", product, version), []).append(
                (platform, info.size, max(info.mtime, uses.get(info.key, 0.0)), True))
        entries = [Held(kind, address, version,
                        tuple(sorted({p for p, _s, _u, _r in files if p})),
                        sum(s for _p, s, _u, _r in files), len(files),
                        max(u for _p, _s, u, _r in files), all(r for _p, _s, _u, r in files))
                   for (kind, address, version), files in groups.items()]
        # Newest version first within each address (a stable sort keeps that order).
        entries.sort(key=lambda e: _version_key(e.version), reverse=True)
        return sorted(entries, key=lambda e: (KINDS.index(e.kind), e.address.lower()))


def _totals(entries: list[Held]) -> dict[str, dict[str, int]]:
    totals = {kind: {"versions": 0, "files": 0, "bytes": 0} for kind in KINDS}
    for entry in entries:
        total = totals[entry.kind]
        total["versions"] += 1
        total["files"] += entry.files
        total["bytes"] += entry.size
    return totals


def _version_key(version: str) -> tuple[Any, ...]:
    try:
        return (1, version_sort_key(version))
    except ValueError:  # not semver (stored by something else): after the others
        return (0, version)


def _iso(epoch: float) -> str | None:
    if epoch <= 0:
        return None
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
