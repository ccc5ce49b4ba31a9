"""The h1 of a stored package, computed only from bytes that match the signed checksum: a file
damaged on disk must never give its wrong hash to a lock file."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from proxy.errors import IntegrityError
from proxy.executors import slow
from proxy.hashes import h1_of_zip, sha256_of_file

log = logging.getLogger(__name__)


class DamagedFile(IntegrityError):
    """A stored file whose bytes are not the signed package, or cannot be read: it must be
    dropped and fetched again."""

    def __init__(self, message: str, identity: tuple[int, int] | None) -> None:
        super().__init__("stored", message)
        self.identity = identity  # (st_dev, st_ino) of the file that was read, if known


async def h1_of_stored(path: Path, sha256: str) -> str | None:
    """The h1 of a stored package, computed only from bytes whose sha256 is the signed one
    (a full read, off the loop). None when the file is gone, or when it is the signed package
    but not a zip that can be hashed (fetching it again would not change that). Raises
    DamagedFile when the stored bytes are not the signed ones or cannot be read."""
    return await slow(_verified_h1, path, sha256)


def _verified_h1(path: Path, sha256: str) -> str | None:
    try:
        handle = open(path, "rb")
    except FileNotFoundError:
        return None  # evicted meanwhile: nothing to hash, nothing to drop
    except OSError as exc:
        raise DamagedFile(f"cannot be opened ({exc.strerror or exc})",
                          _identity_of(path)) from None
    with handle:
        info = os.fstat(handle.fileno())
        identity = (info.st_dev, info.st_ino)
        try:
            actual = sha256_of_file(handle)
        except OSError as exc:
            raise DamagedFile(f"cannot be read ({exc.strerror or exc})", identity) from None
        if actual != sha256.lower():
            raise DamagedFile(f"has sha256 {actual}, not the signed checksum {sha256}",
                              identity)
        handle.seek(0)
        try:
            # The same open file: what is unzipped is what was just checked.
            return h1_of_zip(handle)
        except OSError as exc:
            raise DamagedFile(f"cannot be read ({exc.strerror or exc})", identity) from None
        except Exception as exc:  # zipfile raises many kinds of error on bad zips
            log.warning("%s matches its signed checksum, but its h1 cannot be computed: %s",
                        path, exc)
            return None


def _identity_of(path: Path) -> tuple[int, int] | None:
    try:
        info = path.stat()
    except OSError:
        return None
    return info.st_dev, info.st_ino
