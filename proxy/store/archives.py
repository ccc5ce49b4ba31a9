"""The disk backend's files (see proxy.store.disk): a file is written to a temp file under
`<cache>/tmp` and renamed into place only once verified, so a partial or corrupt file is never
visible (readers follow a download in its temp file: proxy.store.spool). The store also
keeps the cache within its size limit, least recently used first, counting what every
process sharing the directory wrote and never deleting a file that any of them is sending.
A file's access time is its LRU clock; its modification time stays that of its bytes (see
proxy.store.file_identity)."""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import logging
import os
import re
import shutil
import stat
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

import aiofiles.os

from proxy.core.executors import quick, quick_soon
from proxy.store.disk_space import DiskSpace
from proxy.store.file_identity import FileIdentity, identity_of
from proxy.store.fill_notices import remove_dead_notices
from proxy.store.layout import AREAS, HOT_COPIES_DIR
from proxy.store.protocol import Ready
from proxy.store.usage import (
    HeldLedger,
    Usage,
    UsageLedger,
    evict_least_recently_used,
    lock_exclusive,
    mark_in_use,
)

log = logging.getLogger(__name__)

# Uses are recorded on the files' access time, at most this often per file.
_TOUCH_INTERVAL = 60.0
# A waiter for a fill lock retries the flock this often; asks whether the artifact is ready
# first as often, then backing off to this.
_LOCK_POLL = 0.05
_MAX_READY_CHECK = 0.25  # a waiter in another process is served within this of a publish
# Eviction frees down to this share of the limit, so it does not run on every fill.
_LOW_WATER = 0.9
# Fill locks: a fixed set of lock files, chosen by a hash of the artifact, so that they never
# pile up. Two artifacts that share one fill one after the other.
LOCK_STRIPES = 1024
# The shared usage record is replaced by a full scan at least this often, so that files a
# crash left uncounted (placed, not yet recorded) cannot push the cache past its limit for long.
_RESCAN_SECONDS = 600.0


class ArchiveStore:
    """Provider packages under `<cache>/archives/...`, modules under `<cache>/modules/...`."""

    def __init__(self, cache_dir: Path, max_size: int | None = None,
                 on_evict: Callable[[int, int], None] | None = None,
                 disk: DiskSpace | None = None) -> None:
        self.cache_dir = cache_dir
        self.disk = disk or DiskSpace(cache_dir)
        # Each process writes under its own locked directory, so that processes sharing the
        # cache (workers, or a restarted one) sweep only what dead processes left behind.
        self.tmp_root = self.temp_root(cache_dir)
        self.tmp_root.mkdir(parents=True, exist_ok=True)
        # Made under a name sweepers leave alone, locked, then renamed: no other process
        # ever sees it unlocked.
        pending = Path(tempfile.mkdtemp(prefix=_PENDING, dir=self.tmp_root))
        self._tmp_lock = open(pending / _LOCK_NAME, "wb")
        fcntl.flock(self._tmp_lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self.tmp = self.tmp_root / f"p{os.getpid()}-{pending.name[len(_PENDING):]}"
        os.rename(pending, self.tmp)
        self.max_size = max_size
        self._locks = self.tmp_root / _LOCKS
        self._locks.mkdir(exist_ok=True)
        # Shared by every process: used_bytes and file_count are this process's latest view.
        self._usage = UsageLedger(self._locks / _USAGE)
        self.used_bytes = 0
        self.file_count = 0
        self._on_evict = on_evict
        self._touched: dict[Path, float] = {}

    @staticmethod
    def temp_root(cache_dir: Path) -> Path:
        """Where the processes using cache_dir keep their temp directories and locks."""
        return cache_dir / "tmp"

    @classmethod
    def remove_temp_of(cls, cache_dir: Path, pid: int) -> None:
        """Remove what an ended process (a worker) left in its temp directories."""
        for root in (cls.temp_root(cache_dir), cls.temp_root(cache_dir / HOT_COPIES_DIR)):
            if root.is_dir():
                for leftover in root.glob(f"p{pid}-*"):
                    shutil.rmtree(leftover, ignore_errors=True)

    def close(self) -> None:
        """Remove this process's temp directory (a clean shutdown)."""
        # A fill being cut at shutdown may still create a file while the tree is removed
        # (its thread outlives the cancelled task); then the directory is not empty when
        # rmtree reaches it, and is tried again.
        for attempt in range(_CLOSE_ATTEMPTS):
            shutil.rmtree(self.tmp, ignore_errors=True)
            if not self.tmp.exists():
                break
            time.sleep(0.05 * (attempt + 1))
        self._tmp_lock.close()

    def sweep_temp(self) -> int:
        """Delete what processes that died mid-fill left behind (their temp directories are
        no longer locked); returns how many entries went. Live processes' files stay."""
        removed = 0
        for leftover in self.tmp_root.iterdir():
            if leftover in (self.tmp, self.tmp_root / _LOCKS):
                continue  # lock files must outlive any one process: never swept
            try:
                removed += self._sweep_one(leftover)
            except FileNotFoundError:
                # Renamed or removed since the listing: a worker starting at the same time
                # renames its pending directory, or another sweeper got there first.
                continue
        self._sweep_unstriped_locks()
        return removed + remove_dead_notices(self._locks)

    @staticmethod
    def _sweep_one(leftover: Path) -> bool:
        if leftover.is_dir() and not leftover.is_symlink():
            if leftover.name.startswith(_PENDING):
                # Being set up by a starting process (or left by one that died then).
                if time.time() - leftover.stat().st_mtime < _YOUNG_SECONDS:
                    return False
            elif _held_by_a_live_process(leftover / _LOCK_NAME):
                return False
            shutil.rmtree(leftover, ignore_errors=True)
        else:
            leftover.unlink()  # gone meanwhile: not counted (FileNotFoundError)
        return True

    def _sweep_unstriped_locks(self) -> None:
        # Earlier versions kept one lock file per artifact, forever. Removing one that an
        # old process still holds costs at most a second download of that artifact (both
        # verified, both renamed into place whole), during an upgrade.
        old = [entry for entry in self._locks.iterdir() if _UNSTRIPED_LOCK.fullmatch(entry.name)]
        for entry in old:
            entry.unlink(missing_ok=True)
        if old:
            log.info("removed %d per-artifact lock files of an earlier version", len(old))

    def lock_path(self, key: str) -> Path:
        """The lock file that serializes the fill of one artifact across processes: one of
        LOCK_STRIPES, so their number stays bounded."""
        stripe = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") % LOCK_STRIPES
        return self._locks / f"stripe-{stripe:04d}.lock"

    def notice_path(self, name: str) -> Path:
        """Where the fill of name posts its notice for the other processes (beside the lock
        files: never swept while its process lives)."""
        return self._locks / f"{hashlib.sha256(name.encode()).hexdigest()[:32]}.fill"

    def measure(self) -> int:
        """Add up the stored files and record the total for every process sharing the cache
        (at start-up, after an import; blocks); returns the total in bytes."""
        with self._usage.locked() as ledger:
            usage = self._scan()
            ledger.write(usage)
        self._note(usage)
        return usage.bytes

    def reread_usage(self) -> None:
        """Refresh used_bytes and file_count from the shared record, which every process
        updates (blocks briefly); keeps the last values while a holder rewrites it."""
        usage = self._usage.peek()
        if usage is not None:
            self._note(usage)

    def _note(self, usage: Usage) -> None:
        self.used_bytes, self.file_count = usage.bytes, usage.files

    def _scan(self) -> Usage:
        sizes = [size for _path, size, _used in self._files()]
        return Usage(sum(sizes), len(sizes), time.time())

    def _record(self, ledger: HeldLedger, size: int, files: int) -> Usage:
        """Add a change to the shared record, or scan afresh when the record is missing,
        damaged or old (the scan already includes the change)."""
        usage = ledger.read()
        if usage is None or not 0 <= time.time() - usage.scanned <= _RESCAN_SECONDS:
            usage = self._scan()
        else:
            usage = usage.plus(size, files)
        ledger.write(usage)
        return usage

    def _files(self) -> Iterator[tuple[Path, int, float]]:
        for area in AREAS:
            for directory, _dirs, files in os.walk(self.cache_dir / area):
                for name in files:
                    path = Path(directory) / name
                    try:
                        info = path.stat()
                    except FileNotFoundError:
                        continue
                    yield path, info.st_size, info.st_atime

    def versions_held(self, parts: Sequence[str]) -> set[str]:
        """Names of the version directories under parts that hold at least one file."""
        base = self.path_for(parts)
        try:
            return {entry.name for entry in base.iterdir()
                    if entry.is_dir() and any(child.is_file() for child in entry.iterdir())}
        except FileNotFoundError:
            return set()

    def path_for(self, parts: Sequence[str]) -> Path:
        """Where the file named by already-validated parts lives (first part: the area,
        `archives` or `modules`)."""
        if not parts or parts[0] not in AREAS or any(
                p in ("", ".", "..") or "/" in p or "\\" in p or "\0" in p for p in parts):
            raise ValueError(f"unsafe artifact path {parts!r}")
        return self.cache_dir.joinpath(*parts)

    async def identity(self, path: Path) -> FileIdentity | None:
        """The identity of the stored file at path (one stat, a hit's and a miss's first
        call); None if there is none.

        On the event loop, as the fill lock's open and flock are: a stat in a local cache
        directory takes microseconds, while a hop to the quick pool and back took 0.2-0.4 ms
        on a busy worker and 0.7-1.2 ms on an idle one (two thread wake-ups), before every
        package's first byte."""
        try:
            info = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        return identity_of(info) if stat.S_ISREG(info.st_mode) else None

    def temp_file(self) -> Path:
        """A fresh temp file name (not created)."""
        return self.tmp / f"{uuid.uuid4().hex}.part"

    def work_dir(self) -> Path:
        """A fresh, empty work directory; the caller removes it (or the next start does)."""
        return Path(tempfile.mkdtemp(prefix="work-", dir=self.tmp))

    # --- use and recency -----------------------------------------------------------------

    def open_to_send(self, path: Path) -> BinaryIO | None:
        """Open a stored file to send it, marked in use until the handle is closed: eviction
        by any process sharing the cache leaves it alone meanwhile. None if the file is gone
        (evicted since it was looked up). Quick enough for the event loop (see
        DiskBlobStore.open): an open and a flock that never waits."""
        try:
            handle = open(path, "rb")
        except FileNotFoundError:
            return None
        mark_in_use(handle.fileno())
        return handle

    def touch(self, path: Path) -> None:
        """Record a use (the file's access time is the LRU clock), at most once a minute."""
        now = time.monotonic()
        if now - self._touched.get(path, -_TOUCH_INTERVAL) >= _TOUCH_INTERVAL:
            self._touched[path] = now
            quick_soon(_record_use_quietly, path)

    # --- publishing and eviction ---------------------------------------------------------

    async def publish(self, temp: Path, parts: Sequence[str]) -> Path:
        """Move a finished temp file into place atomically, record it in the shared usage,
        then keep the cache (all processes' files) within the limit."""
        final = self.path_for(parts)
        size = (await aiofiles.os.stat(temp)).st_size
        added = 0
        try:
            size -= (await aiofiles.os.stat(final)).st_size  # replacing an older copy
        except FileNotFoundError:
            added = 1
        await quick(final.parent.mkdir, parents=True, exist_ok=True)
        await aiofiles.os.replace(temp, final)
        # Recorded after the rename: an eviction scanning in between counts the file twice,
        # which only makes the next eviction check (a fresh scan) come early.
        usage = await self._usage.run_locked(lambda ledger: self._record(ledger, size, added))
        self._note(usage)
        self._touched[final] = time.monotonic()
        if self.max_size is not None and usage.bytes > self.max_size:
            await self.evict(keep=final)
        return final

    async def evict(self, keep: Path | None = None) -> int:
        """If the files on disk (every process's) exceed the limit, delete the least recently
        used until under the low-water mark; returns how many went. Files any process is
        sending, and `keep`, stay. One process evicts at a time, from a fresh scan."""
        if self.max_size is None:
            return 0
        removed, usage = await self._usage.run_locked(
            lambda ledger: self._evict_locked(ledger, keep))
        self._note(usage)
        for path, size in removed:
            self._touched.pop(path, None)
            log.info("evicted %s (%d bytes) to keep the cache under %d bytes",
                     path.relative_to(self.cache_dir), size, self.max_size)
            if self._on_evict is not None:
                self._on_evict(1, size)
        return len(removed)

    def _evict_locked(self, ledger: HeldLedger, keep: Path | None
                      ) -> tuple[list[tuple[Path, int]], Usage]:
        assert self.max_size is not None
        removed, usage = evict_least_recently_used(list(self._files()), self.max_size,
                                                   int(self.max_size * _LOW_WATER), keep)
        ledger.write(usage)
        return removed, usage

    async def discard(self, path: Path, identity: FileIdentity | None) -> bool:
        """Delete a stored file found damaged, unless another file replaced it since it was
        read (identity: of the file read; None: whatever is there). Returns whether a file
        went."""
        usage = await self._usage.run_locked(
            lambda ledger: self._discard_locked(ledger, path, identity))
        if usage is None:
            return False
        self._note(usage)
        self._touched.pop(path, None)
        return True

    def _discard_locked(self, ledger: HeldLedger, path: Path,
                        identity: FileIdentity | None) -> Usage | None:
        try:
            info = path.stat()
            # The whole identity, not the inode alone: a fill's new file may reuse the inode
            # number the dropped one freed.
            if identity is not None and identity_of(info) != identity:
                return None
            path.unlink()
        except FileNotFoundError:
            return None
        return self._record(ledger, -info.st_size, -1)


_LOCK_NAME = ".owner.lock"
_YOUNG_SECONDS = 60.0
_CLOSE_ATTEMPTS = 5
_PENDING = ".new-"
_LOCKS = "locks"
_USAGE = "usage.lock"
_UNSTRIPED_LOCK = re.compile(r"[0-9a-f]{32}\.lock")


def _held_by_a_live_process(lock_file: Path) -> bool:
    try:
        with open(lock_file, "rb") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(handle, fcntl.LOCK_UN)
            return False
    except FileNotFoundError:
        return False


class FillLock:
    """An exclusive, cross-process lock on one artifact's fill (flock on a lock file),
    taken without blocking the event loop. A waiter asks `ready` now and then (backing off
    to once a second) and stops waiting once it answers True: then it does not hold it."""

    def __init__(self, path: Path, ready: Ready | None = None) -> None:
        self._path = path
        self._ready = ready
        self._handle: BinaryIO | None = None

    async def __aenter__(self) -> bool:
        handle = open(self._path, "ab")  # noqa: ASYNC230 - a tiny local file
        if self._ready is None:
            await lock_exclusive(handle, _LOCK_POLL)  # another process fills it: wait our turn
        elif not await _lock_unless_ready(handle, self._ready):
            handle.close()
            return False
        self._handle = handle
        return True

    async def __aexit__(self, *_exc: object) -> None:
        if self._handle is not None:
            fcntl.flock(self._handle, fcntl.LOCK_UN)
            self._handle.close()
            self._handle = None


async def _lock_unless_ready(handle: BinaryIO, ready: Ready) -> bool:
    """Whether the flock was taken; False once ready answered True first."""
    check_every = _LOCK_POLL
    next_check = time.monotonic() + check_every
    try:
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                pass
            if time.monotonic() >= next_check:
                if await ready():
                    return False
                check_every = min(check_every * 2, _MAX_READY_CHECK)
                next_check = time.monotonic() + check_every
            await asyncio.sleep(_LOCK_POLL)
    except BaseException:
        handle.close()
        raise


def _record_use_quietly(path: Path) -> None:
    # The access time alone: the modification time must keep saying when the bytes were
    # written, for the check that a stored file is still the one verified. (A write landing
    # between the stat and the utime would have its mtime put back: the price of there being
    # no portable way to leave one of the two times alone.)
    try:
        info = os.stat(path)
        os.utime(path, ns=(time.time_ns(), info.st_mtime_ns))
    except OSError:
        pass
