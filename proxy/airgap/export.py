"""Air-gap export: verified packages and module archives from the store, with their
SHA256SUMS, signatures and signing keys, written into one tar with a manifest of every
member's size and sha256, signed with the operator's key. It reads through the storage
seam: a cache directory and an S3 bucket export alike, every file read again and checked
before it is signed for."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import sqlite3
import tarfile
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import AsyncExitStack, contextmanager
from pathlib import Path
from typing import Any, BinaryIO

from botocore.exceptions import BotoCoreError, ClientError

from proxy.airgap.manifest import FORMAT, MANIFEST, SIGNATURE, BundleError, Counts, file_entry
from proxy.airgap.publish import opened_audit
from proxy.airgap.signing import ManifestSigner
from proxy.airgap.sources import Requirement
from proxy.app import open_for_commands
from proxy.config.settings import Config
from proxy.core.audit import Artifact, AuditLog, key_id, local_user
from proxy.core.constraints import newest_matching
from proxy.core.errors import ProxyError
from proxy.core.executors import slow_then_close
from proxy.core.models import ModuleAddress, Platform, ProviderAddress
from proxy.core.releases import product_named
from proxy.modules.packing import read_packed
from proxy.protocols.module_registry import recorded_sha256
from proxy.store import layout
from proxy.store.damage import DamagedFile
from proxy.store.disk import DiskBlobStore
from proxy.store.protocol import BlobStore, OpenBlob, Storage
from proxy.store.s3_objects import Conflict
from proxy.upstream.documents import without_upstream_urls
from proxy.verification.release_times import first_sightings
from proxy.verification.releases import VerifiedRelease

_CHUNK = 1 << 20
_Package = tuple[ProviderAddress, str, Platform, dict[str, Any], str]


async def _stored_packages(storage: Storage) -> list[_Package]:
    """Every provider package whose verified record matches a stored zip."""
    blobs = {info.key: info for info in await storage.blobs.list(f"{layout.PROVIDER_AREA}/")}
    found = []
    for key in await storage.index.keys(layout.PACKAGE_RECORDS):
        named = layout.parse_package_record(key)
        if named is None:
            continue
        provider, version, platform = named
        record = await storage.index.get(key)
        info = blobs.get(layout.provider_archive(provider, version, platform))
        if isinstance(record, dict) and record.get("size") and record.get("sums_id") \
                and info is not None and info.size == record["size"]:
            found.append((provider, version, platform, record, info.key))
    return found


async def _stored_modules(storage: Storage) -> list[tuple[ModuleAddress, str, str]]:
    found = []
    for info in await storage.blobs.list(layout.module_archive_prefix()):
        named = layout.parse_module_archive(info.key)
        if named is not None:
            found.append((*named, info.key))
    return found


async def _stored_releases(storage: Storage) -> list[tuple[VerifiedRelease, str, str]]:
    """Every stored CLI release archive whose release record (its verified SHA256SUMS)
    lists it: the release, the archive's key and file name."""
    found = []
    for info in await storage.blobs.list(f"{layout.RELEASE_AREA}/"):
        named = layout.parse_release_file(info.key)
        record = None if named is None else await storage.index.get(
            layout.release_record(named[0], named[1]))
        if named is None or record is None:
            continue
        try:
            release = VerifiedRelease.from_record(named[0], named[1], record)
        except (ValueError, KeyError, TypeError):
            continue
        if named[2] in release.checksums:
            found.append((release, info.key, named[2]))
    return found


async def _release_entry(release: VerifiedRelease, key: str, filename: str,
                         add_blob: Callable[..., Awaitable[bool]],
                         add_listed: Callable[[str, bytes], None],
                         files: dict[str, Any]) -> dict[str, Any] | None:
    """The manifest entry of one release archive, its members added (the SHA256SUMS and
    signature files once per release); None when the archive went meanwhile."""
    product = product_named(release.product)
    base = f"releases/{release.product}/{release.version}"
    expected = release.checksums[filename]
    if not await add_blob(f"{base}/{filename}", key, expected,
                          f"{release.product} {release.version} {filename}"):
        return None
    small = release.small_files(product)
    for name, data in small.items():
        if f"{base}/{name}" not in files:
            add_listed(f"{base}/{name}", data)
    return {"product": release.product, "version": release.version, "filename": filename,
            "sha256": expected, "archive": f"{base}/{filename}",
            "sums": f"{base}/{product.sums_name(release.version)}",
            "signatures": {name: f"{base}/{name}" for name in release.signatures},
            "extras": {name: f"{base}/{name}" for name in release.extras}}


def _selected(requirements: list[Requirement] | None, address: object, version: str,
              available: dict[str, set[str]]) -> bool:
    if requirements is None:
        return True
    for requirement in requirements:
        if str(requirement.address) == str(address):
            chosen = newest_matching(available.get(str(address), set()),
                                     requirement.constraint)
            if chosen == version:
                return True
    return False


def export_bundle(config: Config, output: Path,
                  requirements: list[Requirement] | None = None,
                  signer: ManifestSigner | None = None) -> Counts:
    """Write the cache (or what requirements select from it) as a tar bundle, its manifest
    signed by signer (None: unsigned). The cache is the bucket of cache.s3 if set, else the
    cache directory."""
    with opened_audit(config) as audit:
        return asyncio.run(_export(config, output, requirements, signer, audit))


async def _export(config: Config, output: Path, requirements: list[Requirement] | None,
                  signer: ManifestSigner | None, audit: AuditLog) -> Counts:
    async with AsyncExitStack() as opened:
        try:
            storage = await open_for_commands(config, opened)
            return await _export_from(storage, output, requirements, signer, audit)
        except (ProxyError, Conflict, BotoCoreError, ClientError, sqlite3.Error) as exc:
            reason = exc.message if isinstance(exc, ProxyError) else repr(exc)[:300]
            raise BundleError(f"cannot read the cache: {reason}; nothing was exported") \
                from None


def _damaged(what: str, where: str) -> BundleError:
    """Never sign a file damaged or altered since it was stored."""
    return BundleError(
        f"{what}: {where} does not match the sha256 it was stored with (damaged or altered "
        "since); nothing was exported. Delete that file (the proxy fetches it again when next "
        "asked for it) and export again")


def _where(blobs: BlobStore, key: str) -> str:
    """How a message names a stored blob: its path in a cache directory, else its key."""
    return str(blobs.path_of(key)) if isinstance(blobs, DiskBlobStore) else f"{key} (in the bucket)"


async def _export_from(storage: Storage, output: Path, requirements: list[Requirement] | None,
                       signer: ManifestSigner | None, audit: AuditLog) -> Counts:
    index = storage.index
    # Recorded once the bundle is written: (artifact, bytes, sha256, signing key ID).
    lines: list[tuple[Artifact, int, str, str | None]] = []
    packages = await _stored_packages(storage)
    modules = await _stored_modules(storage)
    held: dict[str, set[str]] = {}
    for provider, version, _p, _r, _key in packages:
        held.setdefault(str(provider), set()).add(version)
    for module, version, _key in modules:
        held.setdefault(str(module), set()).add(version)
    manifest: dict[str, Any] = {"format": FORMAT, "created": int(time.time()),
                                "providers": [], "modules": [], "versions": {}, "releases": [],
                                "files": {}}
    temp = output.with_name(output.name + ".part")
    try:
        with _removed_on_failure(temp), tarfile.open(temp, "w") as tar:
            def add_data(member: str, data: bytes) -> None:
                info = tarfile.TarInfo(member)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))

            def add_listed(member: str, data: bytes) -> None:
                manifest["files"][member] = file_entry(len(data),
                                                       hashlib.sha256(data).hexdigest())
                add_data(member, data)

            async def add_blob(member: str, key: str, stored_with: str | None,
                               what: str, module: tuple[ModuleAddress, str] | None = None
                               ) -> bool:
                try:
                    blob = await storage.blobs.open(key)
                except DamagedFile:  # the store's own check, as the blob was fetched
                    raise _damaged(what, _where(storage.blobs, key)) from None
                if blob is None:
                    return False  # evicted since it was listed
                entry = await slow_then_close(blob, _add_checked, tar, member, blob,
                                              stored_with, what, _where(storage.blobs, key),
                                              module)
                manifest["files"][member] = entry
                return True

            for provider, version, platform, record, key in packages:
                if not _selected(requirements, provider, version, held):
                    continue
                sums = await index.get(layout.sums_record(provider, version, record["sums_id"]))
                if not isinstance(sums, dict):
                    continue
                base = f"providers/{provider}/{version}"
                # Records of older releases still hold upstream's (maybe presigned) URLs.
                document = record.get("document")
                entry = {**{k: v for k, v in record.items() if k != "stored_as"},
                         "hostname": provider.hostname,
                         "namespace": provider.namespace, "type": provider.type,
                         "version": version, "platform": platform.key,
                         "zip": f"{base}/{key.rpartition('/')[2]}",
                         "sums": f"{base}/sums/{record['sums_id']}/SHA256SUMS",
                         "signature": f"{base}/sums/{record['sums_id']}/SHA256SUMS.sig",
                         "document": without_upstream_urls(document)
                         if isinstance(document, dict) else None}
                if not await add_blob(entry["zip"], key, record["shasum"],
                                      f"{provider} {version} {platform.key}"):
                    continue
                if entry["sums"] not in manifest["files"]:
                    add_listed(entry["sums"], bytes(sums["sums"]))
                    add_listed(entry["signature"], bytes(sums["signature"]))
                manifest["providers"].append(entry)
                lines.append((Artifact.provider(provider, version, platform),
                              manifest["files"][entry["zip"]]["size"], record["shasum"],
                              key_id(sums.get("signed_by"))))
                versions = await index.get(layout.version_list_record(provider))
                if isinstance(versions, dict):
                    manifest["versions"][str(provider)] = [
                        v for v in versions["value"] if v["version"] in held[str(provider)]]
            for module, version, key in modules:
                if not _selected(requirements, module, version, held):
                    continue
                member = f"modules/{module}/{key.rpartition('/')[2]}"
                recorded = recorded_sha256(await index.get(
                    layout.module_archive_record(module, version)))
                if not await add_blob(member, key, recorded, f"module {module} {version}",
                                      (module, version)):
                    continue
                first_seen = first_sightings(await index.get(
                    layout.sightings_record("module", str(module)))).get(version)
                manifest["modules"].append({
                    "hostname": module.hostname, "namespace": module.namespace,
                    "name": module.name, "system": module.system, "version": version,
                    "archive": member,
                    # The version policy's age of a module: carried across the air gap.
                    **({} if first_seen is None else {"first_seen": first_seen})})
                lines.append((Artifact.module(module, version), manifest["files"][member]["size"],
                              manifest["files"][member]["sha256"], None))
            if requirements is None:  # the whole cache: its CLI releases too
                for release, key, filename in await _stored_releases(storage):
                    added = await _release_entry(release, key, filename, add_blob,
                                                 add_listed, manifest["files"])
                    if added is not None:
                        manifest["releases"].append(added)
                        lines.append((Artifact.release(
                            release.product, release.version,
                            product_named(release.product).platform_of(release.version,
                                                                       filename)),
                            manifest["files"][added["archive"]]["size"], added["sha256"],
                            key_id(release.signed_by)))
            # The signature covers these exact bytes, and through them every member.
            manifest_bytes = json.dumps(manifest, indent=1).encode()
            add_data(MANIFEST, manifest_bytes)
            if signer is not None:
                add_data(SIGNATURE, signer.sign(manifest_bytes))
        os.replace(temp, output)
    except OSError as exc:
        raise BundleError(f"cannot write {output}: {exc}") from None
    user, signed_by = local_user(), signer.fingerprint if signer is not None else None
    for artifact, size, sha256, signing_key in lines:
        audit.record("exported", artifact, user=user, bundle=str(output),
                     bundle_signed_by=signed_by, bytes=size, sha256=sha256, key_id=signing_key)
    exported = {f"{e['hostname']}/{e['namespace']}/{e['type']}"
                for e in manifest["providers"]} | {
        f"{e['hostname']}/{e['namespace']}/{e['name']}/{e['system']}"
        for e in manifest["modules"]}
    unmatched = tuple(f"{r.address} {r.constraint}".strip() for r in requirements or []
                      if str(r.address) not in exported)
    return Counts(len(manifest["providers"]), len(manifest["modules"]), unmatched,
                  signer.fingerprint if signer is not None else "",
                  releases=len(manifest["releases"]))


def _add_checked(tar: tarfile.TarFile, member: str, blob: OpenBlob, stored_with: str | None,
                 what: str, where: str, module: tuple[ModuleAddress, str] | None
                 ) -> dict[str, Any]:
    """Add the blob to the tar as member once its bytes are read again and found to be the
    ones it was stored with (blocking); returns its manifest entry. A module archive with no
    recorded sha256 must at least read as an intact .tar.gz."""
    handle = blob.file()
    try:
        handle.seek(0)
        digest, size = hashlib.sha256(), 0
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
        sha256 = digest.hexdigest()
        # Never sign a file damaged or altered since it was stored.
        if stored_with is not None and sha256 != stored_with.lower():
            raise _damaged(what, where)
        if stored_with is None and module is not None:  # stored before sha256s were recorded
            handle.seek(0)
            _require_intact_module(*module, handle, where)
        handle.seek(0)
        info = tarfile.TarInfo(member)
        info.size = size
        tar.addfile(info, handle)
        return file_entry(size, sha256)
    finally:
        if blob.local_path is None:  # a remote blob's temp file; a local one closes with it
            handle.close()


@contextmanager
def _removed_on_failure(path: Path) -> Iterator[None]:
    try:
        yield
    except BaseException:
        path.unlink(missing_ok=True)
        raise


def _require_intact_module(module: ModuleAddress, version: str, handle: BinaryIO,
                           where: str) -> None:
    """A module archive no recorded sha256 vouches for must at least read as an intact
    .tar.gz (gzip's checksum covers every byte)."""
    try:
        read_packed(handle)
    except ValueError as exc:
        raise BundleError(f"module {module} {version}: {where} is damaged ({exc}); "
                          "nothing was exported. Delete that file (the proxy fetches it "
                          "again when next asked for it) and export again") from None
