"""The Terraform and OpenTofu CLI releases, for version managers (tfenv, tenv, asdf) and
setup scripts: a mirror of releases.hashicorp.com's tree for Terraform and of OpenTofu's
release assets, served from verified, cached files.

Operations: listing (versions and their files: the HTML indexes, `index.json`, TofuDL's
`api.json`), release (a version's SHA256SUMS, checked against the release keys, and the
signature files served with it), small_file (one of those), archive (a platform's archive:
fetched once on a miss, streamed to the clients that asked while it is written, checked
against the signed SHA256SUMS, then published). Offline, what the store holds."""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict

from proxy.config import UpstreamConfig
from proxy.core.access import pull_target
from proxy.core.activity import Activity
from proxy.core.audit import NO_AUDIT, Artifact, AuditLog
from proxy.core.errors import (
    IntegrityError,
    NotFound,
    Offline,
    ProxyError,
    UnknownVersion,
    UpstreamError,
)
from proxy.core.executors import quick
from proxy.core.held import keep_recent
from proxy.core.metrics import Metrics
from proxy.core.models import version_sort_key
from proxy.core.redaction import mask_secrets
from proxy.core.releases import Product, parse_release_version, product_named
from proxy.core.singleflight import Offer, SingleFlight
from proxy.core.spool import GrowingFile
from proxy.core.waits import missed_the_cache
from proxy.protocols.version_policy import VersionPolicy
from proxy.store import layout
from proxy.store.damage import DamagedFile, Dropped
from proxy.store.file_identity import FileIdentity, identity_from_record, identity_to_record
from proxy.store.freshness import RefreshingDocuments
from proxy.store.leases import fill_unless_published
from proxy.store.protocol import BlobInfo, BlobStore, MetadataIndex
from proxy.store.spool import SpoolStart, StoredArchive, store_package
from proxy.upstream.releases import Listing, ReleasesClient
from proxy.verification.integrity import reported
from proxy.verification.releases import (
    ReleaseKeys,
    VerifiedRelease,
    extra_names,
    signature_candidates,
    verify_release,
)
from proxy.verification.signatures import signature_time
from proxy.verification.stored_drops import drop_damaged, integrity_kind, what_went
from proxy.verification.stored_hashes import CheckedFiles, Vouch

log = logging.getLogger(__name__)
_HELD = 1024
Source = BlobInfo | GrowingFile[BlobInfo]


class CliReleases:
    """Lists, verifies, fetches and stores CLI releases for every product configured."""

    def __init__(self, client: ReleasesClient, archives: BlobStore, index: MetadataIndex,
                 keys: dict[str, ReleaseKeys], config: UpstreamConfig, metrics: Metrics,
                 activity: Activity, policy: VersionPolicy,
                 audit: AuditLog = NO_AUDIT) -> None:
        self._client = client
        self._policy = policy
        self._archives = archives
        self._index = index
        self._keys = keys
        self._offline = config.offline
        self._metrics = metrics
        self._activity = activity
        self._audit = audit
        self._lists = RefreshingDocuments[Listing](
            "release_versions", index, metrics, config.versions_ttl, encode=dict,
            decode=lambda record: {str(k): list(v) for k, v in dict(record).items()},
            offline=config.offline, on_stale=activity.stale_answer)
        self._releases: SingleFlight[VerifiedRelease] = SingleFlight()
        self._signatures: SingleFlight[bytes | None] = SingleFlight()
        self._held: OrderedDict[tuple[str, str], VerifiedRelease] = OrderedDict()
        self._fills: SingleFlight[Source] = SingleFlight()
        self._checked = CheckedFiles(archives)
        self._fill_slots = asyncio.Semaphore(config.max_concurrent_fills)

    async def close(self) -> None:
        """Stop fills and checks under way (shutdown)."""
        await self._fills.cancel_all()
        await self._releases.cancel_all()
        await self._signatures.cancel_all()
        await self._checked.close()
        await self._lists.close()

    def keys(self, product: Product) -> ReleaseKeys:
        """The keys a product's SHA256SUMS must be signed by (served to clients that verify
        the signature themselves)."""
        self._client.require_served(product)
        return self._keys[product.name]

    # --- listing -------------------------------------------------------------------------

    async def listing(self, product: Product) -> Listing:
        """Versions (newest first) and their files: upstream's list merged with the releases
        the store holds (their verified signature files only, their archives as stored);
        offline, or with upstream failing and no copy of its list, the held ones alone."""
        self._client.require_served(product)
        held = await self._held_listing(product)
        listed: Listing = {}
        if not self._offline:
            try:
                listed = await self._lists.get(
                    layout.release_list_record(product.name),
                    lambda: self._fetch_listing(product),
                    origin=self._client.origin(product))
            except UpstreamError as exc:  # no copy to answer stale: what is held
                log.warning("%s release list: %s; listing the releases held", product.name,
                            exc.message)
                self._activity.stale_answer(self._client.origin(product))
            except NotFound:  # no list configured (OpenTofu's api.json URL empty)
                pass
        merged = dict(listed)
        for version, files in held.items():
            upstream = [name for name in listed.get(version, [])
                        if product.kind_of(version, name) != "signature" or name in files]
            merged[version] = upstream + [name for name in files if name not in upstream]
        target = pull_target("cli", "", "", product.name)
        shown = set(await self._policy.visible("cli", product.name, target, list(merged)))
        return {version: merged[version]
                for version in sorted(merged, key=version_sort_key, reverse=True)
                if version in shown}

    async def _fetch_listing(self, product: Product) -> Listing:
        """Upstream's list, its versions noted as seen now (the version policy's dates)."""
        listed = await self._client.listing(product)
        await self._policy.times.listed("cli", product.name, list(listed))
        return listed

    async def signed_at(self, product_name: str, version: str) -> float | None:
        """When the newest verified signature over the version's SHA256SUMS was made."""
        release = await self.release(product_named(product_name), version)
        times = [t for t in (signature_time(s) for s in release.signatures.values()) if t]
        return max(times, default=None)

    async def _held_listing(self, product: Product) -> Listing:
        """The releases the store holds: the archives stored, the SHA256SUMS and the files
        served with it."""
        stored: dict[str, list[str]] = {}
        for info in await self._archives.list(layout.release_prefix(product.name)):
            named = layout.parse_release_file(info.key)
            if named is not None:
                stored.setdefault(named[1], []).append(named[2])
        held: Listing = {}
        prefix = layout.release_record(product.name, "")
        for key in await self._index.keys(prefix):
            try:
                version = parse_release_version(key.removeprefix(prefix))
                release = await self.release(product, version)
            except (ProxyError, ValueError):  # not such a release any more: not listed
                continue
            archives = [name for name in sorted(stored.get(version, []))
                        if name in release.checksums]
            held[version] = [*archives, *release.small_files(product)]
        return held

    # --- a release's SHA256SUMS ----------------------------------------------------------

    async def release(self, product: Product, version: str) -> VerifiedRelease:
        """The version's SHA256SUMS, verified against the release keys, with the signature
        files served beside it. A stored one is checked again against the keys configured
        now, once per process (the keys may have been replaced since it was stored)."""
        self._client.require_served(product)
        key = (product.name, version)
        held = self._held.get(key)
        if held is not None:
            self._held.move_to_end(key)
            return held
        stored = await self._stored_release(product, version)
        if stored is not None:
            self._metrics.cache_lookups.labels("release_sums", "hit").inc()
            keep_recent(self._held, key, stored, _HELD)
            return stored
        if self._offline:
            raise Offline(f"{product.name} {version} is not in the cache, and the proxy is "
                          "offline")
        self._metrics.cache_lookups.labels("release_sums", "miss").inc()
        release = await self._releases.run(key, lambda: self._verify(product, version))
        keep_recent(self._held, key, release, _HELD)
        return release

    async def _stored_release(self, product: Product, version: str) -> VerifiedRelease | None:
        """The stored record, its signatures checked again against the keys configured now
        (only those that verify are served); None when there is none or none verifies
        (online: fetched again; offline: refused)."""
        record = await self._index.get(layout.release_record(product.name, version))
        if record is None:
            return None
        try:
            stored = VerifiedRelease.from_record(product.name, version, record)
            return await quick(verify_release, product, version, stored.sums,
                               stored.signatures, self._keys[product.name], stored.extras)
        except (ValueError, KeyError, TypeError):
            log.warning("ignoring the malformed record of %s %s", product.name, version)
        except IntegrityError as exc:
            failure = self._integrity(exc, f"{product.name} {version} SHA256SUMS (stored)")
            if self._offline:
                raise failure from None
        return None

    async def _verify(self, product: Product, version: str) -> VerifiedRelease:
        try:
            sums = await self._client.sums(product, version)
        except NotFound:
            raise UnknownVersion(f"{product.name} has no release {version}") from None
        signature_names = signature_candidates(product, version, self._keys[product.name],
                                               await self._listed(product, version))
        extra_files = extra_names(product, version)
        fetched = await asyncio.gather(*(self._client.small_file(product, version, name)
                                         for name in [*signature_names, *extra_files]))
        found = {name: data for name, data in zip([*signature_names, *extra_files], fetched,
                                                  strict=True) if data is not None}
        signatures = {name: found[name] for name in signature_names if name in found}
        extras = {name: found[name] for name in extra_files if name in found}
        try:
            release = await quick(verify_release, product, version, sums, signatures,
                                  self._keys[product.name], extras)
        except IntegrityError as exc:
            raise self._integrity(exc, f"{product.name} {version} SHA256SUMS") from None
        await self._index.set(layout.release_record(product.name, version),
                              release.to_record())
        log.info("%s %s: SHA256SUMS verified (signed by %s)", product.name, version,
                 release.signed_by)
        return release

    async def _listed(self, product: Product, version: str) -> list[str]:
        """The files the kept copy of upstream's list names for the version (none without
        one: the list is not fetched for this; a name a client asks for is fetched then)."""
        listed = await self._lists.kept(layout.release_list_record(product.name))
        return [] if listed is None else list(listed.get(version, []))

    async def small_file(self, product: Product, version: str, filename: str) -> bytes:
        """The SHA256SUMS, or a signature or certificate file served with it. A signature
        the stored release lacks (a name a client asks for that upstream did not list) is
        fetched once and served if it verifies with the release keys."""
        kind = product.kind_of(version, filename)
        if kind == "archive":
            raise NotFound(f"{filename} is an archive, not a checksum or signature file")
        release = await self.release(product, version)
        found = release.small_files(product).get(filename)
        if found is not None:
            return found
        if kind == "signature":
            if not self._offline:
                fetched = await self._signatures.run(
                    (product.name, version, filename),
                    lambda: self._fetch_signature(product, version, filename))
                if fetched is not None:
                    return fetched
            raise NotFound(f"{product.name} {version} has no {filename} that verifies with "
                           "the release keys")
        raise NotFound(f"{product.name} {version} publishes no {filename}")

    async def _fetch_signature(self, product: Product, version: str,
                               filename: str) -> bytes | None:
        """One more signature file of a verified release, from upstream: kept with the
        release and returned if it verifies with the release keys, else None."""
        signature = await self._client.small_file(product, version, filename)
        if signature is None:
            return None
        release = await self.release(product, version)
        try:
            await quick(verify_release, product, version, release.sums, {filename: signature},
                        self._keys[product.name])
        except IntegrityError as exc:
            log.warning("%s %s: %s does not verify with the release keys (%s); not served",
                        product.name, version, filename, exc.message)
            return None
        release = release.with_signature(filename, signature)
        await self._index.set(layout.release_record(product.name, version),
                              release.to_record())
        keep_recent(self._held, (product.name, version), release, _HELD)
        return signature

    # --- archives ------------------------------------------------------------------------

    async def archive(self, product: Product, version: str, filename: str) -> Source:
        """A platform's archive: stored, or the download under way (shared), published only
        once its sha256 matches the signed SHA256SUMS."""
        platform = product.platform_of(version, filename)
        if platform is None:
            raise NotFound(f"{filename[:120]!r} is not an archive of {product.name} {version}")
        release = await self.release(product, version)
        expected = release.checksums.get(filename)
        if expected is None:
            raise NotFound(f"{product.name} {version} has no {platform} build ({filename} is "
                           "not in its signed SHA256SUMS)")
        stored = await self._stored(product, version, filename, expected)
        if stored is not None:
            self._metrics.cache_lookups.labels("release", "hit").inc()
            return stored
        if self._offline:
            raise Offline(f"{product.name} {version} {platform} is not in the cache, and the "
                          "proxy is offline")
        self._metrics.cache_lookups.labels("release", "miss").inc()
        missed_the_cache()
        return await self._fills.run_streaming(
            layout.release_fill(product.name, version, filename),
            lambda offer: self._fill(product, version, filename, expected, offer),
            stale=_published)

    async def _stored(self, product: Product, version: str, filename: str, expected: str,
                      check: bool = True) -> BlobInfo | None:
        key = layout.release_file(product.name, version, filename)
        record_key = layout.release_file_record(product.name, version, filename)

        async def recorded(_found: BlobInfo) -> Vouch | None:
            record = await self._index.get(record_key)
            if record is None or record.get("sha256") != expected:
                return None  # not vouched for: fetched again
            return Vouch(expected, identity_from_record(record.get("stored_as")))

        async def checked(sha256: str, identity: FileIdentity) -> None:
            await self._record(record_key, sha256, identity)

        async def damaged(damage: DamagedFile) -> None:
            await self._drop(product, version, filename, damage)

        return await self._checked.vouched(key, record=recorded, checked=checked,
                                           damaged=damaged, check=check)

    async def _record(self, record_key: str, sha256: str, identity: FileIdentity) -> None:
        await self._index.set(record_key, {"sha256": sha256, "size": identity.size,
                                           "stored_as": identity_to_record(identity)})

    async def _drop(self, product: Product, version: str, filename: str,
                    damage: DamagedFile) -> None:
        """Delete a damaged stored archive and its record, under its fill lock (it is
        fetched again); counted by whoever deletes it."""
        key = layout.release_file(product.name, version, filename)
        async with self._archives.fill_lock(
                layout.release_fill(product.name, version, filename), "release"):
            self._checked.forget(key)
            dropped = await drop_damaged(self._archives, key, damage, lambda: self._index.delete(
                layout.release_file_record(product.name, version, filename)))
            if dropped is not Dropped.NOTHING:
                artifact = f"{product.name} {version} {filename}"
                reported(self._metrics, self._activity, integrity_kind(dropped, damage),
                         f"{artifact}: {dropped.where()} {damage.message}; "
                         f"{what_went(dropped)}", artifact)

    async def _fill(self, product: Product, version: str, filename: str, expected: str,
                    offer: Offer[Source]) -> Source:
        return await fill_unless_published(
            self._archives, layout.release_fill(product.name, version, filename), "release",
            lambda: self._stored(product, version, filename, expected, check=False),
            lambda: self._download(product, version, filename, expected, offer))

    async def _download(self, product: Product, version: str, filename: str, expected: str,
                        offer: Offer[Source]) -> Source:
        key = layout.release_file(product.name, version, filename)
        record_key = layout.release_file_record(product.name, version, filename)
        artifact = Artifact.release(product.name, version, product.platform_of(version,
                                                                               filename))

        async def vouch(stored: StoredArchive) -> None:
            await self._record(record_key, stored.sha256, stored.info.identity)
            self._checked.remember(stored.info.key, stored.info.identity)

        async with self._fill_slots:
            self._metrics.fills_in_flight.inc()
            try:
                url = self._client.file_url(product, version, filename)
                log.info("fetching %s from %s", filename, mask_secrets(url))
                async with SpoolStart(self._archives) as start, \
                        self._client.open(product, version, filename) as download:
                    spool = await start.spool(download.size)
                    offer(spool)
                    try:
                        stored = await store_package(
                            self._archives, key, download.chunks, expected, spool, vouch,
                            is_zip=filename.endswith(".zip"))
                    except IntegrityError as exc:
                        raise self._integrity(exc, f"{product.name} {version} {filename}") \
                            from None
            finally:
                self._metrics.fills_in_flight.dec()
        self._audit.record("fetched", artifact, cache="miss", bytes=stored.info.size,
                           sha256=expected, upstream_url=mask_secrets(url))
        return stored.info

    def _integrity(self, exc: IntegrityError, artifact: str) -> IntegrityError:
        """Count, log and list (the status page) an integrity failure of artifact."""
        return reported(self._metrics, self._activity, exc.kind, f"{artifact}: {exc.message}",
                        artifact, exc)


def _published(source: Source) -> bool:
    """Whether the fill that handed out source already published its file."""
    return not isinstance(source, GrowingFile) or source.final is not None
