"""Fills followed across the processes of one host. A fill posts a notice naming its spool
(and the size upstream announced); a process whose clients ask for the same artifact while
another process holds the fill lock finds the notice and sends them the bytes as they reach
the disk, instead of waiting for the publish. The last byte still waits: it goes out only
once the store holds the artifact as the very file that was followed (same device, inode,
size and mtime: a store whose publish keeps the spool's identity, as the disk backend's
rename does). A fill that failed, or whose process died, ends its followers' downloads
short: a client never receives a whole body that was not verified.

Only stores that say where notices go (BlobStore.fill_notice) take part; other backends'
waiters keep waiting for the publish."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from proxy.core.errors import UpstreamError
from proxy.core.executors import quick, quick_soon
from proxy.core.singleflight import retrieved
from proxy.core.spool import GrowingFile
from proxy.store.file_identity import identity_of
from proxy.store.protocol import BlobInfo, BlobStore
from proxy.store.spool import spool_of

log = logging.getLogger(__name__)

# How often a follower looks at the spool's size and at the notice.
POLL_SECONDS = 0.02
# A notice larger than this is not one (read no further).
_MOST_BYTES = 4096


@dataclass(frozen=True)
class Notice:
    """What a fill under way says about itself."""

    temp: str  # its spool
    size: int | None  # what upstream announced
    pid: int  # the process that runs it


class PostedNotice:
    """A fill's own notice: posted once its spool exists (where the spool is made: no thread
    hop of its own before the first byte), withdrawn when the fill ended (published or
    failed)."""

    def __init__(self, path: Path, name: str) -> None:
        self._path = path
        self._name = name
        self._temp: str | None = None  # once posted

    @classmethod
    def of(cls, store: BlobStore, name: str) -> PostedNotice | None:
        """The notice the fill of name will post (None if the store takes no notices)."""
        path = store.fill_notice(name)
        return None if path is None else cls(path, name)

    def post(self, spool: GrowingFile[BlobInfo]) -> None:
        """Post it for spool (blocking; if it cannot be written, nobody follows the fill)."""
        body = json.dumps({"temp": str(spool.temp), "size": spool.size, "pid": os.getpid()})
        try:
            _replace_with(self._path, body.encode())
        except OSError as exc:
            log.debug("no fill notice for %s: %s", self._name, exc)
            return
        self._temp = str(spool.temp)

    def withdraw_once(self, posting: asyncio.Future[None]) -> None:
        """Withdraw it once posting (its post, under way in a thread) is done."""
        posting.add_done_callback(retrieved)
        posting.add_done_callback(lambda _posted: quick_soon(self.withdraw))

    def withdraw(self) -> None:
        """Remove the notice (blocking, and quick: also when the fill is cancelled), unless a
        later fill's replaced it."""
        if self._temp is None:
            return
        try:
            found = read_notice(self._path)
            if found is not None and found.temp == self._temp:
                self._path.unlink()
        except OSError:
            pass


def _replace_with(path: Path, body: bytes) -> None:
    """path holds body, whole, for every reader (written aside, then renamed)."""
    aside = path.with_name(f".{path.name}.{os.getpid()}")
    with open(aside, "wb") as handle:
        handle.write(body)
    os.replace(aside, path)


def read_notice(path: Path) -> Notice | None:
    """The notice at path (blocking); None if there is none or it is not one."""
    try:
        with open(path, "rb") as handle:
            raw = json.loads(handle.read(_MOST_BYTES))
        temp, size, pid = raw["temp"], raw["size"], raw["pid"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if (not isinstance(temp, str) or not isinstance(pid, int)
            or not (size is None or isinstance(size, int))):
        return None
    return Notice(temp, size, pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError as exc:
        return exc.errno == errno.EPERM  # there, but not ours to signal
    return True


def remove_dead_notices(directory: Path) -> int:
    """Remove the notices of processes that are gone (a start's sweep); how many went."""
    removed = 0
    for path in directory.glob("*.fill"):
        found = read_notice(path)
        if found is None or not _alive(found.pid):
            path.unlink(missing_ok=True)
            removed += 1
    return removed


class OtherFill:
    """The fill of an artifact under way in another process, followed from its spool."""

    def __init__(self, store: BlobStore, path: Path, notice: Notice, fd: int) -> None:
        self._path = path
        self._notice = notice
        self._fd = fd
        self.spool: GrowingFile[BlobInfo] = spool_of(store, Path(notice.temp), notice.size)

    @classmethod
    async def find(cls, store: BlobStore, name: str) -> OtherFill | None:
        """The fill of name that another process has under way, if it posted a notice and
        its spool can be opened."""
        path = store.fill_notice(name)
        if path is None:
            return None
        return await quick(cls._open, store, path, name)

    @classmethod
    def _open(cls, store: BlobStore, path: Path, name: str) -> OtherFill | None:
        notice = read_notice(path)
        if notice is None or not _alive(notice.pid):
            return None
        temp = Path(notice.temp)
        try:
            # A notice names a spool of this store (in the temp area its notices sit in),
            # nothing else.
            if path.parent.parent.resolve() not in temp.resolve().parents:
                log.warning("ignored the fill notice of %s: %s is not a spool", name, temp)
                return None
            fd = os.open(temp, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None  # it ended meanwhile (or the path cannot be resolved)
        return cls(store, path, notice, fd)

    def _under_way(self) -> bool:
        """Whether the notice still names this fill, and its process lives (blocking)."""
        found = read_notice(self._path)
        return found == self._notice and _alive(self._notice.pid)

    async def follow(self, published: Callable[[], Awaitable[BlobInfo | None]]) -> BlobInfo:
        """Tell the spool's readers of each byte that reaches the disk until the fill ends;
        the published blob if it is the file followed (then they get the last byte), else
        they are told the download failed (UpstreamError)."""
        spool = self.spool
        try:
            while True:
                size = os.fstat(self._fd).st_size  # of an open file: never waits on the disk
                if size > spool.written:
                    spool.advance(size - spool.written)
                under_way = await quick(self._under_way)
                if not under_way or (spool.size is not None and size >= spool.size):
                    final = await published()
                    if final is not None and final.identity == identity_of(os.fstat(self._fd)):
                        spool.advance(final.size - spool.written)
                        spool.complete(final)
                        return final
                    if not under_way:
                        raise UpstreamError("the download in another worker process did not "
                                            "complete; try again")
                await asyncio.sleep(POLL_SECONDS)
        except BaseException as exc:
            if not spool.done:
                spool.fail(exc if isinstance(exc, Exception)
                           else UpstreamError("the download was interrupted"))
            raise
        finally:
            self.close()

    def close(self) -> None:
        """Let go of the spool (idempotent): once followed, or if it never is."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)
