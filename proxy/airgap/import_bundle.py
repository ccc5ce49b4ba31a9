"""Air-gap import: a bundle's manifest signature is checked, and that the tar holds exactly
what the manifest lists, then all of it is verified again (signatures, checksums, h1) before
anything enters the cache; any mismatch refuses the whole bundle. A directory written by
`terraform providers mirror` imports too (its packages checked against its h1 hashes)."""

from __future__ import annotations

import tarfile
import time
import zipfile
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import pysequoia

from proxy.airgap import publish
from proxy.airgap.entries import ModuleEntry, ProviderEntry, ReleaseEntry, parse_contents
from proxy.airgap.import_target import ImportTarget, import_target, plan_list
from proxy.airgap.manifest import (
    MANIFEST,
    BundleError,
    Counts,
    check_members,
    check_signature,
    members_of,
    open_bundle,
    parse_manifest,
    read_small,
    stage,
)
from proxy.airgap.mirror_import import import_mirror
from proxy.airgap.publish import opened_audit
from proxy.config.settings import Config
from proxy.core.audit import Artifact, AuditLog, key_id, local_user
from proxy.core.errors import IntegrityError
from proxy.protocols.module_registry import recorded_sha256
from proxy.store import layout
from proxy.upstream.documents import parse_sha256sums
from proxy.verification.hashes import h1_of_zip, sha256_of_path
from proxy.verification.packages import UNSIGNED_ALLOWED_HOSTS, VerifiedPackage
from proxy.verification.release_times import with_carried
from proxy.verification.releases import (
    ReleaseKeyError,
    VerifiedRelease,
    load_release_keys,
    verify_release,
)
from proxy.verification.signatures import verify_detached


def _verify_provider(entry: ProviderEntry, staged: dict[str, Path],
                     trusted_keys: list[str] | None) -> tuple[VerifiedPackage, str | None]:
    """Every check a live fill makes, on the staged files, and the fingerprint of the key
    that signed the SHA256SUMS (None: unsigned); BundleError names what failed."""
    sums = staged[entry.sums].read_bytes()
    signature = staged[entry.signature].read_bytes()
    # The registry's signature must verify with the keys the exporter fetched with the
    # package, as for a live fill: the bundle's own signature vouches for those keys.
    checks = [(list(entry.signing_keys), "the keys in the bundle")] if entry.signing_keys \
        or entry.provider.hostname not in UNSIGNED_ALLOWED_HOSTS else []
    if trusted_keys is not None:  # the operator's extra check: these keys must agree
        checks.append((trusted_keys, "any of the --trusted-keys"))
    signed_by = None
    for keys, which in checks:
        try:
            verified_by = verify_detached(sums, signature, keys)  # every check runs
        except IntegrityError as exc:
            raise BundleError(f"{entry.signature}: the signature does not verify with "
                              f"{which} ({exc.message})") from None
        signed_by = signed_by or verified_by
    if parse_sha256sums(sums).get(entry.filename) != entry.shasum:
        raise BundleError(f"{entry.sums}: no matching line for {entry.filename}")
    zip_path = staged[entry.zip]
    if sha256_of_path(zip_path) != entry.shasum:
        raise BundleError(f"{entry.zip}: sha256 does not match the signed checksum")
    try:
        h1 = h1_of_zip(zip_path)
    except (zipfile.BadZipFile, OSError, ValueError):
        raise BundleError(f"{entry.zip}: not a valid zip") from None
    if entry.h1 is not None and entry.h1 != h1:
        raise BundleError(f"{entry.zip}: h1 does not match")
    return VerifiedPackage(entry.filename, entry.shasum, h1, zip_path.stat().st_size,
                           entry.sums_id, entry.document), signed_by


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
        with tar, opened_audit(config) as audit:
            return _import_from(config, tar, bundle_keys, trusted_keys, audit, bundle)
    except (tarfile.TarError, EOFError, RecursionError, UnicodeDecodeError) as exc:
        raise BundleError(f"the bundle cannot be read: {exc!r}"[:300]) from None


def _import_from(config: Config, tar: tarfile.TarFile,
                 bundle_keys: Sequence[pysequoia.Cert] | None,
                 trusted_keys: list[str] | None, audit: AuditLog, bundle: Path) -> Counts:
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
    publish.check_room(config.cache.dir, sum(size for size, _sha in listed.values()),
                       "the bundle's members")
    with import_target(config) as target:
        staged = stage(tar, members, listed, target.work_dir())
        verified = [(entry, *_verify_provider(entry, staged, trusted_keys))
                    for entry in contents.providers]
        packages = [(entry, package) for entry, package, _signer in verified]
        signers = {entry.sums_key: signer for entry, _package, signer in verified}
        old_packages = _plan_packages(target, staged, packages, signers)
        old_modules = _plan_modules(target, staged, listed, contents.modules,
                                     time.time())
        for version_list in contents.versions:
            plan_list(target, layout.version_list_record(version_list.provider),
                      list(version_list.entries), lambda v: v["version"])
        releases = [(entry, _verify_release(entry, staged, config)) for entry in
                    contents.releases]
        old_releases = _plan_releases(target, staged, listed, releases)
        target.apply()
    user, source = local_user(), str(bundle)
    for entry, package, signer in verified:
        audit.record("imported", Artifact.provider(entry.provider, entry.version,
                                                   entry.platform),
                     outcome="present" if entry.record_key in old_packages else "ok",
                     user=user, bundle=source, bundle_signed_by=signed_by or None,
                     bytes=package.size, sha256=package.shasum, key_id=key_id(signer))
    for module in contents.modules:
        size, sha256 = listed[module.archive]
        audit.record("imported", Artifact.module(module.module, module.version),
                     outcome="present" if module.archive_key in old_modules else "ok",
                     user=user, bundle=source, bundle_signed_by=signed_by or None,
                     bytes=size, sha256=sha256)
    for archived, release in releases:
        size, sha256 = listed[archived.archive]
        audit.record("imported", Artifact.release(
            archived.product.name, archived.version,
            archived.product.platform_of(archived.version, archived.filename)),
            outcome="present" if archived.archive_key in old_releases else "ok", user=user,
            bundle=source, bundle_signed_by=signed_by or None, bytes=size, sha256=sha256,
            key_id=key_id(release.signed_by))
    return Counts(len(packages) - len(old_packages), len(contents.modules) - len(old_modules),
                  signed_by=signed_by,
                  present=len(old_packages) + len(old_modules) + len(old_releases),
                  releases=len(releases) - len(old_releases))


def _verify_release(entry: ReleaseEntry, staged: dict[str, Path],
                    config: Config) -> VerifiedRelease:
    """The checks a live fill makes: the SHA256SUMS signed by the release keys configured
    here (the bundle carries none), the archive's sha256 equal to its signed line."""
    try:
        keys = load_release_keys(config.releases)[entry.product.name]
    except (OSError, ReleaseKeyError) as exc:
        raise BundleError(f"the release keys cannot be read: {exc}") from None
    try:
        release = verify_release(
            entry.product, entry.version, staged[entry.sums].read_bytes(),
            {name: staged[member].read_bytes() for name, member in entry.signatures.items()},
            keys, {name: staged[member].read_bytes() for name, member in entry.extras.items()})
    except IntegrityError as exc:
        raise BundleError(f"{entry.sums}: {exc.message}") from None
    if release.checksums.get(entry.filename) != entry.sha256:
        raise BundleError(f"{entry.sums}: no matching line for {entry.filename}")
    if sha256_of_path(staged[entry.archive]) != entry.sha256:
        raise BundleError(f"{entry.archive}: sha256 does not match the signed checksum")
    return release


def _plan_releases(target: ImportTarget, staged: dict[str, Path],
                   listed: dict[str, tuple[int, str]],
                   releases: Sequence[tuple[ReleaseEntry, VerifiedRelease]]) -> set[str]:
    """Plan the release archives and records; returns the keys of the archives the cache
    held already. A different SHA256SUMS or archive under the same name refuses the
    bundle."""
    present = set()
    for entry, release in releases:
        record_key = layout.release_record(entry.product.name, entry.version)
        held = target.planned(record_key) or target.record(record_key)
        try:
            held_sums = None if held is None else \
                VerifiedRelease.from_record(release.product, release.version, held).sums
        except (ValueError, KeyError, TypeError):
            held_sums = None  # a damaged record: the bundle's verified one replaces it
        if held_sums is None:
            target.set_record(record_key, release.to_record())
        elif held_sums != release.sums:
            raise BundleError(f"{entry.sums}: the cache holds a different SHA256SUMS under "
                              "this name")
        stored = target.blob_sha256(entry.archive_key)
        file_record = layout.release_file_record(entry.product.name, entry.version,
                                                 entry.filename)
        if stored is not None and stored != entry.sha256:
            raise BundleError(f"{entry.archive}: the cache holds a different archive under "
                              "this name")
        if stored is None:
            target.put_file(staged[entry.archive], entry.archive_key)
        else:
            present.add(entry.archive_key)
            held_file = target.record(file_record)
            if isinstance(held_file, dict) and held_file.get("sha256") == entry.sha256:
                continue
        # No identity yet: the first hit reads the archive once against this sha256.
        target.set_record(file_record, {"sha256": entry.sha256,
                                        "size": listed[entry.archive][0], "stored_as": None})
    return present


def _plan_packages(target: ImportTarget, staged: dict[str, Path],
                   packages: list[tuple[ProviderEntry, VerifiedPackage]],
                   signers: dict[str, str | None]) -> set[str]:
    """Plan the packages' files and records (with the fingerprint of the key each
    SHA256SUMS verified with, in signers); returns the record keys of those the cache
    already holds. What the cache holds stays: a different package under the same name
    refuses the bundle."""
    present = set()
    for entry, package in packages:
        existing = target.record(entry.record_key)
        if isinstance(existing, dict) and existing.get("shasum") != package.shasum:
            raise BundleError(f"{entry.zip}: the cache holds a different package under "
                              "this name")
        sums = staged[entry.sums].read_bytes()
        held_sums = target.record(entry.sums_key)
        if isinstance(held_sums, dict):
            if bytes(held_sums.get("sums", b"")) != sums:
                raise BundleError(f"{entry.sums}: the cache holds a different SHA256SUMS "
                                  "under this name")
        else:
            target.set_record(entry.sums_key, {
                "sums": sums, "signature": staged[entry.signature].read_bytes(),
                "signed_by": signers.get(entry.sums_key) or "", "url": ""})
        if isinstance(existing, dict) \
                and target.blob_sha256(entry.archive_key) == package.shasum:
            present.add(entry.record_key)
            continue
        target.put_file(staged[entry.zip], entry.archive_key)
        target.set_record(entry.record_key, asdict(package))
    return present


def _plan_modules(target: ImportTarget, staged: dict[str, Path],
                  listed: dict[str, tuple[int, str]], modules: Sequence[ModuleEntry],
                  imported_at: float) -> set[str]:
    """Plan the module archives, the sha256 each is served and exported against, and their
    version lists; returns the store keys of those the cache already holds. A different
    archive under the same name refuses the bundle."""
    present = set()
    for entry in modules:
        size, sha256 = listed[entry.archive]
        held = target.blob_sha256(entry.archive_key)
        if held == sha256:
            present.add(entry.archive_key)
        elif held is not None:
            raise BundleError(f"{entry.archive}: the cache holds a different module "
                              "archive under this name")
        else:
            target.put_file(staged[entry.archive], entry.archive_key)
        record_key = layout.module_archive_record(entry.module, entry.version)
        if recorded_sha256(target.record(record_key)) != sha256:
            # No identity yet: the first hit reads the archive once against this sha256.
            target.set_record(record_key, {"sha256": sha256, "size": size, "stored_as": None})
        plan_list(target, layout.module_version_list_record(entry.module), [entry.version],
                  str)
        _plan_first_seen(target, entry, imported_at)
    return present


def _plan_first_seen(target: ImportTarget, entry: ModuleEntry, imported_at: float) -> None:
    """The module version's first sighting (the version policy's age of a module): the one
    the bundle carries, else now (the bundle is the first this proxy saw of it); a proxy's
    own earlier one stays."""
    key = layout.sightings_record("module", str(entry.module))
    record = target.planned(key) or target.record(key)
    when = imported_at if entry.first_seen is None else min(entry.first_seen, imported_at)
    target.set_record(key, with_carried(record, {entry.version: when}))


def import_mirror_directory(config: Config, directory: Path) -> Counts:
    """Import what `terraform providers mirror` wrote (see proxy.airgap.mirror_import)."""
    with opened_audit(config) as audit:
        imported, present = import_mirror(config, directory, audit)
    return Counts(imported, 0, present=present)


def split_armored_keys(text: str) -> list[str]:
    """Each armored public key block of a file that may hold several."""
    marker = "-----BEGIN PGP PUBLIC KEY BLOCK-----"
    blocks = [marker + part for part in text.split(marker)[1:]]
    if not blocks:
        raise BundleError("the trusted keys file holds no armored OpenPGP public key")
    return blocks
