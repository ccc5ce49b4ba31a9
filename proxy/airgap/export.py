"""Air-gap export: verified packages and module archives from the cache, with their
SHA256SUMS, signatures and signing keys, written into one tar with a manifest of every
member's size and sha256, signed with the operator's key."""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from proxy.airgap.constraints import newest_matching
from proxy.airgap.manifest import FORMAT, MANIFEST, SIGNATURE, BundleError, Counts, file_entry
from proxy.airgap.signing import ManifestSigner
from proxy.airgap.sources import Requirement
from proxy.config.settings import Config
from proxy.core.models import ModuleAddress, Platform, ProviderAddress
from proxy.modules.packing import read_packed
from proxy.protocols.module_registry import recorded_sha256
from proxy.store import layout
from proxy.store.disk import DiskBlobStore
from proxy.store.disk_import import IndexReader, open_index
from proxy.upstream.documents import without_upstream_urls
from proxy.verification.hashes import sha256_of_path


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
                    digest = sha256_of_path(path)
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
