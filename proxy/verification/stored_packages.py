"""Verified provider packages as the store holds them: which versions and platforms are held,
whether a stored zip is still the file whose bytes were checked, its h1, and dropping a zip
found damaged. Shared by the network mirror, the registry protocol and the archive fills."""

from __future__ import annotations

import asyncio
import logging
from contextlib import AbstractAsyncContextManager
from dataclasses import replace

from proxy.config import UpstreamConfig
from proxy.core.errors import IntegrityError, Offline
from proxy.core.models import Platform, ProviderAddress
from proxy.store import layout
from proxy.store.damage import DamagedFile, Dropped
from proxy.store.file_identity import FileIdentity
from proxy.store.protocol import BlobInfo, BlobStore
from proxy.store.spool import StoredArchive
from proxy.upstream.documents import VersionEntry
from proxy.verification.packages import VerifiedPackage, VerifiedPackages
from proxy.verification.stored_drops import drop_damaged, integrity_kind, what_went
from proxy.verification.stored_hashes import (
    CheckedFiles,
    Vouch,
    h1_of_stored,
    h1_of_written,
)

log = logging.getLogger(__name__)


def fill_key(provider: ProviderAddress, version: str, platform: Platform) -> str:
    """The identity of one package (origin host, namespace, type, version, os, arch): the
    key of its fill, in this process and across the processes sharing the store."""
    return layout.provider_fill(provider, version, platform)


class StoredPackages:
    """The stored zips of verified packages, and what is recorded about each file."""

    def __init__(self, packages: VerifiedPackages, archives: BlobStore,
                 config: UpstreamConfig) -> None:
        self._packages = packages
        self._archives = archives
        self._offline = config.offline
        self._checked = CheckedFiles(archives)
        # The h1 passes of fills under way, by key: whoever asks for the h1 meanwhile (a
        # document) waits for that pass instead of reading the zip again beside it. Only a
        # fill's: it holds the fill lock, which a pass that finds damage must take.
        self._fill_passes: dict[str, asyncio.Future[VerifiedPackage | None]] = {}

    async def close(self) -> None:
        """Stop checks under way (shutdown)."""
        await self._checked.close()

    def fill_lock(self, provider: ProviderAddress, version: str,
                  platform: Platform) -> AbstractAsyncContextManager[bool]:
        """One fill (or drop) of the package at a time, across the processes sharing the
        store."""
        return self._archives.fill_lock(fill_key(provider, version, platform), "package")

    # --- what is held (offline answers) ------------------------------------------------

    async def held_when_offline(self, provider: ProviderAddress,
                                entries: list[VersionEntry]) -> list[VersionEntry]:
        """Offline, only the versions with a stored package (a constraint then resolves to a
        version we have; Offline if there is none); online, all of them."""
        if not self._offline:
            return entries
        held = layout.versions_held(
            provider, await self._archives.list(layout.provider_prefix(provider)))
        entries = [e for e in entries if e.version in held]
        if not entries:
            raise Offline(f"no version of {provider} is in the cache, and the proxy is offline")
        return entries

    async def platforms_held_when_offline(self, provider: ProviderAddress, version: str,
                                          platforms: list[Platform]) -> list[Platform]:
        """Offline, only the platforms whose package is stored; online, all of them."""
        if not self._offline:
            return platforms
        return [p for p in platforms if await self._archives.stat(
            layout.provider_archive(provider, version, p)) is not None]

    # --- stored files ------------------------------------------------------------------

    async def stored(self, provider: ProviderAddress, version: str, platform: Platform,
                     check: bool = True) -> BlobInfo | None:
        """The stored zip, only if a verified record vouches for it (a file that is on disk
        without one, e.g. after the index was lost, is fetched and checked again), and only
        while it is the file whose bytes were checked: one that was written to since is read
        again first (check; without it, under the fill lock, it is just not used), and
        dropped if it is not the signed package."""
        key = layout.provider_archive(provider, version, platform)
        return await self._checked.vouched(
            key, check=check,
            record=lambda found: self._record_of(provider, version, platform, found),
            checked=lambda sha256, identity: self._record_identity(
                provider, version, platform, sha256, identity),
            damaged=lambda damage: self._drop_damaged(provider, version, platform, key, damage))

    async def _record_of(self, provider: ProviderAddress, version: str, platform: Platform,
                         found: BlobInfo) -> Vouch | None:
        """What the verified record says about the stored zip; None without a matching one."""
        package = await self._packages.stored_facts(provider, version, platform)
        if package is None or package.size != found.identity.size:
            log.warning("%s is stored without a matching verified record; fetching it again",
                        found.key)
            return None
        return Vouch(package.shasum, package.stored_as)

    async def _record_identity(self, provider: ProviderAddress, version: str,
                               platform: Platform, sha256: str, identity: FileIdentity) -> None:
        """Note which file now holds the checked bytes, so that other processes (and the
        next start) need not read it again."""
        current = await self._packages.stored_facts(provider, version, platform)
        if current is not None and (current.shasum, current.size) == (sha256, identity.size):
            await self._packages.save(provider, version, platform,
                                      replace(current, stored_as=identity))

    async def vouch(self, provider: ProviderAddress, version: str, platform: Platform,
                    package: VerifiedPackage, stored: StoredArchive) -> None:
        """Record the size and identity of a zip just published (before its followers get
        its last byte)."""
        self._checked.remember(stored.info.key, stored.info.identity)
        await self._packages.save(provider, version, platform, replace(
            package, size=stored.info.size, stored_as=stored.info.identity))

    # --- h1 ----------------------------------------------------------------------------

    async def with_h1(self, provider: ProviderAddress, version: str, platform: Platform,
                      package: VerifiedPackage) -> VerifiedPackage:
        """The facts with the h1 filled in from the stored zip if it is missing (lost when a
        crash hit between publishing the file and recording its hash)."""
        if package.h1 is not None:
            return package
        key = layout.provider_archive(provider, version, platform)
        if await self._archives.stat(key) is None:
            return package
        return await self.record_h1(provider, version, platform, package, key)

    async def record_h1(self, provider: ProviderAddress, version: str, platform: Platform,
                        package: VerifiedPackage, key: str,
                        holding_lock: bool = False,
                        written: FileIdentity | None = None) -> VerifiedPackage:
        """Compute the h1 of the stored zip at key from bytes that match the signed checksum
        (a full read), record it and return the facts with it. A stored zip that is not the
        signed package is dropped instead: no h1, no size, fetched again when next asked
        for. holding_lock: the caller holds the package's fill lock (a fill). written: the
        identity of the file as the caller wrote and hashed it (a fill), whose bytes are
        not hashed again while it is still that file (see h1_of_written). Another caller
        waits for a fill's pass under way on the same zip, and reads it only if that failed."""
        if holding_lock:
            return await self._fill_pass(provider, version, platform, package, key, written)
        running = self._fill_passes.get(key)
        if running is not None:
            found = await asyncio.shield(running)
            if found is not None:
                return found
        return await self._record_h1(provider, version, platform, package, key, False, None)

    async def _fill_pass(self, provider: ProviderAddress, version: str, platform: Platform,
                         package: VerifiedPackage, key: str,
                         written: FileIdentity | None) -> VerifiedPackage:
        """A fill's h1 pass, which others wait for (None for them if it fails)."""
        answer: asyncio.Future[VerifiedPackage | None] = \
            asyncio.get_running_loop().create_future()
        self._fill_passes[key] = answer
        try:
            found = await self._record_h1(provider, version, platform, package, key, True,
                                          written)
            answer.set_result(found)
            return found
        finally:
            if not answer.done():
                answer.set_result(None)
            if self._fill_passes.get(key) is answer:
                del self._fill_passes[key]

    async def _record_h1(self, provider: ProviderAddress, version: str, platform: Platform,
                         package: VerifiedPackage, key: str, holding_lock: bool,
                         written: FileIdentity | None) -> VerifiedPackage:
        try:
            if written is not None:
                h1 = await h1_of_written(self._archives, key, package.shasum, written)
            else:
                h1 = await h1_of_stored(self._archives, key, package.shasum)
        except DamagedFile as damage:  # changed on disk since it was checked
            await self._drop_damaged(provider, version, platform, key, damage, holding_lock)
            return replace(package, size=None)
        if h1 is None:
            return package
        # Re-read: a fill may have recorded the size meanwhile (the same bytes: same h1).
        current = await self._packages.stored_facts(provider, version, platform)
        if current is not None and current.shasum == package.shasum:
            package = current
        package = replace(package, h1=h1)
        await self._packages.save(provider, version, platform, package)
        return package

    # --- damage ------------------------------------------------------------------------

    async def _drop_damaged(self, provider: ProviderAddress, version: str, platform: Platform,
                            key: str, damage: DamagedFile, holding_lock: bool = False) -> None:
        """Drop a damaged stored zip under the package's fill lock; offline, when that left
        nothing to serve, Offline."""
        if holding_lock:
            dropped = await self._drop_locked(provider, version, platform, key, damage)
        else:
            async with self.fill_lock(provider, version, platform):
                dropped = await self._drop_locked(provider, version, platform, key, damage)
        if self._offline and dropped is not Dropped.LOCAL_COPY:
            raise IntegrityError("stored", f"the stored package {provider} {version} "
                                 f"{platform.key} was damaged and dropped; the proxy is "
                                 "offline, so it cannot be fetched again")

    async def _drop_locked(self, provider: ProviderAddress, version: str, platform: Platform,
                           key: str, damage: DamagedFile) -> Dropped:
        """Delete a damaged stored zip and the facts recorded about the file (size, h1; the
        signed facts stay), then count and log it: once, by whoever deletes it."""
        self._checked.forget(key)
        what = f"{provider} {version} {platform.key}"
        dropped = await drop_damaged(self._archives, key, damage,
                                     lambda: self._forget_file(provider, version, platform))
        if dropped is Dropped.NOTHING:
            # Gone, or replaced since it was read (by whoever dropped it first, then a fill):
            # counted by whoever dropped it; the facts are not about this file.
            log.info("%s: the stored file %s; already dropped or replaced", what,
                     damage.message)
            return dropped
        self._packages.integrity(
            integrity_kind(dropped, damage),
            f"{what}: {dropped.where()} {damage.message}; {what_went(dropped)}", what)
        return dropped

    async def _forget_file(self, provider: ProviderAddress, version: str,
                           platform: Platform) -> None:
        """Clear the facts recorded about the stored file (through the facts this process
        holds, so that it shows none of them either)."""
        record = await self._packages.stored_facts(provider, version, platform)
        if record is not None:  # the stored_drops.FILE_FACTS
            await self._packages.save(provider, version, platform,
                                      replace(record, h1=None, size=None, stored_as=None))
