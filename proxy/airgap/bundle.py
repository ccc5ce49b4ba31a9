"""Air-gap bundles: `export` writes verified packages and module archives from the cache,
with their SHA256SUMS, signatures and signing keys, into one tar with a manifest of every
member's size and sha256, signed with the operator's key; `import` checks that signature
and that the tar holds exactly what the manifest lists, then verifies all of it again
(signatures, checksums, h1) before anything enters the cache, and refuses the whole bundle
on any mismatch. A directory written by `terraform providers mirror` imports too (its
packages checked against its h1 hashes)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
import time
import zipfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pysequoia

from proxy.airgap.constraints import newest_matching
from proxy.airgap.entries import ModuleEntry, ProviderEntry, parse_contents
from proxy.airgap.manifest import (
    FORMAT,
    MANIFEST,
    SIGNATURE,
    BundleError,
    check_members,
    check_signature,
    file_entry,
    members_of,
    open_bundle,
    parse_manifest,
    read_small,
    stage,
)
from proxy.airgap.mirror_import import import_mirror
from proxy.airgap.publish import (
    apply_changes,
    check_room,
    measure,
    plan_list,
    regular_sha256,
)
from proxy.airgap.signing import ManifestSigner
from proxy.airgap.sources import Requirement
from proxy.config.settings import Config
from proxy.core.errors import IntegrityError
from proxy.core.models import ModuleAddress, Platform, ProviderAddress
from proxy.modules.packing import read_packed
from proxy.protocols.module_registry import recorded_sha256
from proxy.store import layout
from proxy.store.disk import DiskBlobStore
from proxy.store.disk_import import (
    CacheChanges,
    IndexReader,
    cache_work,
    existing_index,
    open_index,
)
from proxy.upstream.documents import parse_sha256sums, without_upstream_urls
from proxy.verification.hashes import h1_of_zip
from proxy.verification.packages import UNSIGNED_ALLOWED_HOSTS, VerifiedPackage
from proxy.verification.signatures import verify_detached

_CHUNK = 1 << 20
# A mirror directory's VERSION.json is read into memory; real ones are a few kilobytes.
_MAX_MIRROR_DOCUMENT = 8 << 20


@dataclass(frozen=True)
class Counts:
    """How much a bundle held (imports: what was new to the cache, and how many packages
    and module archives the cache held already; exports: which requirements nothing
    matched)."""

    providers: int
    modules: int
    unmatched: tuple[str, ...] = ()
    signed_by: str = ""  # fingerprint of the key that signed (export) or verified (import)
    present: int = 0


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


# --- export ----------------------------------------------------------------------------

def _stored_packages(index: IndexReader, store: DiskBlobStore
                     ) -> Iterator[tuple[ProviderAddress, str, Platform, dict[str, Any], Path]]:
    for key in index.keys(layout.PACKAGE_RECORDS):
        named = layout.parse_package_record(key)
        if named is None:
            continue
        provider, version, platform = named
        record = index.get(key)
        path = store.path_of(layout.provider_archive(provider, version, platform))
        if isinstance(record, dict) and record.get("size") and record.get("sums_id") \
                and path.is_file() and path.stat().st_size == record["size"]:
            yield provider, version, platform, record, path


def _stored_modules(store: DiskBlobStore) -> Iterator[tuple[ModuleAddress, str, Path]]:
    for info in store.listed(layout.module_archive_prefix()):
        named = layout.parse_module_archive(info.key)
        if named is not None:
            yield *named, store.path_of(info.key)


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
    signed by signer (None: unsigned)."""
    store = DiskBlobStore.at(config.cache.dir)
    index = open_index(config.cache.dir)
    try:
        packages = list(_stored_packages(index, store))
        modules = list(_stored_modules(store))
        held: dict[str, set[str]] = {}
        for provider, version, _p, _r, _path in packages:
            held.setdefault(str(provider), set()).add(version)
        for module, version, _path in modules:
            held.setdefault(str(module), set()).add(version)
        manifest: dict[str, Any] = {"format": FORMAT, "created": int(time.time()),
                                    "providers": [], "modules": [], "versions": {},
                                    "files": {}}
        temp = output.with_name(output.name + ".part")
        with _removed_on_failure(temp), tarfile.open(temp, "w") as tar:
            def add_data(member: str, data: bytes) -> None:
                info = tarfile.TarInfo(member)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))

            def add(member: str, path: Path | None = None, data: bytes | None = None,
                    stored_with: str | None = None, what: str = "") -> None:
                if path is not None:
                    digest = _sha256(path)
                    # Never sign a file damaged or altered on disk since it was stored.
                    if stored_with is not None and digest != stored_with.lower():
                        raise BundleError(
                            f"{what}: {path} does not match the sha256 it was stored with "
                            "(damaged or altered on disk); nothing was exported. Delete "
                            "that file (the proxy fetches it again when next asked for it) "
                            "and export again")
                    manifest["files"][member] = file_entry(path.stat().st_size, digest)
                    tar.add(str(path), arcname=member, recursive=False)
                else:
                    assert data is not None
                    manifest["files"][member] = file_entry(
                        len(data), hashlib.sha256(data).hexdigest())
                    add_data(member, data)

            for provider, version, platform, record, path in packages:
                if not _selected(requirements, provider, version, held):
                    continue
                sums = index.get(layout.sums_record(provider, version, record["sums_id"]))
                if not isinstance(sums, dict):
                    continue
                base = f"providers/{provider}/{version}"
                # Records of older releases still hold upstream's (maybe presigned) URLs.
                document = record.get("document")
                entry = {**{k: v for k, v in record.items() if k != "stored_as"},
                         "hostname": provider.hostname,
                         "namespace": provider.namespace, "type": provider.type,
                         "version": version, "platform": platform.key,
                         "zip": f"{base}/{path.name}",
                         "sums": f"{base}/sums/{record['sums_id']}/SHA256SUMS",
                         "signature": f"{base}/sums/{record['sums_id']}/SHA256SUMS.sig",
                         "document": without_upstream_urls(document)
                         if isinstance(document, dict) else None}
                add(entry["zip"], path=path, stored_with=record["shasum"],
                    what=f"{provider} {version} {platform.key}")
                if entry["sums"] not in manifest["files"]:
                    add(entry["sums"], data=bytes(sums["sums"]))
                    add(entry["signature"], data=bytes(sums["signature"]))
                manifest["providers"].append(entry)
                versions = index.get(layout.version_list_record(provider))
                if isinstance(versions, dict):
                    manifest["versions"][str(provider)] = [
                        v for v in versions["value"] if v["version"] in held[str(provider)]]
            for module, version, path in modules:
                if not _selected(requirements, module, version, held):
                    continue
                member = f"modules/{module}/{path.name}"
                recorded = recorded_sha256(index.get(layout.module_archive_record(module,
                                                                                  version)))
                if recorded is None:  # stored before sha256s were recorded
                    _require_intact_module(module, version, path)
                add(member, path=path, stored_with=recorded, what=f"module {module} {version}")
                manifest["modules"].append({
                    "hostname": module.hostname, "namespace": module.namespace,
                    "name": module.name, "system": module.system, "version": version,
                    "archive": member})
            # The signature covers these exact bytes, and through them every member.
            manifest_bytes = json.dumps(manifest, indent=1).encode()
            add_data(MANIFEST, manifest_bytes)
            if signer is not None:
                add_data(SIGNATURE, signer.sign(manifest_bytes))
        os.replace(temp, output)
        exported = {f"{e['hostname']}/{e['namespace']}/{e['type']}"
                    for e in manifest["providers"]} | {
            f"{e['hostname']}/{e['namespace']}/{e['name']}/{e['system']}"
            for e in manifest["modules"]}
        unmatched = tuple(f"{r.address} {r.constraint}".strip() for r in requirements or []
                          if str(r.address) not in exported)
        return Counts(len(manifest["providers"]), len(manifest["modules"]), unmatched,
                      signer.fingerprint if signer is not None else "")
    except OSError as exc:
        raise BundleError(f"cannot write {output}: {exc}") from None
    finally:
        index.close()
        store.close()


@contextmanager
def _removed_on_failure(path: Path) -> Iterator[None]:
    try:
        yield
    except BaseException:
        path.unlink(missing_ok=True)
        raise


def _require_intact_module(module: ModuleAddress, version: str, path: Path) -> None:
    """A module archive no recorded sha256 vouches for must at least read as an intact
    .tar.gz (gzip's checksum covers every byte)."""
    with open(path, "rb") as handle:
        try:
            read_packed(handle)
        except ValueError as exc:
            raise BundleError(f"module {module} {version}: {path} is damaged ({exc}); "
                              "nothing was exported. Delete that file (the proxy fetches it "
                              "again when next asked for it) and export again") from None


# --- import ----------------------------------------------------------------------------

def _verify_provider(entry: ProviderEntry, staged: dict[str, Path],
                     trusted_keys: list[str] | None) -> VerifiedPackage:
    """Every check a live fill makes, on the staged files; BundleError names what failed."""
    sums = staged[entry.sums].read_bytes()
    signature = staged[entry.signature].read_bytes()
    # The registry's signature must verify with the keys the exporter fetched with the
    # package, as for a live fill: the bundle's own signature vouches for those keys.
    checks = [(list(entry.signing_keys), "the keys in the bundle")] if entry.signing_keys \
        or entry.provider.hostname not in UNSIGNED_ALLOWED_HOSTS else []
    if trusted_keys is not None:  # the operator's extra check: these keys must agree
        checks.append((trusted_keys, "any of the --trusted-keys"))
    for keys, which in checks:
        try:
            verify_detached(sums, signature, keys)
        except IntegrityError as exc:
            raise BundleError(f"{entry.signature}: the signature does not verify with "
                              f"{which} ({exc.message})") from None
    if parse_sha256sums(sums).get(entry.filename) != entry.shasum:
        raise BundleError(f"{entry.sums}: no matching line for {entry.filename}")
    zip_path = staged[entry.zip]
    if _sha256(zip_path) != entry.shasum:
        raise BundleError(f"{entry.zip}: sha256 does not match the signed checksum")
    try:
        h1 = h1_of_zip(zip_path)
    except (zipfile.BadZipFile, OSError, ValueError):
        raise BundleError(f"{entry.zip}: not a valid zip") from None
    if entry.h1 is not None and entry.h1 != h1:
        raise BundleError(f"{entry.zip}: h1 does not match")
    return VerifiedPackage(entry.filename, entry.shasum, h1, zip_path.stat().st_size,
                           entry.sums_id, entry.document)


def import_bundle(config: Config, bundle: Path, bundle_keys: Sequence[pysequoia.Cert] | None,
                  trusted_keys: list[str] | None = None) -> Counts:
    """Verify everything in the bundle, then add it to the cache (all or nothing).

    bundle_keys: the exporters' public keys; the manifest signature must verify with one of
    them, and then the registry keys the bundle carries are trusted for provider signatures.
    None: nothing checks the bundle's origin (the operator vouches for the path it came
    over). trusted_keys: armored OpenPGP keys that provider signatures must also verify
    with."""
    tar = open_bundle(bundle)
    try:
        with tar:
            return _import_from(config, tar, bundle_keys, trusted_keys)
    except (tarfile.TarError, EOFError, RecursionError, UnicodeDecodeError) as exc:
        raise BundleError(f"the bundle cannot be read: {exc!r}"[:300]) from None


def _import_from(config: Config, tar: tarfile.TarFile,
                 bundle_keys: Sequence[pysequoia.Cert] | None,
                 trusted_keys: list[str] | None) -> Counts:
    members = members_of(tar)
    manifest_bytes = read_small(tar, members, MANIFEST)
    # Origin first, then the manifest's promises about the tar's members and what it says
    # the bundle carries: nothing is copied, nor the cache touched, before all of it holds.
    signed_by = "" if bundle_keys is None else check_signature(manifest_bytes, tar, members,
                                                               bundle_keys)
    manifest, listed = parse_manifest(manifest_bytes)
    check_members(listed, members, max(config.upstream.max_archive_size,
                                        config.modules.max_archive_size))
    contents = parse_contents(manifest, listed)
    check_room(config.cache.dir, sum(size for size, _sha in listed.values()),
               "the bundle's members")
    with cache_work(config.cache.dir) as store:
        staging = store.work_dir()
        staged = stage(tar, members, listed, staging)
        packages = [(entry, _verify_provider(entry, staged, trusted_keys))
                    for entry in contents.providers]
        changes = CacheChanges(store)
        with existing_index(config.cache.dir) as index:
            old_packages = _plan_packages(changes, index, store, staged, packages)
            old_modules = _plan_modules(changes, index, store, staged, listed,
                                        contents.modules)
            for version_list in contents.versions:
                plan_list(changes, index, layout.version_list_record(version_list.provider),
                          list(version_list.entries), lambda v: v["version"])
        apply_changes(changes)
        measure(store, changes)
    return Counts(len(packages) - old_packages, len(contents.modules) - old_modules,
                  signed_by=signed_by, present=old_packages + old_modules)


def _plan_packages(changes: CacheChanges, index: IndexReader | None, store: DiskBlobStore,
                   staged: dict[str, Path],
                   packages: list[tuple[ProviderEntry, VerifiedPackage]]) -> int:
    """Plan the packages' files and records; returns how many the cache already holds. What
    the cache holds stays: a different package under the same name refuses the bundle."""
    present = 0
    for entry, package in packages:
        existing = index.get(entry.record_key) if index is not None else None
        if isinstance(existing, dict) and existing.get("shasum") != package.shasum:
            raise BundleError(f"{entry.zip}: the cache holds a different package under "
                              "this name")
        sums = staged[entry.sums].read_bytes()
        held_sums = index.get(entry.sums_key) if index is not None else None
        if isinstance(held_sums, dict):
            if bytes(held_sums.get("sums", b"")) != sums:
                raise BundleError(f"{entry.sums}: the cache holds a different SHA256SUMS "
                                  "under this name")
        else:
            changes.set_record(entry.sums_key, {
                "sums": sums, "signature": staged[entry.signature].read_bytes(),
                "signed_by": "", "url": ""})
        if isinstance(existing, dict) \
                and regular_sha256(store.path_of(entry.archive_key)) == package.shasum:
            present += 1
            continue
        changes.put_file(staged[entry.zip], entry.archive_key)
        changes.set_record(entry.record_key, asdict(package))
    return present


def _plan_modules(changes: CacheChanges, index: IndexReader | None, store: DiskBlobStore,
                  staged: dict[str, Path], listed: dict[str, tuple[int, str]],
                  modules: Sequence[ModuleEntry]) -> int:
    """Plan the module archives, the sha256 each is served and exported against, and their
    version lists; returns how many the cache already holds. A different archive under the
    same name refuses the bundle."""
    present = 0
    for entry in modules:
        size, sha256 = listed[entry.archive]
        held = regular_sha256(store.path_of(entry.archive_key))
        if held == sha256:
            present += 1
        elif held is not None:
            raise BundleError(f"{entry.archive}: the cache holds a different module "
                              "archive under this name")
        else:
            changes.put_file(staged[entry.archive], entry.archive_key)
        record_key = layout.module_archive_record(entry.module, entry.version)
        if recorded_sha256(index.get(record_key) if index is not None else None) != sha256:
            # No identity yet: the first hit reads the archive once against this sha256.
            changes.set_record(record_key, {"sha256": sha256, "size": size, "stored_as": None})
        plan_list(changes, index, layout.module_version_list_record(entry.module),
                  [entry.version], str)
    return present


def import_mirror_directory(config: Config, directory: Path) -> Counts:
    """Import what `terraform providers mirror` wrote (see proxy.airgap.mirror_import)."""
    imported, present = import_mirror(config, directory)
    return Counts(imported, 0, present=present)


def split_armored_keys(text: str) -> list[str]:
    """Each armored public key block of a file that may hold several."""
    marker = "-----BEGIN PGP PUBLIC KEY BLOCK-----"
    blocks = [marker + part for part in text.split(marker)[1:]]
    if not blocks:
        raise BundleError("the trusted keys file holds no armored OpenPGP public key")
    return blocks
