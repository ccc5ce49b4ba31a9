"""The bundle manifest: it lists every member of a bundle with its size and sha256, and its
detached OpenPGP signature (SIGNATURE) covers its exact bytes, so that a verified signature
vouches for every member. Reading checks the signature first, then that the tar holds
exactly the listed members, before anything is copied out."""

from __future__ import annotations

import hashlib
import json
import posixpath
import re
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pysequoia

from proxy.airgap.signing import SigningError, verify_manifest

# 2: files list size and sha256; the manifest may be signed (SIGNATURE).
FORMAT = 2
MANIFEST = "manifest.json"
SIGNATURE = "manifest.json.sig"
_SHA256 = re.compile(r"[0-9a-f]{64}")
_CHUNK = 1 << 20
# The manifest and its signature are read into memory; real ones are far smaller.
_MAX_MANIFEST = 64 << 20
# Every member's header is held until the manifest (written last) is read: bound them. A
# bundle from `export` holds at most three members a package, one a module archive.
MAX_MEMBERS = 100_000
_BLOCK = tarfile.BLOCKSIZE
_EXTENSIONS = (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE,
               tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK)
_MAX_EXTENSION = 1 << 20
# What compressed files start with: `export` writes a plain tar, and a compressed stream
# costs memory and time to scan before any signature can be checked.
_COMPRESSED = ((b"\x1f\x8b", "gzip"), (b"BZh", "bzip2"), (b"\xfd7zXZ\x00", "xz"),
               (b"\x28\xb5\x2f\xfd", "zstd"))


class BundleError(Exception):
    """A bundle that cannot be written, read or trusted."""


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
    releases: int = 0  # CLI release archives


def file_entry(size: int, sha256: str) -> dict[str, Any]:
    """What the manifest lists for one member."""
    return {"size": size, "sha256": sha256}


def _safe_member(name: str) -> str:
    """The member's name without "./" and doubled slashes; BundleError for one that could
    point outside the bundle's tree or mislead a reader (absolute, "..", backslashes, control
    characters: names end up in messages on the operator's terminal)."""
    parts = name.split("/")
    normalized = posixpath.normpath(name)
    if not name or name.startswith("/") or ".." in parts or "\\" in name \
            or not name.isprintable() or normalized in (".", ""):
        raise BundleError(f"unsafe member name {name[:200]!r}")
    return normalized


def _kind(member: tarfile.TarInfo) -> str:
    """What a tar member is, when it is not a plain file."""
    if member.issym():
        return f"a symbolic link (to {member.linkname[:200]!r})"
    if member.islnk():
        return f"a hard link (to {member.linkname[:200]!r})"
    if member.isfifo():
        return "a FIFO"
    if member.ischr() or member.isblk():
        return "a device"
    if member.issparse():
        return "a sparse file"
    return f"of tar type {member.type!r}"


class _BoundedTarInfo(tarfile.TarInfo):
    """A tar header whose extension records (pax headers, GNU long names) are small: tarfile
    reads those into memory whole."""

    @classmethod
    def fromtarfile(cls, source: tarfile.TarFile) -> _BoundedTarInfo:
        """The next header, refused if it announces an extension record too large."""
        start = source.fileobj.tell()
        block = source.fileobj.read(_BLOCK)
        source.fileobj.seek(start)
        try:
            header = cls.frombuf(block, source.encoding, source.errors)
        except tarfile.HeaderError:
            header = None  # the stock parser below raises what tarfile expects
        if header is not None and header.type in _EXTENSIONS and header.size > _MAX_EXTENSION:
            raise BundleError(f"a tar extension header of {header.size} bytes at offset "
                              f"{start}: not a bundle from `export`")
        return super().fromtarfile(source)


def open_bundle(path: Path) -> tarfile.TarFile:
    """The bundle as a plain (uncompressed) tar, as `export` writes it."""
    try:
        with open(path, "rb") as handle:
            start = handle.read(8)
    except OSError as exc:
        raise BundleError(f"not a readable tar bundle: {exc.strerror}") from None
    for magic, kind in _COMPRESSED:
        if start.startswith(magic):
            raise BundleError(f"a {kind}-compressed file: import takes the plain tar that "
                              "`export` writes (decompress it first)")
    try:
        return tarfile.open(path, "r:", tarinfo=_BoundedTarInfo)
    except (OSError, tarfile.TarError) as exc:
        raise BundleError(f"not a readable tar bundle: {exc}") from None


def members_of(tar: tarfile.TarFile) -> dict[str, tarfile.TarInfo]:
    """The bundle's files by normalized name ("./x" from a repacked tar is "x"); links,
    devices, a name given twice and more than MAX_MEMBERS members refuse the bundle."""
    members: dict[str, tarfile.TarInfo] = {}
    count = 0
    while (member := tar.next()) is not None:
        count += 1  # headers are read one at a time: stop early on a flood of them
        if count > MAX_MEMBERS:
            raise BundleError(f"more than {MAX_MEMBERS} members: not a bundle from `export`")
        if member.isdir():
            continue  # repacked bundles may carry directory entries
        name = _safe_member(member.name)
        if not member.isfile() or member.issparse():
            raise BundleError(f"{name}: {_kind(member)}, not a regular file")
        if name in members:
            raise BundleError(f"{name}: appears twice in the bundle (as "
                              f"{members[name].name!r} and {member.name!r})")
        members[name] = member
    return members


def read_small(tar: tarfile.TarFile, members: dict[str, tarfile.TarInfo], name: str) -> bytes:
    """The bytes of the manifest or its signature."""
    member = members.get(name)
    if member is None or member.size > _MAX_MANIFEST:
        raise BundleError(f"{name} is missing or too large: not a bundle from `export`")
    source = tar.extractfile(member)
    assert source is not None
    return source.read()


def check_signature(manifest_bytes: bytes, tar: tarfile.TarFile,
                    members: dict[str, tarfile.TarInfo],
                    bundle_keys: Sequence[pysequoia.Cert]) -> str:
    """The fingerprint of the bundle key that signed the manifest; BundleError otherwise."""
    if SIGNATURE not in members:
        raise BundleError(f"{SIGNATURE}: missing, the bundle is not signed (export it with "
                          "--signing-key; or, only if it came over a path you trust, "
                          "import it with --allow-unsigned)")
    try:
        return verify_manifest(manifest_bytes, read_small(tar, members, SIGNATURE),
                               bundle_keys)
    except SigningError as exc:
        raise BundleError(f"{SIGNATURE}: {exc}") from None


def parse_manifest(data: bytes) -> tuple[dict[str, Any], dict[str, tuple[int, str]]]:
    """The manifest, and the size and sha256 it lists for each member."""
    try:
        manifest = json.loads(data)
    except ValueError:
        manifest = None
    if isinstance(manifest, dict) and manifest.get("format") == 1:
        raise BundleError(f"{MANIFEST}: bundle format 1 (unsigned, from an earlier version): "
                          "export it again with this version")
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise BundleError(f"{MANIFEST} is not a bundle manifest")
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise BundleError(f"{MANIFEST}: files is not a table")
    listed: dict[str, tuple[int, str]] = {}
    for name, fact in files.items():
        size = fact.get("size") if isinstance(fact, dict) else None
        sha = fact.get("sha256") if isinstance(fact, dict) else None
        if not isinstance(size, int) or isinstance(size, bool) or size < 0 \
                or not isinstance(sha, str) or not _SHA256.fullmatch(sha):
            raise BundleError(f"{MANIFEST}: {name[:200]!r} has no valid size and sha256")
        if _safe_member(name) != name or name in (MANIFEST, SIGNATURE):
            raise BundleError(f"{MANIFEST}: {name[:200]!r} is not a valid member name")
        listed[name] = (size, sha)
    return manifest, listed


def check_members(listed: dict[str, tuple[int, str]], members: dict[str, tarfile.TarInfo],
                  max_member: int) -> None:
    """The tar holds exactly the members the manifest lists, each of the listed size."""
    for name, member in members.items():
        if name in (MANIFEST, SIGNATURE):
            continue
        if name not in listed:
            raise BundleError(f"{name}: not listed in the manifest")
        if member.size != listed[name][0]:
            raise BundleError(f"{name}: {member.size} bytes, the manifest says "
                              f"{listed[name][0]}")
        if member.size > max_member:
            raise BundleError(f"{name}: {member.size} bytes, over the {max_member}-byte "
                              "limit (upstream.max_archive_size)")
    missing = sorted(set(listed) - set(members))
    if missing:
        raise BundleError(f"{missing[0]}: listed in the manifest but missing from the bundle")


def stage(tar: tarfile.TarFile, members: dict[str, tarfile.TarInfo],
          listed: dict[str, tuple[int, str]], staging: Path) -> dict[str, Path]:
    """Copy every listed member out (never tar.extractall), checking its sha256."""
    staged: dict[str, Path] = {}
    for name, (_size, sha) in listed.items():
        target = staging / hashlib.sha256(name.encode()).hexdigest()
        source = tar.extractfile(members[name])
        assert source is not None
        digest = hashlib.sha256()
        try:
            with open(target, "wb") as handle:
                while chunk := source.read(_CHUNK):
                    digest.update(chunk)
                    handle.write(chunk)
        except OSError as exc:
            raise BundleError(f"{name}: cannot copy it out into the cache's temp area "
                              f"({exc.strerror or exc})") from None
        if digest.hexdigest() != sha:
            raise BundleError(f"{name}: sha256 does not match the manifest")
        staged[name] = target
    return staged
