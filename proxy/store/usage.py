"""The artifact cache's space, shared by every process that uses the cache directory
(workers, other instances on the same volume, the import command).

How much it holds is one small file, read and rewritten under an exclusive flock, so a size
limit counts every process's writes, not only those of the process that checks it. A file
being sent is open with a shared flock on it; eviction takes an exclusive one without
waiting, so it skips files that any process is sending."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Literal, TypeVar

from proxy.core.executors import slow

_T = TypeVar("_T")
# How often a holder waiting on the event loop tries the lock again.
_POLL_SECONDS = 0.02


@dataclass(frozen=True)
class Usage:
    """Bytes and files in the cache: a full scan made at `scanned` (epoch seconds), plus the
    changes recorded since."""

    bytes: int
    files: int
    scanned: float

    def plus(self, size: int, files: int) -> Usage:
        """The usage after adding (or, negative, removing) size bytes in files files."""
        return Usage(max(0, self.bytes + size), max(0, self.files + files), self.scanned)


def mark_in_use(fd: int) -> None:
    """Mark an open stored file as being sent (a shared flock): eviction skips it until the
    descriptor is closed."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        pass  # being evicted this instant: this descriptor still reads the whole file


def open_to_check(path: Path) -> BinaryIO | None:
    """Open a stored file, marked in use, for a read that is no use of it (a check of every
    file): its access time, the LRU clock, stays as it was where the system allows
    (O_NOATIME, which Linux refuses for another user's file: then an ordinary open). None if
    the file is gone. Quick enough for the event loop: an open and a flock that never
    waits."""
    flag = getattr(os, "O_NOATIME", 0)
    try:
        try:
            handle = os.fdopen(os.open(path, os.O_RDONLY | flag), "rb")
        except PermissionError:
            if not flag:
                raise
            handle = open(path, "rb")
    except FileNotFoundError:
        return None
    mark_in_use(handle.fileno())
    return handle


def evict_least_recently_used(files: list[tuple[Path, int, float]], limit: int, target: int,
                              keep: Path | None) -> tuple[list[tuple[Path, int]], Usage]:
    """Given every stored (path, size, last use), and if they exceed limit: delete the least
    recently used until target, skipping keep and files in use. Returns what was deleted
    (path, size) and the usage left. Blocks; the caller holds the ledger."""
    total, count = sum(size for _p, size, _m in files), len(files)
    removed: list[tuple[Path, int]] = []
    if total > limit:
        for path, size, _used in sorted(files, key=lambda f: f[2]):
            if total <= target:
                break
            if path == keep:
                continue
            outcome = _remove_unless_in_use(path)
            if outcome == "in use":
                continue
            total, count = total - size, count - 1
            if outcome == "removed":
                removed.append((path, size))
    return removed, Usage(total, count, time.time())


def _remove_unless_in_use(path: Path) -> Literal["removed", "in use", "gone"]:
    try:
        try:
            fd = os.open(path, os.O_RDWR)  # writable: see UsageLedger._open
        except PermissionError:
            fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return "gone"
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return "in use"
        try:
            if not os.path.samestat(os.fstat(fd), os.stat(path)):
                return "in use"  # replaced since it was scanned: not the file we judged
            os.unlink(path)  # a reader that opened it just before still reads it whole
        except FileNotFoundError:
            return "gone"
        return "removed"
    finally:
        os.close(fd)


class HeldLedger:
    """The record while its lock is held: read it, write it (blocking calls)."""

    def __init__(self, handle: BinaryIO) -> None:
        self._handle = handle

    def read(self) -> Usage | None:
        """The recorded usage; None if there is none (or it is damaged: rescan then)."""
        self._handle.seek(0)
        return _parse(self._handle.read(4096))

    def write(self, usage: Usage) -> None:
        """Replace the record."""
        self._handle.seek(0)
        self._handle.truncate()
        self._handle.write(json.dumps({"bytes": usage.bytes, "files": usage.files,
                                       "scanned": usage.scanned}).encode())
        self._handle.flush()


class UsageLedger:
    """The shared record of the cache's usage, at path (never swept)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def _open(self) -> BinaryIO:
        # Read and write access: over NFS, flock is emulated with byte-range locks, and an
        # exclusive one needs a descriptor open for writing.
        return os.fdopen(os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644), "r+b")

    @contextmanager
    def locked(self) -> Iterator[HeldLedger]:
        """Hold the record, waiting for other holders (blocks: start-up, commands)."""
        with self._open() as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            yield HeldLedger(handle)

    async def run_locked(self, work: Callable[[HeldLedger], _T]) -> _T:
        """Run work (blocking calls) in a thread with the record held. The wait for the lock
        happens on the event loop, so waiters never tie up threads; the lock is released by
        the thread when work ends, even if the caller was cancelled meanwhile."""
        handle = self._open()
        await lock_exclusive(handle, _POLL_SECONDS)  # held elsewhere (an eviction scanning?)

        def held() -> _T:
            with handle:  # closing the descriptor releases the lock
                return work(HeldLedger(handle))

        try:
            # The slow pool: an eviction's walk over the store can take a while.
            running = asyncio.ensure_future(slow(held))
        except BaseException:
            handle.close()  # never started: nobody else will release it
            raise
        return await running

    def peek(self) -> Usage | None:
        """The recorded usage without waiting (blocks briefly: run it in a thread); None when
        there is no record yet, or a holder is rewriting it right now."""
        try:
            handle = open(self.path, "rb")
        except FileNotFoundError:
            return None
        with handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return None
            return _parse(handle.read(4096))


def _parse(data: bytes) -> Usage | None:
    try:
        fields = json.loads(data)
        usage = Usage(int(fields["bytes"]), int(fields["files"]), float(fields["scanned"]))
    except (ValueError, KeyError, TypeError):
        return None
    return usage if usage.bytes >= 0 and usage.files >= 0 else None


async def lock_exclusive(handle: BinaryIO, poll_seconds: float) -> None:
    """Take an exclusive flock on handle, polling so that the event loop never blocks; the
    handle is closed if the wait fails or is cancelled."""
    try:
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                await asyncio.sleep(poll_seconds)
    except BaseException:
        handle.close()
        raise
