"""Checks of stored blobs against the sha256 they were stored with, and the h1 of a stored
package, computed only from bytes that match the signed checksum: a file damaged on disk must
never give its wrong hash to a lock file, nor be served as the package."""

from __future__ import annotations

import logging
import lzma
import os
import struct
import zipfile
import zlib
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, TypeVar

from proxy.core.executors import background_then_close, slow_then_close
from proxy.core.singleflight import SingleFlight
from proxy.store.damage import DamagedFile
from proxy.store.file_identity import FileIdentity, identity_of
from proxy.store.protocol import BlobInfo, BlobStore, OpenBlob
from proxy.verification.hashes import h1_of_zip, sha256_of_file

log = logging.getLogger(__name__)
T = TypeVar("T")


async def h1_of_stored(store: BlobStore, key: str, sha256: str, use: bool = True,
                       shared: bool = False) -> str | None:
    """The h1 of a stored package, computed only from bytes whose sha256 is the signed one
    (a full read, off the loop; a use of the blob unless use is False). None when the blob
    is gone, or when it is the signed package but not a zip that can be hashed (fetching it
    again would not change that). Raises DamagedFile when the stored bytes are not the
    signed ones or cannot be read."""
    return await _with_open(store, key, lambda blob: _checked_read(blob, sha256, _h1_of_checked),
                            use=use, shared=shared)


async def h1_of_written(store: BlobStore, key: str, sha256: str,
                        written: FileIdentity) -> str | None:
    """h1_of_stored for a package the caller just wrote and hashed as the file `written` (a
    fill): while the stored file is still that very file (the same identity: nothing wrote to
    it since), its bytes are the ones hashed, and are not read twice; otherwise as
    h1_of_stored. At the lowest CPU priority: no client waits for it, and it must not slow
    the clients still downloading the package."""
    return await _with_open(store, key, lambda blob: _h1_of_written(blob, sha256, written),
                            background_then_close)


async def verify_stored(store: BlobStore, key: str, sha256: str,
                        use: bool = True, shared: bool = False) -> FileIdentity | None:
    """The identity of a stored blob whose bytes have the sha256 it was stored with (a full
    read, off the loop; a use of the blob unless use is False); None when the blob is gone.
    Raises DamagedFile when the bytes differ, cannot be read, or change while they are
    read."""
    return await _with_open(store, key,
                            lambda blob: _checked_read(blob, sha256, _unchanged_identity),
                            use=use, shared=shared)


async def adopt_stored(store: BlobStore, key: str, intact: Callable[[BinaryIO], None]
                       ) -> tuple[str, FileIdentity] | None:
    """The sha256 and identity of a stored blob that no recorded sha256 vouches for (stored
    before they were recorded), if `intact` accepts its bytes (it raises ValueError if not); a
    full read, off the loop. None when the blob is gone. Raises DamagedFile when it is not
    intact, cannot be read, or changes while it is read."""
    return await _with_open(store, key, lambda blob: _adopted(blob, intact))


def fingerprint(path: Path) -> tuple[str, FileIdentity]:
    """The sha256 and identity of a file about to be stored (blocking: a full read)."""
    with open(path, "rb") as handle:
        identity = identity_of(os.fstat(handle.fileno()))
        return sha256_of_file(handle), identity


@dataclass(frozen=True)
class Vouch:
    """What the record of a stored blob says: the sha256 its bytes were stored with (None: not
    recorded) and the identity of the file seen to hold them (None: not recorded)."""

    sha256: str | None
    stored_as: FileIdentity | None


# What a caller's record does for CheckedFiles.vouched: read it, note a re-checked file in it,
# drop a damaged file, adopt a file stored with no sha256.
ReadRecord = Callable[[BlobInfo], Awaitable[Vouch | None]]
NoteChecked = Callable[[str, FileIdentity], Awaitable[None]]
DropDamaged = Callable[[DamagedFile], Awaitable[None]]
Adopt = Callable[[], Awaitable[tuple[str, FileIdentity] | None]]


class CheckedFiles:
    """The stored blobs this process has seen match their recorded sha256, by identity: a
    hit on an unchanged blob costs a stat; a changed one is read again once, however many
    requests ask for it meanwhile."""

    def __init__(self, store: BlobStore) -> None:
        self._store = store
        self._seen: dict[str, FileIdentity] = {}
        self._checks: SingleFlight[FileIdentity | None] = SingleFlight()

    def seen(self, key: str, identity: FileIdentity) -> bool:
        """Whether this very blob was checked (or published) by this process."""
        return self._seen.get(key) == identity

    def remember(self, key: str, identity: FileIdentity) -> None:
        """The blob with this identity holds the bytes it was stored with."""
        self._seen[key] = identity

    def forget(self, key: str) -> None:
        """The blob was dropped (or is being replaced)."""
        self._seen.pop(key, None)

    async def verify(self, key: str, identity: FileIdentity,
                     sha256: str) -> FileIdentity | None:
        """verify_stored, shared by concurrent callers; remembered when the bytes match (a
        caller that comes after that is answered from memory)."""
        if self.seen(key, identity):
            return identity
        return await self._checks.run((key, identity, sha256),
                                      lambda: self._verify(key, sha256))

    async def vouched(self, key: str, *, record: ReadRecord, checked: NoteChecked,
                      damaged: DropDamaged, adopt: Adopt | None = None,
                      check: bool = True) -> BlobInfo | None:
        """The stored blob at key while its record vouches for this very file. One written to
        since is read again first (check; without it, under the fill lock, it is just not
        used): still the recorded sha256, `checked` notes its new identity; not, `damaged`
        drops it. A record without a sha256: `adopt` reads the blob (stored before sha256s
        were recorded). `record` answers None: nothing vouches for the blob."""
        found = await self._store.stat(key)
        if found is None:
            return None
        identity = found.identity
        if self.seen(key, identity):  # the common hit: one stat, no index read
            return found
        vouch = await record(found)
        if vouch is None:
            return None
        if vouch.sha256 is not None and vouch.stored_as == identity:
            self.remember(key, identity)
            return found
        if not check:
            return None
        try:
            read = await self._read_again(key, identity, vouch.sha256, adopt)
        except DamagedFile as damage:
            await damaged(damage)
            return None
        if read is None:
            return None  # gone meanwhile
        self.remember(key, read[1])
        await checked(*read)
        return found

    async def _read_again(self, key: str, identity: FileIdentity, sha256: str | None,
                          adopt: Adopt | None) -> tuple[str, FileIdentity] | None:
        """The sha256 and identity of a stored blob that matches its record, or that `adopt`
        accepts when it has none; None when it is gone. Raises DamagedFile."""
        if sha256 is not None:
            checked = await self.verify(key, identity, sha256)
            return None if checked is None else (sha256, checked)
        return None if adopt is None else await adopt()

    async def _verify(self, key: str, sha256: str) -> FileIdentity | None:
        checked = await verify_stored(self._store, key, sha256)
        if checked is not None:  # before the run ends: no caller finds neither
            self.remember(key, checked)
        return checked

    async def close(self) -> None:
        """Stop checks under way (shutdown)."""
        await self._checks.cancel_all()


async def _with_open(store: BlobStore, key: str, read: Callable[[OpenBlob], T],
                     run: Callable[[OpenBlob, Callable[[OpenBlob], T], OpenBlob], Awaitable[T]]
                     = slow_then_close, use: bool = True, shared: bool = False) -> T | None:
    """read(the open blob) on the slow pool (or as `run` says), the blob closed once read is
    done with it (not before, even if the caller is cancelled meanwhile); None when the blob
    is gone. shared: the blob as the shared store holds it, not a local copy (no use)."""
    try:
        blob = await (store.open_shared(key) if shared else store.open(key, use))
    except FileNotFoundError:
        return None
    except OSError as exc:
        info = await _stat_quietly(store, key)
        raise DamagedFile(f"cannot be opened ({exc.strerror or exc})",
                          None if info is None else info.identity) from None
    if blob is None:
        return None  # evicted meanwhile: nothing to check, nothing to drop
    return await run(blob, read, blob)


def _hashed_read(blob: OpenBlob, then: Callable[[OpenBlob, BinaryIO, FileIdentity, str], T]) -> T:
    """Hash the open blob's bytes, rewind, then hand the same open file (the bytes just
    hashed), its identity and their sha256 to `then`."""
    before = blob.info.identity
    with _read_errors_are_damage(before):
        handle = blob.file()
        actual = sha256_of_file(handle)
        handle.seek(0)
    return then(blob, handle, before, actual)


def _checked_read(blob: OpenBlob, sha256: str,
                  then: Callable[[OpenBlob, BinaryIO, FileIdentity], T]) -> T:
    """Check the blob's bytes against sha256, then hand the open file to `then`."""
    def checked(blob: OpenBlob, handle: BinaryIO, before: FileIdentity, actual: str) -> T:
        if actual != sha256.lower():
            raise DamagedFile(f"has sha256 {actual}, not the checksum {sha256} it was "
                              "stored with", before, actual, sha256.lower())
        return then(blob, handle, before)
    return _hashed_read(blob, checked)


def _adopted(blob: OpenBlob, intact: Callable[[BinaryIO], None]) -> tuple[str, FileIdentity]:
    def adopt(blob: OpenBlob, handle: BinaryIO, before: FileIdentity,
              actual: str) -> tuple[str, FileIdentity]:
        with _read_errors_are_damage(before):
            try:
                intact(handle)
            except ValueError as exc:
                raise DamagedFile(f"is damaged: {exc}", before) from None
        return actual, _unchanged_identity(blob, handle, before)
    return _hashed_read(blob, adopt)


def _h1_of_written(blob: OpenBlob, sha256: str, written: FileIdentity) -> str | None:
    if blob.local_path is None:  # not a local file: no identity to trust, check the bytes
        return _checked_read(blob, sha256, _h1_of_checked)
    with _read_errors_are_damage(written):
        handle = blob.file()
        # The file's own identity (a local copy of a remote blob is described as the blob).
        if identity_of(os.fstat(handle.fileno())) != written:
            return _checked_read(blob, sha256, _h1_of_checked)
    h1 = _h1_of_checked(blob, handle, written)
    with _read_errors_are_damage(written):
        if identity_of(os.fstat(handle.fileno())) != written:
            raise DamagedFile("changed while its h1 was computed", written)
    return h1


def _unchanged_identity(blob: OpenBlob, _handle: BinaryIO, before: FileIdentity) -> FileIdentity:
    # Written to while it was read: what was hashed may not be what is there now.
    if blob.current_identity() != before:
        raise DamagedFile("changed while it was checked", before)
    return before


# What reading a zip that is not a good one raises: zipfile's own errors, NotImplementedError
# (a compression or an encryption it lacks), the decompressors' errors, EOFError (a member cut
# short), KeyError, struct.error and UnicodeDecodeError (mangled headers and names), and
# ValueError (h1 refuses a name; a corrupt offset seeks before the start). Not OSError: an
# unreadable file is damage. Any other error is a fault of ours, not the zip's.
_BAD_ZIP = (zipfile.BadZipFile, zipfile.LargeZipFile, NotImplementedError, zlib.error,
            lzma.LZMAError, EOFError, KeyError, struct.error, UnicodeDecodeError, ValueError)


def _h1_of_checked(blob: OpenBlob, handle: BinaryIO, before: FileIdentity) -> str | None:
    with _read_errors_are_damage(before):
        try:
            # The same open file: what is unzipped is what was just checked.
            return h1_of_zip(handle)
        except _BAD_ZIP as exc:
            if handle.closed:  # a ValueError for reading a closed file: ours, not the zip's
                raise
            log.warning("%s matches its signed checksum, but its h1 cannot be computed: %s",
                        blob.info.key, exc)
            return None


@contextmanager
def _read_errors_are_damage(identity: FileIdentity) -> Iterator[None]:
    try:
        yield
    except OSError as exc:
        raise DamagedFile(f"cannot be read ({exc.strerror or exc})", identity) from None


async def _stat_quietly(store: BlobStore, key: str) -> BlobInfo | None:
    try:
        return await store.stat(key)
    except OSError:
        return None
