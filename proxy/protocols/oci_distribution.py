"""OpenTofu providers through the OCI distribution API, read-only, from the same verified
packages the network mirror serves (https://github.com/opencontainers/distribution-spec,
https://opentofu.org/docs/cli/oci_registries/provider-mirror/).
Operations: tags (tags/list), manifest (manifests/<tag|digest>), blob (blobs/<digest>).

A version's index needs every platform manifest, and a platform manifest the size of its
zip, which the provider registry protocol does not give: the first request for a tag fills
every platform the proxy serves of that version (single-flighted with every other fill).
Every document handed out is recorded by digest in the store's index, so a digest stays
resolvable everywhere; the layers are the stored packages themselves."""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

from proxy.config import UpstreamConfig
from proxy.core.errors import BadRequest, NotFound, Offline
from proxy.core.held import keep_recent
from proxy.core.models import Platform, ProviderAddress, parse_version
from proxy.core.spool import GrowingFile
from proxy.protocols.held_documents import Built, HeldAnswers, current_for
from proxy.protocols.network_mirror import INCOMPLETE_DOCUMENT_SECONDS, ProviderMirror
from proxy.protocols.oci_manifests import (
    INDEX_MEDIA_TYPE,
    MANIFEST_MEDIA_TYPE,
    Document,
    PlatformPackage,
    platform_manifest,
    provider_index,
    tag_of,
    version_of,
)
from proxy.protocols.platform_packages import for_each_platform, served_platforms
from proxy.store import layout
from proxy.store.protocol import BlobInfo, MetadataIndex
from proxy.verification.package_fills import PackageFills
from proxy.verification.packages import VerifiedPackages
from proxy.verification.stored_packages import StoredPackages

log = logging.getLogger(__name__)
_HELD = 4096
_MEDIA_TYPES = frozenset({INDEX_MEDIA_TYPE, MANIFEST_MEDIA_TYPE})
EMPTY_CONFIG_BLOB = b"{}"


class ManifestUnknown(NotFound):
    """No manifest of this repository has that tag or digest (OCI: MANIFEST_UNKNOWN)."""


class BlobUnknown(NotFound):
    """No blob of this repository has that digest (OCI: BLOB_UNKNOWN)."""


class DigestInvalid(BadRequest):
    """Not a digest this registry can name (OCI: DIGEST_INVALID)."""


@dataclass(frozen=True)
class _Layer:
    """Where a layer's bytes come from: a version's package for one platform."""

    version: str
    platform: Platform


def digest_hex(digest: str) -> str:
    """The hex of a `sha256:HEX` digest (DigestInvalid for any other)."""
    algorithm, _, hexdigest = digest.partition(":")
    if algorithm != "sha256" or len(hexdigest) != 64 or \
            hexdigest.strip("0123456789abcdef"):
        raise DigestInvalid(f"not a sha256 digest: {digest[:80]!r}")
    return hexdigest


def is_digest(reference: str) -> bool:
    """Whether a manifest reference is a digest (`algorithm:hex`) rather than a tag (tags
    cannot hold a colon)."""
    return ":" in reference


class OciProviders:
    """Tags, manifests and blobs of provider repositories, built from verified packages."""

    def __init__(self, mirror: ProviderMirror, packages: VerifiedPackages,
                 stored: StoredPackages, fills: PackageFills, index: MetadataIndex,
                 config: UpstreamConfig) -> None:
        self._mirror = mirror
        self._packages = packages
        self._stored = stored
        self._fills = fills
        self._index = index
        self._offline = config.offline
        self._indexes: HeldAnswers[Document] = HeldAnswers(_HELD)
        # Documents by (repository, digest) and layers by (repository, sha256), as recorded:
        # a hit reads nothing from the store.
        self._documents: OrderedDict[tuple[str, str], Document] = OrderedDict()
        self._layers: OrderedDict[tuple[str, str], _Layer] = OrderedDict()

    async def close(self) -> None:
        """Stop index rebuilds under way (shutdown)."""
        await self._indexes.close()

    # --- protocol operations -------------------------------------------------------------

    async def tags(self, provider: ProviderAddress) -> list[str]:
        """`tags/list`: every version as a tag, in lexical order (the order `last`
        paginates by); offline, the versions the store holds."""
        self._packages.require_served(provider)
        entries = await self._stored.held_when_offline(
            provider, await self._packages.version_list(provider))
        return sorted(tag_of(entry.version) for entry in entries)

    async def manifest(self, provider: ProviderAddress, reference: str) -> Document:
        """`manifests/<reference>`: by tag, the version's index; by digest, any document
        handed out for this repository."""
        self._packages.require_served(provider)
        if is_digest(reference):
            return await self._document(provider, digest_hex(reference))
        try:
            version = parse_version(version_of(reference))
        except BadRequest:
            raise ManifestUnknown(f"{provider} has no tag {reference[:80]!r} (tags are "
                                  "versions, with _ for +)") from None
        return await self._indexes.get((str(provider), version),
                                       lambda: self._built_index(provider, version))

    def empty_config(self, provider: ProviderAddress) -> bytes:
        """`blobs/<the empty config's digest>`: every platform manifest's config."""
        self._packages.require_served(provider)
        return EMPTY_CONFIG_BLOB

    async def blob(self, provider: ProviderAddress,
                   digest: str) -> BlobInfo | GrowingFile[BlobInfo]:
        """`blobs/<digest>`: a verified package zip (stored, or the fill under way: the
        same as the network mirror's archive)."""
        self._packages.require_served(provider)
        hexdigest = digest_hex(digest)
        layer = await self._layer(provider, hexdigest)
        if layer is None:
            raise BlobUnknown(f"{provider} has no blob {digest}: ask for its manifest first")
        return await self._mirror.archive(
            provider, provider.archive_filename(layer.version, layer.platform))

    # --- the index of a version ----------------------------------------------------------

    async def _built_index(self, provider: ProviderAddress, version: str) -> Built[Document]:
        """The index of every platform whose package verified (offline: is stored); one
        that lacks a platform is retried after a few seconds, as VERSION.json is."""
        entry = await self._packages.version_entry(provider, version)
        platforms = served_platforms(provider, version, entry.platforms,
                                     self._packages.filters)

        async def one(platform: Platform) -> Document:
            return platform_manifest(await self._package(provider, version, platform))

        manifests, every_platform = await for_each_platform(provider, version, platforms, one)
        index = provider_index(manifests)
        for _platform, document in manifests:
            await self._record_document(provider, document)
        await self._record_document(provider, index)
        settled = every_platform and not self._offline
        return Built(index, keep=True,
                     until=None if settled else current_for(INCOMPLETE_DOCUMENT_SECONDS))

    async def _package(self, provider: ProviderAddress, version: str,
                       platform: Platform) -> PlatformPackage:
        """The sha256 and size of a platform's verified zip: stored, or filled now."""
        package = await self._packages.package(provider, version, platform)
        stored = await self._stored.stored(provider, version, platform)
        if stored is None:
            if self._offline:
                raise Offline(f"{provider} {version} {platform.key} is not in the cache, and "
                              "the proxy is offline")
            filled = await self._fills.archive(provider, version, platform)
            stored = await filled.wait_done() if isinstance(filled, GrowingFile) else filled
        await self._record_layer(provider, package.shasum, _Layer(version, platform))
        return PlatformPackage(platform, package.shasum, stored.size)

    # --- records by digest ---------------------------------------------------------------

    async def _record_document(self, provider: ProviderAddress, document: Document) -> None:
        hexdigest = document.digest.removeprefix("sha256:")
        key = (str(provider), hexdigest)
        if key in self._documents:
            return
        await self._index.create(layout.oci_document_record(provider, hexdigest),
                                 {"media_type": document.media_type,
                                  "body": document.body.decode()})
        keep_recent(self._documents, key, document, _HELD)

    async def _document(self, provider: ProviderAddress, hexdigest: str) -> Document:
        key = (str(provider), hexdigest)
        held = self._documents.get(key)
        if held is not None:
            self._documents.move_to_end(key)
            return held
        record = await self._index.get(layout.oci_document_record(provider, hexdigest))
        document = _document_from_record(record, hexdigest)
        if document is None:
            raise ManifestUnknown(f"{provider} has no manifest sha256:{hexdigest}")
        keep_recent(self._documents, key, document, _HELD)
        return document

    async def _record_layer(self, provider: ProviderAddress, sha256: str,
                            layer: _Layer) -> None:
        key = (str(provider), sha256)
        if self._layers.get(key) == layer:
            return
        await self._index.create(layout.oci_layer_record(provider, sha256),
                                 {"version": layer.version, "os": layer.platform.os,
                                  "arch": layer.platform.arch})
        keep_recent(self._layers, key, layer, _HELD)

    async def _layer(self, provider: ProviderAddress, sha256: str) -> _Layer | None:
        key = (str(provider), sha256)
        held = self._layers.get(key)
        if held is not None:
            return held
        record = await self._index.get(layout.oci_layer_record(provider, sha256))
        try:
            layer = _Layer(parse_version(record["version"]),
                           Platform.parse(record["os"], record["arch"])) if record else None
        except (BadRequest, KeyError, TypeError):
            log.warning("ignoring a malformed OCI layer record for %s %s", provider, sha256)
            return None
        if layer is not None:
            keep_recent(self._layers, key, layer, _HELD)
        return layer


def _document_from_record(record: dict[str, object] | None, hexdigest: str) -> Document | None:
    """The recorded document, only if its bytes still have the digest it is filed under."""
    if record is None:
        return None
    body, media_type = record.get("body"), record.get("media_type")
    if not isinstance(body, str) or media_type not in _MEDIA_TYPES:
        return None
    document = Document(body.encode(), str(media_type))
    return document if document.digest == f"sha256:{hexdigest}" else None
