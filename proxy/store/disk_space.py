"""The cache's disk running out of space: recognising it, answering it (507), counting it,
saying so in one log line, and remembering it for /readyz until there is room again."""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from proxy.core.errors import InsufficientStorage

log = logging.getLogger(__name__)

_OUT_OF_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
# SQLite reports a failed write for want of space as SQLITE_FULL, and a shared-memory index
# it cannot grow as SQLITE_IOERR_SHMSIZE ("disk I/O error").
_OUT_OF_SPACE_SQLITE = frozenset({sqlite3.SQLITE_FULL, sqlite3.SQLITE_IOERR_SHMSIZE})
# A write whose final size is unknown needed more than it got: count on twice that, and on
# at least this much, before calling the disk usable again.
_MIN_ROOM = 1 << 20
# How commands say so: strerror of ENOSPC and EDQUOT, and git's own words for an index it
# could not write.
_OUT_OF_SPACE_WORDS = (("No space left on device", errno.ENOSPC),
                       ("Disk quota exceeded", errno.EDQUOT),
                       ("Out of diskspace", errno.ENOSPC))
_NOUNS = {"package": "a package", "module": "a module archive", "index": "an index record"}


def is_out_of_space(exc: BaseException) -> bool:
    """Whether exc says the filesystem (or the user's quota) is full."""
    if isinstance(exc, OSError):
        return exc.errno in _OUT_OF_SPACE_ERRNOS
    if isinstance(exc, sqlite3.Error):
        return getattr(exc, "sqlite_errorcode", None) in _OUT_OF_SPACE_SQLITE
    return False


def reported_out_of_space(output: str) -> int | None:
    """The errno (ENOSPC or EDQUOT) a command's error output (in the C locale) says a write
    failed with, if it says one ran out of space."""
    for words, code in _OUT_OF_SPACE_WORDS:
        if words in output:
            return code
    return None


def looks_full(directory: Path) -> bool:
    """Whether directory's filesystem has less room than any write can count on, i.e. a write
    of unknown size that just failed there most likely failed for want of space (blocking: a
    statvfs). False when that cannot be told."""
    try:
        return free_bytes(directory) < _MIN_ROOM
    except OSError:
        return False


def free_bytes(directory: Path) -> int:
    """Bytes an unprivileged process may still write on directory's filesystem (blocking)."""
    info = os.statvfs(directory)
    return info.f_bavail * info.f_frsize


class DiskSpace:
    """The cache directory's filesystem. After a write found it full, it counts as full until
    the free space would hold what failed to fit (checked by `problem`, i.e. by /readyz)."""

    def __init__(self, directory: Path, on_full: Callable[[str], None] | None = None) -> None:
        self.directory = directory
        self._on_full = on_full
        self._needed: int | None = None  # set while full: the room the failed write needed

    @contextmanager
    def reports(self, kind: str) -> Iterator[None]:
        """Within the block, a write that finds no space raises ran_out(kind)."""
        try:
            yield
        except OSError as exc:
            if not is_out_of_space(exc):
                raise
            raise self.ran_out(kind) from exc

    def ran_out(self, kind: str, needed: int | None = None, got: int = 0) -> InsufficientStorage:
        """Record that writing a `kind` (package, module, index) found no space: count it, log
        it once, and return the error that clients get. `needed`: its full size if known,
        else it needed more than the `got` bytes it wrote. No I/O: safe anywhere."""
        room = needed if needed is not None else max(2 * got, _MIN_ROOM)
        newly = self._needed is None
        self._needed = max(room, self._needed or 0)
        if self._on_full is not None:
            self._on_full(kind)
        # Loud when the disk becomes full; each later refusal is a warning (and counted).
        log.log(logging.ERROR if newly else logging.WARNING,
                "cache disk full: no room for %s (%s) in %s; misses fail with 507 until "
                "space is freed, cached files are still served", _NOUNS.get(kind, kind),
                f"{needed} bytes" if needed is not None else "size unknown", self.directory)
        return InsufficientStorage("the proxy's cache disk is full: this cannot be fetched "
                                   "and stored now; what the cache holds is still served")

    def require_room(self, kind: str, size: int, free: int) -> None:
        """Refuse, before anything is written, a file of `size` bytes that cannot fit in the
        `free` bytes the caller read (free_bytes: one statvfs)."""
        if size > free:
            raise self.ran_out(kind, size)

    def problem(self) -> str | None:
        """Why the cache cannot take new files, or None once there is room for what last
        failed to fit (blocking: a statvfs)."""
        needed = self._needed
        if needed is None:
            return None
        free = free_bytes(self.directory)
        if free >= needed:
            self._needed = None
            log.info("cache disk has room again: %d bytes free in %s", free, self.directory)
            return None
        return (f"no space left in the cache directory {self.directory}: {free} bytes free, "
                f"{needed} needed by the last write that failed")


def describe_start_failure(cache_dir: Path, exc: OSError | sqlite3.Error) -> str:
    """One line for a cache that cannot be opened at start-up: what failed, why, and how
    much room its filesystem has."""
    if isinstance(exc, OSError):
        what = exc.filename or cache_dir
        reason = exc.strerror or str(exc) or type(exc).__name__
    else:
        what = f"the cache index in {cache_dir / 'index'}"
        reason = str(exc) or type(exc).__name__
    try:
        room = f"{free_bytes(cache_dir)} bytes free"
    except OSError as statvfs_error:
        room = f"free space unknown ({statvfs_error.strerror})"
    if is_out_of_space(exc):
        room += ": the disk is full"
    return f"cannot start: {what}: {reason} (cache.dir {cache_dir}: {room})"
