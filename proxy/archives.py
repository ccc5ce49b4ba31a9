"""Artifact file store: a file is written to a temp file under `<cache>/tmp` and renamed into
place only once verified, so a partial or corrupt file is never visible. Work directories for
building module archives live under `<cache>/tmp` too; all of it is swept at start-up."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import shutil
import tempfile
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
    """A verified provider package on disk."""

    path: Path
    size: int
    sha256: str
    h1: str


class ArchiveStore:
    """Provider packages under `<cache>/archives/...`, modules under `<cache>/modules/...`."""

    def __init__(self, cache_dir: Path) -> None:
        self.cache_dir = cache_dir
        self.tmp = cache_dir / "tmp"
        self.tmp.mkdir(parents=True, exist_ok=True)

    def sweep_temp(self) -> int:
        """Delete leftovers of fills that never finished (a crash); returns how many."""
        removed = 0
        for leftover in self.tmp.iterdir():
            if leftover.is_dir() and not leftover.is_symlink():
                shutil.rmtree(leftover, ignore_errors=True)
            else:
                leftover.unlink(missing_ok=True)
            removed += 1
        return removed

    def path_for(self, parts: Sequence[str]) -> Path:
        """Where the file named by already-validated parts lives (first part: the area,
        `archives` or `modules`)."""
        if not parts or any(p in ("", ".", "..") or "/" in p or "\\" in p or "\0" in p
                            for p in parts):
            raise ValueError(f"unsafe artifact path {parts!r}")
        path = self.cache_dir.joinpath(*parts)
        if not path.resolve().is_relative_to(self.cache_dir.resolve()):
            raise ValueError(f"unsafe artifact path {parts!r}")
        return path

    async def lookup(self, parts: Sequence[str]) -> Path | None:
        """The stored file, if present."""
        path = self.path_for(parts)
        return path if await aiofiles.os.path.isfile(path) else None

    def temp_file(self) -> Path:
        """A fresh temp file name (not created)."""
        return self.tmp / f"{uuid.uuid4().hex}.part"

    def work_dir(self) -> Path:
        """A fresh, empty work directory; the caller removes it (or the next start does)."""
        return Path(tempfile.mkdtemp(prefix="work-", dir=self.tmp))

    async def publish(self, temp: Path, parts: Sequence[str]) -> Path:
        """Move a finished temp file into place atomically."""
        final = self.path_for(parts)
        await asyncio.to_thread(final.parent.mkdir, parents=True, exist_ok=True)
        await aiofiles.os.replace(temp, final)
        return final

    async def store(self, parts: Sequence[str], chunks: AsyncIterator[bytes],
                    expected_sha256: str) -> StoredArchive:
        """Write a provider zip to a temp file, check sha256 and that it is a zip, publish."""
        temp = self.temp_file()
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
            final = await self.publish(temp, parts)
        except BaseException:
            # Synchronous on purpose: this also runs when the fill is cancelled.
            temp.unlink(missing_ok=True)
            raise
        return StoredArchive(final, size, actual, h1)
