"""Package hashes as Terraform writes them: `zh:` (sha256 of the zip) and `h1:` (dirhash)."""

from __future__ import annotations

import base64
import hashlib
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

_CHUNK = 1 << 20


def zh_hash(sha256_hex: str) -> str:
    """The `zh:` form of a zip's sha256 (the registry's `shasum`)."""
    return f"zh:{sha256_hex.lower()}"


def h1_from_entries(entries: Iterable[tuple[str, bytes]]) -> str:
    """Go's dirhash Hash1 over (name, content) pairs: a sha256 over sorted
    `hex(sha256(content))  name\\n` lines, base64-encoded."""
    return _h1_from_digests(
        (name, hashlib.sha256(content).hexdigest()) for name, content in entries)


def _h1_from_digests(digests: Iterable[tuple[str, str]]) -> str:
    lines = []
    for name, digest in digests:
        if "\n" in name:
            raise ValueError(f"file name with newline: {name!r}")
        lines.append((name.encode("utf-8"), digest))
    summary = hashlib.sha256()
    # Go sorts the names as byte strings.
    for name_bytes, digest in sorted(lines):
        summary.update(f"{digest}  ".encode() + name_bytes + b"\n")
    return "h1:" + base64.b64encode(summary.digest()).decode("ascii")


def h1_of_zip(source: Path | BinaryIO) -> str:
    """The `h1:` hash of a provider zip (a path or an open file): every entry counts,
    directory entries too (Terraform hashes the zip's entry list, not the unpacked tree)."""
    with zipfile.ZipFile(source) as archive:
        return _h1_from_digests(_zip_entry_digests(archive))


def sha256_of_file(handle: BinaryIO) -> str:
    """The hex sha256 of everything from the file's current position to its end."""
    digest = hashlib.sha256()
    while chunk := handle.read(_CHUNK):
        digest.update(chunk)
    return digest.hexdigest()


def sha256_of_path(path: Path) -> str:
    """The hex sha256 of the file at path."""
    with open(path, "rb") as handle:
        return sha256_of_file(handle)


def _zip_entry_digests(archive: zipfile.ZipFile) -> Iterable[tuple[str, str]]:
    # Streamed entry by entry: provider binaries run to hundreds of megabytes.
    for info in archive.infolist():
        digest = hashlib.sha256()
        if not info.is_dir():
            with archive.open(info) as member:
                while chunk := member.read(_CHUNK):
                    digest.update(chunk)
        yield info.filename, digest.hexdigest()
