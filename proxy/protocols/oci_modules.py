"""Registry modules through the OCI distribution API, read-only, for OpenTofu's `oci://`
module source (https://opentofu.org/docs/language/modules/sources/#oci-distribution-registry;
OpenTofu's internal/getmodules/oci_getter.go for what it checks).
Operations: tags (tags/list), manifest (manifests/<tag|digest>), blob (blobs/<digest>).

A tag is a module version; its image manifest (`artifactType:
application/vnd.opentofu.modulepkg`) has one `archive/zip` layer: the module the proxy
fetched and repacked (the same stored archive its `modules.v1` serves), as a zip made from
that archive once (proxy.modules.zip_layer: the same tree gives the same bytes), stored
beside it and vouched for by its recorded sha256 like the archive itself. A zip made from
an archive that was since fetched again with other contents is made again."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from proxy.config import UpstreamConfig
from proxy.core.audit import SERVED_FACTS, Artifact
from proxy.core.errors import BadRequest
from proxy.core.executors import quick, slow, slow_then_close
from proxy.core.models import ModuleAddress, parse_module_version
from proxy.modules.zip_layer import zip_from_packed
from proxy.protocols.held_documents import Built, HeldAnswers, current_for
from proxy.protocols.module_registry import ModuleRegistry
from proxy.protocols.oci_manifests import Document, module_manifest, tag_of, version_of
from proxy.protocols.oci_records import (
    BlobUnknown,
    ManifestUnknown,
    OciRecords,
    digest_hex,
    is_digest,
)
from proxy.store import layout
from proxy.store.damage import DamagedFile, Dropped
from proxy.store.file_identity import FileIdentity, identity_from_record, identity_to_record
from proxy.store.leases import fill_unless_published
from proxy.store.protocol import BlobInfo, BlobStore, MetadataIndex
from proxy.verification.stored_drops import drop_damaged, what_went
from proxy.verification.stored_hashes import CheckedFiles, Vouch, fingerprint

log = logging.getLogger(__name__)
_HELD = 4096
# How long a manifest by tag is taken as current: its zip is made from an archive that may
# be evicted and fetched again (with other contents, if upstream moved the version).
MANIFEST_SECONDS = 60.0


def module_repository(module: ModuleAddress) -> str:
    """The OCI repository name of a module: `modules/HOST/NAMESPACE/NAME/SYSTEM`."""
    return f"modules/{module}"


@dataclass(frozen=True)
class _Zip:
    """A stored module zip and its sha256."""

    blob: BlobInfo
    sha256: str


class OciModules:
    """Tags, manifests and blobs of module repositories, from the stored module archives."""

    def __init__(self, modules: ModuleRegistry, archives: BlobStore, index: MetadataIndex,
                 records: OciRecords, config: UpstreamConfig) -> None:
        self._modules = modules
        self._archives = archives
        self._index = index
        self._records = records
        self._offline = config.offline
        self._checked = CheckedFiles(archives)
        self._manifests: HeldAnswers[Document] = HeldAnswers(_HELD)

    async def close(self) -> None:
        """Stop manifest rebuilds and checks under way (shutdown)."""
        await self._manifests.close()
        await self._checked.close()

    # --- protocol operations -------------------------------------------------------------

    def require_served(self, module: ModuleAddress) -> None:
        """Raises unless the filters let this module through."""
        self._modules.require_served(module)

    async def tags(self, module: ModuleAddress) -> list[str]:
        """`tags/list`: every version as a tag, in lexical order; offline, the version list
        the store holds (as `versions` answers)."""
        versions = await self._modules.shown(module, await self._modules.versions(module))
        return sorted(tag_of(version) for version in versions)

    async def manifest(self, module: ModuleAddress, reference: str) -> Document:
        """`manifests/<reference>`: by tag, the version's image manifest (the first one
        fetches the module if the proxy does not hold it); by digest, one handed out."""
        self._modules.require_served(module)
        if is_digest(reference):
            return await self._records.document(module_repository(module),
                                                digest_hex(reference))
        try:
            version = parse_module_version(version_of(reference))
        except BadRequest:
            raise ManifestUnknown(f"module {module} has no tag {reference[:80]!r} (tags are "
                                  "versions, with _ for +)") from None
        return await self._manifests.get((str(module), version),
                                         lambda: self._built_manifest(module, version))

    async def blob(self, module: ModuleAddress, digest: str) -> BlobInfo:
        """`blobs/<digest>`: the module's zip."""
        self._modules.require_served(module)
        hexdigest = digest_hex(digest)
        layer = await self._records.layer(module_repository(module), hexdigest)
        version = layer.get("version") if layer else None
        if not isinstance(version, str):
            raise BlobUnknown(f"module {module} has no blob {digest}: ask for its manifest "
                              "first")
        await self._modules.require_policy(module, version)
        made = await self._zip(module, version)
        if made.sha256 != hexdigest:  # made again since, from an archive fetched again
            raise BlobUnknown(f"module {module} {version} no longer has blob {digest}: ask "
                              "for its manifest again")
        facts = SERVED_FACTS.get()
        if facts is not None:  # the audit line names the version and the zip served
            facts.artifact, facts.sha256 = Artifact.module(module, version), made.sha256
        return made.blob

    # --- manifests -----------------------------------------------------------------------

    async def _built_manifest(self, module: ModuleAddress, version: str) -> Built[Document]:
        made = await self._zip(module, version)
        document = module_manifest(made.sha256, made.blob.size)
        repository = module_repository(module)
        await self._records.record_layer(repository, made.sha256, {"version": version})
        await self._records.record_document(repository, document)
        return Built(document, keep=True, until=current_for(MANIFEST_SECONDS))

    # --- the zip of a version ------------------------------------------------------------

    async def _zip(self, module: ModuleAddress, version: str) -> _Zip:
        """The stored zip of the module's archive as it is now: made (once, across processes)
        if there is none, or it is damaged, or was made from other archive bytes."""
        await self._modules.download(module, version)  # unknown version, offline miss: refused
        await self._modules.archive(module, version)  # fetched now on a miss
        archive_sha256 = await self._modules.archive_sha256(module, version)
        found = await self._stored_zip(module, version, archive_sha256)
        if found is not None:
            return found
        return await fill_unless_published(
            self._archives, layout.module_zip_fill(module, version), "module zip",
            lambda: self._stored_zip(module, version, archive_sha256, check=False),
            lambda: self._make(module, version, archive_sha256))

    async def _stored_zip(self, module: ModuleAddress, version: str, archive_sha256: str | None,
                          check: bool = True) -> _Zip | None:
        """The stored zip while its record vouches for it and says it was made from the
        archive bytes now stored (one read again since it was stored is checked first)."""
        key = layout.module_zip(module, version)
        record = await self._index.get(layout.module_zip_record(module, version)) or {}
        sha256 = record.get("sha256")
        if archive_sha256 is None or record.get("made_from") != archive_sha256 or \
                not isinstance(sha256, str):
            return None  # none, or made from other bytes: made again
        vouch = Vouch(sha256, identity_from_record(record.get("stored_as")))

        async def recorded(_found: BlobInfo) -> Vouch:
            return vouch

        async def checked(sha256: str, identity: FileIdentity) -> None:
            await self._record(module, version, sha256, identity, archive_sha256)

        async def damaged(damage: DamagedFile) -> None:
            await self._drop(module, version, key, damage)

        stored = await self._checked.vouched(key, record=recorded, checked=checked,
                                             damaged=damaged, check=check)
        return None if stored is None else _Zip(stored, sha256)

    async def _make(self, module: ModuleAddress, version: str,
                    archive_sha256: str | None) -> _Zip:
        """Make the zip from the stored archive and publish it, recorded first."""
        opened = await self._archives.open(layout.module_archive(module, version))
        if opened is None:
            raise BlobUnknown(f"module {module} {version} went from the cache meanwhile; "
                              "ask again")
        spool = self._archives.spool_path()
        try:
            try:
                await slow_then_close(opened, zip_from_packed, opened.file(), spool)
            except ValueError as exc:
                raise BlobUnknown(f"module {module} {version}: its stored archive cannot be "
                                  f"made a zip ({exc})") from None
            sha256, identity = await slow(fingerprint, spool)
            await self._record(module, version, sha256, identity, archive_sha256)
            published = await self._archives.publish(layout.module_zip(module, version), spool)
            if published.identity != identity:
                await self._record(module, version, sha256, published.identity, archive_sha256)
            self._checked.remember(published.key, published.identity)
            log.info("module %s %s: made its OCI zip (%d bytes)", module, version,
                     published.size)
            return _Zip(published, sha256)
        except BaseException:
            await quick(spool.unlink, True)
            raise

    async def _record(self, module: ModuleAddress, version: str, sha256: str,
                      identity: FileIdentity, archive_sha256: str | None) -> None:
        await self._index.set(layout.module_zip_record(module, version), {
            "sha256": sha256, "size": identity.size, "stored_as": identity_to_record(identity),
            "made_from": archive_sha256})

    async def _drop(self, module: ModuleAddress, version: str, key: str,
                    damage: DamagedFile) -> None:
        """Delete a damaged zip and its record (made again from the archive)."""
        async with self._archives.fill_lock(layout.module_zip_fill(module, version),
                                            "module zip"):
            self._checked.forget(key)
            dropped = await drop_damaged(self._archives, key, damage, lambda: self._index.delete(
                layout.module_zip_record(module, version)))
            if dropped is not Dropped.NOTHING:
                where = "the local hot copy of its OCI zip" if dropped is Dropped.LOCAL_COPY \
                    else "its stored OCI zip"
                log.warning("module %s %s: %s %s; %s", module, version, where, damage.message,
                            what_went(dropped))
