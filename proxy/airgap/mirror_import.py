"""Importing a directory that `terraform providers mirror` wrote: HOST/NAMESPACE/TYPE/ with
the zips and a VERSION.json of their hashes. Nothing there is signed, so every zip is checked
against those hashes; nothing is followed (a symbolic link, a FIFO or a device refuses the
directory), each zip is held to upstream.max_archive_size, and the import is all or nothing."""

from __future__ import annotations

import errno
import json
import os
import stat
import zipfile
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from proxy.airgap.import_target import import_target, plan_list
from proxy.airgap.manifest import BundleError
from proxy.airgap.publish import check_room
from proxy.config.settings import Config
from proxy.core.audit import Artifact, AuditLog, local_user
from proxy.core.errors import BadRequest
from proxy.core.models import Platform, ProviderAddress
from proxy.store import layout
from proxy.verification.hashes import h1_of_zip, sha256_of_path
from proxy.verification.packages import VerifiedPackage

_CHUNK = 1 << 20
# A VERSION.json is read into memory; real ones are a few kilobytes.
_MAX_MIRROR_DOCUMENT = 8 << 20


def import_mirror(config: Config, directory: Path, audit: AuditLog) -> tuple[int, int]:
    """Import a mirror directory; returns how many packages were new to the cache, and how
    many it held already. Every zip is checked against the h1 (or zh) hashes its
    VERSION.json lists. Such packages serve the network mirror protocol, not the registry
    protocol (no signatures)."""
    found = _mirror_packages(directory)
    check_room(config.cache.dir, sum(path.lstat().st_size for *_rest, path in found),
               "the directory's packages")
    documents: dict[Path, Any] = {}
    lines: list[tuple[Artifact, str, int, str]] = []  # recorded once the import is applied
    with import_target(config) as target:
        present = 0
        for provider, version, platform, zip_path in found:
            document_path = zip_path.parent / f"{version}.json"
            if document_path not in documents:
                documents[document_path] = _mirror_document(document_path)
            try:
                hashes = set(documents[document_path]["archives"][platform.key]["hashes"])
            except (KeyError, TypeError):
                raise BundleError(f"{document_path}: no hashes for {platform.key}") from None
            copy = target.spool_path()  # check the copy that will be stored, not the source
            _copy_regular(zip_path, copy, config.upstream.max_archive_size)
            try:
                sha, h1 = sha256_of_path(copy), h1_of_zip(copy)
            except (zipfile.BadZipFile, OSError, ValueError):
                raise BundleError(f"{zip_path}: not a valid zip") from None
            if h1 not in hashes and f"zh:{sha}" not in hashes:
                raise BundleError(f"{zip_path}: matches none of the hashes in "
                                  f"{document_path.name}")
            key = layout.package_record(provider, version, platform)
            existing = target.record(key)
            if isinstance(existing, dict) and existing.get("shasum") != sha:
                raise BundleError(f"{zip_path}: the cache holds a different package "
                                  "under this name")
            filename = provider.archive_filename(version, platform)
            archive = layout.provider_archive(provider, version, platform)
            artifact = Artifact.provider(provider, version, platform)
            size = copy.stat().st_size
            if isinstance(existing, dict) and target.blob_sha256(archive) == sha:
                present += 1  # the same package, maybe with more facts: keep those
                lines.append((artifact, "present", size, sha))
                continue
            lines.append((artifact, "ok", size, sha))
            target.put_file(copy, archive)
            if not isinstance(existing, dict):
                target.set_record(key, asdict(VerifiedPackage(filename, sha, h1, size)))
            plan_list(target, layout.version_list_record(provider), [
                {"version": version, "protocols": [], "platforms": [platform.key]}],
                lambda v: v["version"])
        target.apply()
    user = local_user()
    for artifact, outcome, size, sha in lines:
        # Nothing signed these: the hashes in the directory's VERSION.json vouch for them.
        audit.record("imported", artifact, outcome=outcome, user=user,
                     bundle=str(directory), bytes=size, sha256=sha)
    return len(found) - present, present


def _mirror_packages(directory: Path) -> list[tuple[ProviderAddress, str, Platform, Path]]:
    """The packages under HOST/NAMESPACE/TYPE/ of a mirror directory, each once."""
    found: dict[str, Path] = {}
    packages = []
    for zip_path in _mirror_zips(directory):
        host_dir, namespace, type_ = zip_path.relative_to(directory).parts[:3]
        try:
            provider = ProviderAddress.parse(host_dir, namespace, type_)
            version, platform = provider.parse_archive_filename(zip_path.name)
        except BadRequest as exc:
            raise BundleError(f"{zip_path}: {exc.message}") from None
        key = f"{provider}/{version}/{platform.key}"
        if key in found:
            raise BundleError(f"{zip_path}: the same package as {found[key]}")
        found[key] = zip_path
        packages.append((provider, version, platform, zip_path))
    return packages


def _mirror_zips(directory: Path) -> Iterator[Path]:
    """HOST/NAMESPACE/TYPE/terraform-provider-*.zip, in order. Nothing is followed: a
    symbolic link on the way refuses the directory (it could lead anywhere: /dev/zero)."""
    for host in _subdirectories(directory):
        for namespace in _subdirectories(host):
            for type_ in _subdirectories(namespace):
                for path in _listing(type_):
                    if path.name.startswith("terraform-provider-") \
                            and path.name.endswith(".zip"):
                        yield path


def _listing(directory: Path) -> list[Path]:
    with os.scandir(directory) as scan:
        entries = sorted(scan, key=lambda entry: entry.name)
    for entry in entries:
        if entry.is_symlink():
            raise BundleError(f"{entry.path}: a symbolic link (copy what it points to into "
                              "the directory instead)")
    return [Path(entry.path) for entry in entries]


def _subdirectories(directory: Path) -> list[Path]:
    return [path for path in _listing(directory) if path.is_dir()]


def _open_regular(path: Path) -> int:
    """A descriptor of the regular file at path, never through a symbolic link (nor
    blocking on a FIFO)."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise BundleError(f"{path}: a symbolic link") from None
        raise
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
        os.close(descriptor)
        raise BundleError(f"{path}: not a regular file")
    return descriptor


def _copy_regular(source: Path, target: Path, limit: int) -> None:
    """Copy the regular file source to target, refusing it beyond limit bytes."""
    too_large = BundleError(f"{source}: over the {limit}-byte limit "
                            "(upstream.max_archive_size)")
    with os.fdopen(_open_regular(source), "rb") as handle:
        if os.fstat(handle.fileno()).st_size > limit:
            raise too_large
        try:
            out = open(target, "wb")
        except OSError as exc:
            raise BundleError(f"cannot write to the cache's temp area ({exc.strerror})") \
                from None
        with out:
            copied = 0
            while chunk := handle.read(_CHUNK):
                copied += len(chunk)
                if copied > limit:  # it grew while being copied
                    raise too_large
                try:
                    out.write(chunk)
                except OSError as exc:
                    raise BundleError(f"{source}: cannot copy it into the cache's temp "
                                      f"area ({exc.strerror})") from None


def _mirror_document(path: Path) -> Any:
    """A VERSION.json, parsed (BundleError: missing, too large, not JSON)."""
    try:
        with os.fdopen(_open_regular(path), "rb") as handle:
            data = handle.read(_MAX_MIRROR_DOCUMENT + 1)
    except FileNotFoundError:
        raise BundleError(f"{path}: missing") from None
    if len(data) > _MAX_MIRROR_DOCUMENT:
        raise BundleError(f"{path}: over {_MAX_MIRROR_DOCUMENT} bytes")
    try:
        return json.loads(data)
    except ValueError:
        raise BundleError(f"{path}: not JSON") from None
