"""Package file store: a download streams into a temp file while it is hashed, and only a
verified file is renamed into place, so a partial or corrupt file is never visible."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import uuid
import zipfile
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import aiofiles
import aiofiles.os

from proxy.errors import IntegrityError
from proxy.hashes import h1_of_zip

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoredArchive:
    """A verified package on disk."""

    path: Path
    size: int
    sha256: str
    h1: str


class ArchiveStore:
    """Files under `<cache>/archives/...`, temp files under `<cache>/tmp`."""

    def __init__(self, cache_dir: Path) -> None:
        self.root = cache_dir / "archives"
        self.tmp = cache_dir / "tmp"
        self.root.mkdir(parents=True, exist_ok=True)
        self.tmp.mkdir(parents=True, exist_ok=True)

    def sweep_temp(self) -> int:
        """Delete leftovers of fills that never finished (a crash); returns how many."""
        removed = 0
        for leftover in self.tmp.iterdir():
            leftover.unlink(missing_ok=True)
            removed += 1
        return removed

    def path_for(self, parts: Sequence[str]) -> Path:
        """Where the file named by already-validated parts lives."""
        path = self.root.joinpath(*parts)
        if any(p in ("", ".", "..") or "/" in p or "\\" in p for p in parts) \
                or not path.resolve().is_relative_to(self.root.resolve()):
            raise ValueError(f"unsafe archive path {parts!r}")
        return path

    async def lookup(self, parts: Sequence[str]) -> Path | None:
        """The stored file, if present."""
        path = self.path_for(parts)
        return path if await aiofiles.os.path.isfile(path) else None

    async def store(self, parts: Sequence[str], chunks: AsyncIterator[bytes],
                    expected_sha256: str) -> StoredArchive:
        """Write chunks to a temp file, check sha256 and that it is a zip, then publish."""
        final = self.path_for(parts)
        temp = self.tmp / f"{uuid.uuid4().hex}.part"
        digest = hashlib.sha256()
        size = 0
        try:
            async with aiofiles.open(temp, "wb") as handle:
                async for chunk in chunks:
                    digest.update(chunk)
                    size += len(chunk)
                    await handle.write(chunk)
                await handle.flush()
                await asyncio.to_thread(os.fsync, handle.fileno())
            actual = digest.hexdigest()
            if actual != expected_sha256:
                raise IntegrityError("checksum", f"package sha256 {actual} does not match the "
                                     f"signed checksum {expected_sha256}")
            try:
                h1 = await asyncio.to_thread(h1_of_zip, temp)
            except (zipfile.BadZipFile, ValueError, OSError) as exc:
                raise IntegrityError("archive", f"package is not a valid zip: {exc}") from None
            await asyncio.to_thread(final.parent.mkdir, parents=True, exist_ok=True)
            await aiofiles.os.replace(temp, final)
        except BaseException:
            # Synchronous on purpose: this also runs when the fill is cancelled.
            temp.unlink(missing_ok=True)
            raise
        return StoredArchive(final, size, actual, h1)
