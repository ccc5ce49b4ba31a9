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
import re
import shutil
import tarfile
import time
import zipfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import diskcache
import pysequoia

from proxy.archives import ArchiveStore
from proxy.bundle_manifest import (
    FORMAT,
    MANIFEST,
    SIGNATURE,
    BundleError,
    check_members,
    check_signature,
    file_entry,
    members_of,
    parse_manifest,
    read_small,
    stage,
)
from proxy.bundle_signing import ManifestSigner
from proxy.constraints import newest_matching
from proxy.errors import BadRequest, IntegrityError
from proxy.hashes import h1_of_zip
from proxy.models import (
    ModuleAddress,
    Platform,
    ProviderAddress,
    normalize_hostname,
    parse_module_version,
    parse_version,
)
from proxy.module_packing import read_packed
from proxy.module_registry import module_archive_key, recorded_sha256
from proxy.registry_documents import parse_sha256sums, without_upstream_urls
from proxy.settings import Config
from proxy.signatures import verify_detached
from proxy.verified_packages import UNSIGNED_ALLOWED_HOSTS, VerifiedPackage
from proxy.warm_sources import Requirement

_SUMS_ID = re.compile(r"[0-9a-f]{32}")
_CHUNK = 1 << 20


@dataclass(frozen=True)
class Counts:
    """How much a bundle held (and, for exports, which requirements nothing matched)."""

    providers: int
    modules: int
    unmatched: tuple[str, ...] = ()
    signed_by: str = ""  # fingerprint of the key that signed (export) or verified (import)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _index(config: Config) -> diskcache.Cache:
    return diskcache.Cache(str(config.cache.dir / "index"))


# --- export ----------------------------------------------------------------------------

def _stored_packages(index: diskcache.Cache, store: ArchiveStore
                     ) -> Iterator[tuple[ProviderAddress, str, Platform, dict[str, Any], Path]]:
    for key in index.iterkeys():
        if not isinstance(key, str) or not key.startswith("package/"):
            continue
        _, host, namespace, type_, version, platform_key = key.split("/")
        record = index.get(key)
        provider = ProviderAddress(host, namespace, type_)
        platform = Platform.from_key(platform_key)
        path = store.path_for(["archives", host, namespace, type_, version,
                               provider.archive_filename(version, platform)])
        if isinstance(record, dict) and record.get("size") and record.get("sums_id") \
                and path.is_file() and path.stat().st_size == record["size"]:
            yield provider, version, platform, record, path


def _stored_modules(store: ArchiveStore) -> Iterator[tuple[ModuleAddress, str, Path]]:
    root = store.cache_dir / "modules"
    for path in sorted(root.glob("*/*/*/*/*.tar.gz")):
        host, namespace, name, system = path.relative_to(root).parts[:4]
        yield ModuleAddress(host, namespace, name, system), path.name[:-7], path


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
    store = ArchiveStore(config.cache.dir)
    index = _index(config)
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
                sums = index.get(f"sums/{provider}/{version}/{record['sums_id']}")
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
                versions = index.get(f"versions/{provider}")
                if isinstance(versions, dict):
                    manifest["versions"][str(provider)] = [
                        v for v in versions["value"] if v["version"] in held[str(provider)]]
            for module, version, path in modules:
                if not _selected(requirements, module, version, held):
                    continue
                member = f"modules/{module}/{path.name}"
                recorded = recorded_sha256(index.get(module_archive_key(module, version)))
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

def _verify_provider(entry: dict[str, Any], staged: dict[str, Path],
                     trusted_keys: list[str] | None) -> VerifiedPackage:
    """Every check a live fill makes, on the staged files; BundleError names what failed."""
    try:
        return _check_provider(entry, staged, trusted_keys)
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        raise BundleError(f"invalid provider entry in {MANIFEST}: {exc!r}"[:300]) from None


def _check_provider(entry: dict[str, Any], staged: dict[str, Path],
                    trusted_keys: list[str] | None) -> VerifiedPackage:
    name = f"{entry['hostname']}/{entry['namespace']}/{entry['type']} {entry['version']}"
    try:
        provider = ProviderAddress.parse(entry["hostname"], entry["namespace"], entry["type"])
        platform = Platform.from_key(entry["platform"])
        version = parse_version(entry["version"])
    except BadRequest as exc:
        raise BundleError(f"{name}: invalid entry ({exc.message})") from None
    # The signature binds file name to checksum; the file name binds version and platform.
    if entry["filename"] != provider.archive_filename(version, platform):
        raise BundleError(f"{name}: file name {entry['filename']!r} is not the package of "
                          f"{version} {platform.key}")
    if not _SUMS_ID.fullmatch(str(entry["sums_id"])):
        raise BundleError(f"{name}: invalid sums_id")
    document = entry.get("document") or {}
    if document and (document.get("filename"), document.get("shasum"),
                     document.get("os"), document.get("arch")) != (
            entry["filename"], entry["shasum"], platform.os, platform.arch):
        raise BundleError(f"{name}: the download document does not describe this package")
    carried_keys = [k["ascii_armor"] for k in document.get("signing_keys", {}).get(
        "gpg_public_keys", []) if isinstance(k, dict) and "ascii_armor" in k]
    sums = staged[entry["sums"]].read_bytes()
    signature = staged[entry["signature"]].read_bytes()
    # The registry's signature must verify with the keys the exporter fetched with the
    # package, as for a live fill: the bundle's own signature vouches for those keys.
    checks = [(carried_keys, "the keys in the bundle")] if carried_keys \
        or provider.hostname not in UNSIGNED_ALLOWED_HOSTS else []
    if trusted_keys is not None:  # the operator's extra check: these keys must agree
        checks.append((trusted_keys, "any of the --trusted-keys"))
    for keys, which in checks:
        try:
            verify_detached(sums, signature, keys)
        except IntegrityError as exc:
            raise BundleError(f"{entry['signature']}: the signature does not verify with "
                              f"{which} ({exc.message})") from None
    if parse_sha256sums(sums).get(entry["filename"]) != entry["shasum"]:
        raise BundleError(f"{entry['sums']}: no matching line for {entry['filename']}")
    zip_path = staged[entry["zip"]]
    if _sha256(zip_path) != entry["shasum"]:
        raise BundleError(f"{entry['zip']}: sha256 does not match the signed checksum")
    try:
        h1 = h1_of_zip(zip_path)
    except (zipfile.BadZipFile, OSError, ValueError):
        raise BundleError(f"{entry['zip']}: not a valid zip") from None
    if entry.get("h1") and entry["h1"] != h1:
        raise BundleError(f"{entry['zip']}: h1 does not match")
    return VerifiedPackage(entry["filename"], entry["shasum"], h1, zip_path.stat().st_size,
                           entry["sums_id"], document or None)


def import_bundle(config: Config, bundle: Path, bundle_keys: Sequence[pysequoia.Cert] | None,
                  trusted_keys: list[str] | None = None) -> Counts:
    """Verify everything in the bundle, then add it to the cache (all or nothing).

    bundle_keys: the exporters' public keys; the manifest signature must verify with one of
    them, and then the registry keys the bundle carries are trusted for provider signatures.
    None: nothing checks the bundle's origin (the operator vouches for the path it came
    over). trusted_keys: armored OpenPGP keys that provider signatures must also verify
    with."""
    try:
        tar = tarfile.open(bundle, "r")
    except (OSError, tarfile.TarError) as exc:
        raise BundleError(f"not a readable tar bundle: {exc}") from None
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
    # Origin first, then the manifest's promises about the tar's members: nothing is
    # parsed further, copied or written before both hold.
    signed_by = "" if bundle_keys is None else check_signature(manifest_bytes, tar, members,
                                                               bundle_keys)
    manifest, listed = parse_manifest(manifest_bytes)
    check_members(listed, members, max(config.upstream.max_archive_size,
                                        config.modules.max_archive_size))
    providers, module_entries = manifest.get("providers"), manifest.get("modules")
    versions = manifest.get("versions", {})
    if not isinstance(providers, list) or not isinstance(module_entries, list) \
            or not isinstance(versions, dict):
        raise BundleError(f"{MANIFEST} is malformed")
    store = ArchiveStore(config.cache.dir)
    staging = store.tmp / "import"
    staging.mkdir()
    index = None
    try:
        staged = stage(tar, members, listed, staging)
        verified = [(entry, _verify_provider(entry, staged, trusted_keys))
                    for entry in providers]
        modules = [(_module_of(entry, staged), entry) for entry in module_entries]
        _refuse_duplicates([e["zip"] for e, _p in verified] + [e["archive"] for e in
                                                               module_entries])
        imported = {f"{e['hostname']}/{e['namespace']}/{e['type']}" for e, _p in verified}
        for address, entries in versions.items():
            if address not in imported or not isinstance(entries, list) \
                    or not all(_valid_version_entry(v) for v in entries):
                raise BundleError(f"{MANIFEST}: invalid version list for {address[:100]!r}")
        index = _index(config)
        changes = _planned_changes(index, store, staged, verified, modules)
        # Everything verified: now, and only now, the cache changes; files first, then the
        # index records that vouch for them.
        for source, parts in changes:
            _publish(store, source, parts)
        store.measure()  # running proxies count what was added against cache.max_size
        for entry, package in verified:
            provider = ProviderAddress(entry["hostname"], entry["namespace"], entry["type"])
            key = f"{provider}/{entry['version']}"
            index.set(f"sums/{key}/{package.sums_id}", {
                "sums": staged[entry["sums"]].read_bytes(),
                "signature": staged[entry["signature"]].read_bytes(),
                "signed_by": "", "url": ""})
            index.set(f"package/{key}/{entry['platform']}", asdict(package))
        for address, entries in versions.items():
            _merge_list(index, f"versions/{address}", entries, lambda v: v["version"])
        for module, entry in modules:
            _merge_list(index, f"module-versions/{module}", [entry["version"]], str)
        return Counts(len(verified), len(modules), signed_by=signed_by)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if index is not None:
            index.close()
        store.close()


def _module_of(entry: Any, staged: dict[str, Path]) -> ModuleAddress:
    try:
        module = ModuleAddress.parse(entry["hostname"], entry["namespace"], entry["name"],
                                     entry["system"])
        parse_module_version(entry["version"])
        staged[entry["archive"]]
    except (BadRequest, KeyError, TypeError) as exc:
        raise BundleError(f"invalid module entry in {MANIFEST}: {exc!r}"[:300]) from None
    return module


def _refuse_duplicates(members: list[str]) -> None:
    seen: set[str] = set()
    for member in members:
        if member in seen:
            raise BundleError(f"{member}: used by two entries")
        seen.add(member)


def _planned_changes(index: diskcache.Cache, store: ArchiveStore, staged: dict[str, Path],
                     verified: list[tuple[dict[str, Any], VerifiedPackage]],
                     modules: list[tuple[ModuleAddress, dict[str, Any]]],
                     ) -> list[tuple[Path, list[str]]]:
    """The files to publish. What the cache already holds stays: the same package again is
    skipped; a different one under the same name refuses the bundle."""
    changes = []
    for entry, package in verified:
        provider = ProviderAddress(entry["hostname"], entry["namespace"], entry["type"])
        existing = index.get(f"package/{provider}/{entry['version']}/{entry['platform']}")
        if isinstance(existing, dict) and existing.get("shasum") != package.shasum:
            raise BundleError(f"{entry['zip']}: the cache holds a different package under "
                              "this name")
        changes.append((staged[entry["zip"]], [
            "archives", provider.hostname, provider.namespace, provider.type,
            entry["version"], entry["filename"]]))
    for module, entry in modules:
        parts = ["modules", module.hostname, module.namespace, module.name, module.system,
                 f"{entry['version']}.tar.gz"]
        target = store.path_for(parts)
        if target.exists() and _sha256(target) != _sha256(staged[entry["archive"]]):
            raise BundleError(f"{entry['archive']}: the cache holds a different module "
                              "archive under this name")
        changes.append((staged[entry["archive"]], parts))
    return changes


def _valid_version_entry(entry: object) -> bool:
    if not isinstance(entry, dict) or not isinstance(entry.get("platforms"), list) \
            or not isinstance(entry.get("protocols"), list) \
            or not all(isinstance(p, str) for p in entry["protocols"]):
        return False
    try:
        parse_version(entry["version"])
        for key in entry["platforms"]:
            Platform.from_key(key)
    except (BadRequest, KeyError, TypeError):
        return False
    return True


def import_mirror_directory(config: Config, directory: Path) -> Counts:
    """Import what `terraform providers mirror` wrote: every zip is checked against the h1
    (or zh) hashes its VERSION.json lists. No signatures exist there: such packages serve
    the network mirror protocol, not the registry protocol."""
    store = ArchiveStore(config.cache.dir)
    index = _index(config)
    found = []
    try:
        for zip_path in sorted(directory.glob("*/*/*/terraform-provider-*.zip")):
            host_dir, namespace, type_ = zip_path.relative_to(directory).parts[:3]
            try:
                provider = ProviderAddress.parse(normalize_hostname(host_dir), namespace,
                                                 type_)
                version, platform = provider.parse_archive_filename(zip_path.name)
            except BadRequest as exc:
                raise BundleError(f"{zip_path}: {exc.message}") from None
            document_path = zip_path.parent / f"{version}.json"
            try:
                listed = json.loads(document_path.read_text())["archives"][platform.key]
                hashes = set(listed["hashes"])
            except (OSError, ValueError, KeyError, TypeError):
                raise BundleError(f"{document_path}: no hashes for {platform.key}") from None
            copy = store.temp_file()  # check the copy that will be stored, not the source
            shutil.copyfile(zip_path, copy)
            try:
                sha, h1 = _sha256(copy), h1_of_zip(copy)
            except (zipfile.BadZipFile, OSError, ValueError):
                raise BundleError(f"{zip_path}: not a valid zip") from None
            if h1 not in hashes and f"zh:{sha}" not in hashes:
                raise BundleError(f"{zip_path}: matches none of the hashes in "
                                  f"{document_path.name}")
            existing = index.get(f"package/{provider}/{version}/{platform.key}")
            if isinstance(existing, dict) and existing.get("shasum") != sha:
                raise BundleError(f"{zip_path}: the cache holds a different package under "
                                  "this name")
            found.append((provider, version, platform, copy, sha, h1, existing))
        for provider, version, platform, copy, sha, h1, existing in found:
            if isinstance(existing, dict):
                copy.unlink()
                continue  # the same package, maybe with more facts (signatures): keep those
            size = copy.stat().st_size
            _publish(store, copy, ["archives", provider.hostname, provider.namespace,
                                   provider.type, version,
                                   provider.archive_filename(version, platform)])
            index.set(f"package/{provider}/{version}/{platform.key}", asdict(
                VerifiedPackage(provider.archive_filename(version, platform), sha, h1, size)))
            entry = {"version": version, "protocols": [], "platforms": [platform.key]}
            _merge_list(index, f"versions/{provider}", [entry], lambda v: v["version"])
        store.measure()  # running proxies count what was added against cache.max_size
        return Counts(len(found), 0)
    finally:
        index.close()
        store.close()


def _publish(store: ArchiveStore, source: Path, parts: list[str]) -> None:
    final = store.path_for(parts)
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(source, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(source, final)


def _merge_list(index: diskcache.Cache, record_key: str, entries: list[Any],
                identity: Callable[[Any], str]) -> None:
    """Add entries to a cached list (version lists), keeping what is there; entries for the
    same version merge their platforms. A new list is dated 0, so that an online proxy
    refreshes it soon; offline, age does not matter."""
    record = index.get(record_key)
    current: list[Any] = list(record["value"]) if isinstance(record, dict) else []
    for entry in entries:
        same = next((c for c in current if identity(c) == identity(entry)), None)
        if same is None:
            current.append(entry)
        elif isinstance(same, dict) and isinstance(entry, dict):
            same["platforms"] = sorted(set(same.get("platforms", []))
                                       | set(entry.get("platforms", [])))
    index.set(record_key, {"fetched_at": record["fetched_at"] if isinstance(record, dict)
                           else 0, "value": current})


def split_armored_keys(text: str) -> list[str]:
    """Each armored public key block of a file that may hold several."""
    marker = "-----BEGIN PGP PUBLIC KEY BLOCK-----"
    blocks = [marker + part for part in text.split(marker)[1:]]
    if not blocks:
        raise BundleError("the trusted keys file holds no armored OpenPGP public key")
    return blocks
