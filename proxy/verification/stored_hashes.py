"""Checks of stored files against the sha256 they were stored with, and the h1 of a stored
package, computed only from bytes that match the signed checksum: a file damaged on disk must
never give its wrong hash to a lock file, nor be served as the package."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, TypeVar

from proxy.core.errors import IntegrityError
from proxy.core.executors import slow
from proxy.core.singleflight import SingleFlight
from proxy.store.file_identity import FileIdentity, identity_of
from proxy.verification.hashes import h1_of_zip, sha256_of_file

log = logging.getLogger(__name__)
T = TypeVar("T")


class DamagedFile(IntegrityError):
    """A stored file whose bytes are not the signed package, or cannot be read: it must be
    dropped and fetched again."""

    def __init__(self, message: str, identity: FileIdentity | None) -> None:
        super().__init__("stored", message)
        self.identity = identity  # of the file that was read, if known


async def h1_of_stored(path: Path, sha256: str) -> str | None:
    """The h1 of a stored package, computed only from bytes whose sha256 is the signed one
    (a full read, off the loop). None when the file is gone, or when it is the signed package
    but not a zip that can be hashed (fetching it again would not change that). Raises
    DamagedFile when the stored bytes are not the signed ones or cannot be read."""
    return await slow(_checked_read, path, sha256, _h1_of_checked)


async def verify_stored(path: Path, sha256: str) -> FileIdentity | None:
    """The identity of a stored file whose bytes have the sha256 it was stored with (a full
    read, off the loop); None when the file is gone. Raises DamagedFile when the bytes differ,
    cannot be read, or change while they are read."""
    return await slow(_checked_read, path, sha256, _unchanged_identity)


async def adopt_stored(path: Path, intact: Callable[[BinaryIO], None]
                       ) -> tuple[str, FileIdentity] | None:
    """The sha256 and identity of a stored file that no recorded sha256 vouches for (stored
    before they were recorded), if `intact` accepts its bytes (it raises ValueError if not); a
    full read, off the loop. None when the file is gone. Raises DamagedFile when it is not
    intact, cannot be read, or changes while it is read."""
    return await slow(_adopted, path, intact)


def fingerprint(path: Path) -> tuple[str, FileIdentity]:
    """The sha256 and identity of a file about to be stored (blocking: a full read)."""
    with open(path, "rb") as handle:
        identity = identity_of(os.fstat(handle.fileno()))
        return sha256_of_file(handle), identity


class CheckedFiles:
    """The stored files this process has seen match their recorded sha256, by identity: a
    hit on an unchanged file costs a stat; a changed one is read again once, however many
    requests ask for it meanwhile."""

    def __init__(self) -> None:
        self._seen: dict[Path, FileIdentity] = {}
        self._checks: SingleFlight[FileIdentity | None] = SingleFlight()

    def seen(self, path: Path, identity: FileIdentity) -> bool:
        """Whether this very file was checked (or published) by this process."""
        return self._seen.get(path) == identity

    def remember(self, path: Path, identity: FileIdentity) -> None:
        """The file with this identity holds the bytes it was stored with."""
        self._seen[path] = identity

    def forget(self, path: Path) -> None:
        """The file was dropped (or is being replaced)."""
        self._seen.pop(path, None)

    async def verify(self, path: Path, identity: FileIdentity,
                     sha256: str) -> FileIdentity | None:
        """verify_stored, shared by concurrent callers; remembered when the bytes match (a
        caller that comes after that is answered from memory)."""
        if self.seen(path, identity):
            return identity
        return await self._checks.run((path, identity, sha256),
                                      lambda: self._verify(path, sha256))

    async def _verify(self, path: Path, sha256: str) -> FileIdentity | None:
        checked = await verify_stored(path, sha256)
        if checked is not None:  # before the run ends: no caller finds neither
            self.remember(path, checked)
        return checked

    async def close(self) -> None:
        """Stop checks under way (shutdown)."""
        await self._checks.cancel_all()


def _open_stored(path: Path) -> BinaryIO | None:
    try:
        return open(path, "rb")
    except FileNotFoundError:
        return None  # evicted meanwhile: nothing to check, nothing to drop
    except OSError as exc:
        raise DamagedFile(f"cannot be opened ({exc.strerror or exc})",
                          _identity_of(path)) from None


def _hashed_read(path: Path, then: Callable[[Path, BinaryIO, FileIdentity, str], T]) -> T | None:
    """Open the stored file, hash its bytes, rewind, then hand the same open file (the bytes
    just hashed), its identity and their sha256 to `then`. None when the file is gone."""
    handle = _open_stored(path)
    if handle is None:
        return None
    with handle:
        before = identity_of(os.fstat(handle.fileno()))
        with _read_errors_are_damage(before):
            actual = sha256_of_file(handle)
            handle.seek(0)
        return then(path, handle, before, actual)


def _checked_read(path: Path, sha256: str,
                  then: Callable[[Path, BinaryIO, FileIdentity], T]) -> T | None:
    """Check the file's bytes against sha256, then hand the open file to `then`."""
    def checked(path: Path, handle: BinaryIO, before: FileIdentity, actual: str) -> T:
        if actual != sha256.lower():
            raise DamagedFile(f"has sha256 {actual}, not the checksum {sha256} it was "
                              "stored with", before)
        return then(path, handle, before)
    return _hashed_read(path, checked)


def _adopted(path: Path, intact: Callable[[BinaryIO], None]
             ) -> tuple[str, FileIdentity] | None:
    def adopt(path: Path, handle: BinaryIO, before: FileIdentity,
              actual: str) -> tuple[str, FileIdentity]:
        with _read_errors_are_damage(before):
            try:
                intact(handle)
            except ValueError as exc:
                raise DamagedFile(f"is damaged: {exc}", before) from None
        return actual, _unchanged_identity(path, handle, before)
    return _hashed_read(path, adopt)


def _unchanged_identity(_path: Path, handle: BinaryIO, before: FileIdentity) -> FileIdentity:
    # Written to while it was read: what was hashed may not be what is there now.
    if identity_of(os.fstat(handle.fileno())) != before:
        raise DamagedFile("changed while it was checked", before)
    return before


def _h1_of_checked(path: Path, handle: BinaryIO, before: FileIdentity) -> str | None:
    with _read_errors_are_damage(before):
        try:
            # The same open file: what is unzipped is what was just checked.
            return h1_of_zip(handle)
        except OSError:
            raise
        except Exception as exc:  # zipfile raises many kinds of error on bad zips
            log.warning("%s matches its signed checksum, but its h1 cannot be computed: %s",
                        path, exc)
            return None


@contextmanager
def _read_errors_are_damage(identity: FileIdentity) -> Iterator[None]:
    try:
        yield
    except OSError as exc:
        raise DamagedFile(f"cannot be read ({exc.strerror or exc})", identity) from None


def _identity_of(path: Path) -> FileIdentity | None:
    try:
        return identity_of(path.stat())
    except OSError:
        return None
