"""What the store holds, as the cache commands show it: every stored provider package and
module archive with its size, write time, last use and whether a record vouches for it,
optionally only those whose address matches a pattern (AddressPattern)."""

from __future__ import annotations

import fnmatch
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

from proxy.store import layout
from proxy.store.protocol import BlobInfo, Storage

# Where an address without a hostname lives, as in Terraform's own source addresses.
DEFAULT_HOST = "registry.terraform.io"
# What a pattern segment may hold: address characters and the glob characters * ? [ ].
_SEGMENT = re.compile(r"[A-Za-z0-9._:*?\[\]-]+")
_MAX_SEGMENTS = 4  # host/namespace/name/system

Kind = Literal["provider", "module"]


class BadPattern(ValueError):
    """A FILTER that names no address (the message says why)."""


@dataclass(frozen=True)
class AddressPattern:
    """Which addresses a FILTER selects: glob segments (`*`, `?`, `[...]`) matched, without
    regard to case, against the first segments of `HOST/NAMESPACE/TYPE` (providers) or
    `HOST/NAMESPACE/NAME/SYSTEM` (modules). A pattern whose first segment is no hostname (no
    dot, no port, not localhost) is under registry.terraform.io; `*` alone selects all."""

    segments: tuple[str, ...]

    @classmethod
    def parse(cls, text: str) -> AddressPattern:
        """The pattern text names; BadPattern if it names none."""
        given = text.strip().strip("/")
        if given in ("*", "**"):
            return cls(())
        parts = given.split("/")
        if not given or any(not _SEGMENT.fullmatch(part) for part in parts):
            raise BadPattern(f"filter {text!r} is not an address pattern: segments of "
                             "letters, digits, . _ - : and the globs * ? [ ] between slashes, "
                             "e.g. registry.terraform.io/hashicorp/* or hashicorp/aws")
        if not _is_host(parts[0]):
            parts.insert(0, DEFAULT_HOST)
        if len(parts) > _MAX_SEGMENTS:
            raise BadPattern(f"filter {text!r} has more segments than an address "
                             "(HOST/NAMESPACE/NAME/SYSTEM at most)")
        return cls(tuple(part.lower() for part in parts))

    def matches(self, address: str) -> bool:
        """Whether the address (or the part of it the pattern spells) matches."""
        named = address.lower().split("/")
        return len(named) >= len(self.segments) and all(
            fnmatch.fnmatchcase(part, wanted)
            for part, wanted in zip(named, self.segments, strict=False))


def _is_host(segment: str) -> bool:
    return "." in segment or ":" in segment or segment.lower() == "localhost"


@dataclass(frozen=True)
class HeldBlob:
    """One stored package or module archive."""

    kind: Kind
    address: str  # HOST/NAMESPACE/TYPE, or HOST/NAMESPACE/NAME/SYSTEM
    version: str
    platform: str | None  # os_arch, for a provider package
    info: BlobInfo
    last_used: float  # the latest of its write and its last recorded use (epoch seconds)
    record: str  # the index key of the record that vouches for it
    recorded: bool  # whether that record exists (else it is not served as it is)

    @property
    def key(self) -> str:
        """Its store key."""
        return self.info.key

    @property
    def host(self) -> str:
        """The registry host it came from."""
        return self.address.partition("/")[0]


def describe(info: BlobInfo, used: float, records: set[str]) -> HeldBlob | None:
    """The package or module archive a listed blob is; None for a key the layout names as
    neither (left alone by every command)."""
    record = layout.record_of_blob(info.key)
    if record is None:
        return None
    last_used = max(info.mtime, used)
    package = layout.parse_provider_archive(info.key)
    if package is not None:
        provider, version, platform = package
        return HeldBlob("provider", str(provider), version, platform.key, info, last_used,
                        record, record in records)
    module = layout.parse_module_archive(info.key)
    assert module is not None  # record_of_blob named one of the two
    return HeldBlob("module", str(module[0]), module[1], None, info, last_used, record,
                    record in records)


async def held_blobs(storage: Storage, pattern: AddressPattern | None = None) -> list[HeldBlob]:
    """Every stored package and module archive (those pattern selects), in key order."""
    records = set(await storage.index.keys(layout.PACKAGE_RECORDS))
    records.update(await storage.index.keys(layout.MODULE_ARCHIVE_RECORDS))
    uses = await storage.blobs.last_uses("")
    held = []
    for area in layout.AREAS:
        for info in await storage.blobs.list(f"{area}/"):
            found = describe(info, uses.get(info.key, 0.0), records)
            if found is not None and (pattern is None or pattern.matches(found.address)):
                held.append(found)
    return held


@dataclass
class Tally:
    """Counts and bytes of one group of held blobs, and its oldest and newest use."""

    blobs: int = 0
    bytes: int = 0
    oldest_use: float | None = None
    newest_use: float | None = None

    def add(self, blob: HeldBlob) -> None:
        """Count one more."""
        self.blobs += 1
        self.bytes += blob.info.size
        used = blob.last_used
        self.oldest_use = used if self.oldest_use is None else min(self.oldest_use, used)
        self.newest_use = used if self.newest_use is None else max(self.newest_use, used)


@dataclass
class CacheStats:
    """What `cache stats` shows: totals, per kind, per host, and how many addresses."""

    total: Tally = field(default_factory=Tally)
    kinds: dict[str, Tally] = field(default_factory=dict)
    hosts: dict[str, Tally] = field(default_factory=dict)
    addresses: Counter[str] = field(default_factory=Counter)
    unrecorded: int = 0


def stats_of(held: list[HeldBlob]) -> CacheStats:
    """The totals of a listing."""
    stats = CacheStats(kinds={"provider": Tally(), "module": Tally()})
    for blob in held:
        stats.total.add(blob)
        stats.kinds[blob.kind].add(blob)
        stats.hosts.setdefault(blob.host, Tally()).add(blob)
        stats.unrecorded += not blob.recorded
    for kind in ("provider", "module"):
        stats.addresses[kind] = len({b.address for b in held if b.kind == kind})
    return stats
