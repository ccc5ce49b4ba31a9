"""Fills followed across the processes of one host. A fill posts a notice naming its spool
(and the size upstream announced); a process whose clients ask for the same artifact while
another process holds the fill lock finds the notice and sends them the bytes as they reach
the disk, instead of waiting for the publish. The last byte still waits: it goes out only
once the store holds the artifact as the very file that was followed (same device, inode,
size and mtime: a store whose publish keeps the spool's identity, as the disk backend's
rename does). A fill that failed, stalled, or whose process died, ends its followers'
downloads short: a client never receives a whole body that was not verified.

A notice names its process by pid and by the pid namespace and boot it lives in: processes
of another container sharing the volume (often pid 1 each) can tell nothing of its life, so
they neither follow nor sweep it; their clients wait for the publish, as before.

Only stores that say where notices go (BlobStore.fill_notice) take part; other backends'
waiters keep waiting for the publish."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from proxy.core.errors import UpstreamError
from proxy.core.executors import quick, quick_soon
from proxy.core.singleflight import retrieved
from proxy.core.spool import GrowingFile
from proxy.store.file_identity import FileIdentity, identity_of
from proxy.store.protocol import BlobInfo, BlobStore
from proxy.store.spool import spool_of

log = logging.getLogger(__name__)

# How often a follower looks at the spool's size and at the notice.
POLL_SECONDS = 0.02
# A notice larger than this is not one (read no further).
_MOST_BYTES = 4096


@cache
def _namespace() -> str:
    """This process's pid namespace and boot: where its pids mean something."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return ""  # no /proc: notices of others are never followed nor swept


@dataclass(frozen=True)
class Notice:
    """What a fill under way says about itself."""

    temp: str  # its spool
    size: int | None  # what upstream announced
    pid: int  # the process that runs it
    namespace: str  # where that pid means something (see _namespace)

    def alive(self) -> bool | None:
        """Whether its process lives; None where this process cannot tell."""
        if not self.namespace or self.namespace != _namespace():
            return None
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except OSError as exc:
            return exc.errno == errno.EPERM  # there, but not ours to signal
        return True


class PostedNotice:
    """A fill's own notice: posted (on a thread) once its spool exists, withdrawn when the
    fill ended (published or failed), both while the fill holds its lock (a later fill's
    notice is never touched)."""

    def __init__(self, path: Path, name: str) -> None:
        self._path = path
        self._name = name
        self._temp: str | None = None  # once posted
        self._posting: asyncio.Future[None] | None = None
        self._ended = False  # its fill ended before the notice was posted: never posted

    @classmethod
    def of(cls, store: BlobStore, name: str) -> PostedNotice | None:
        """The notice the fill of name will post (None if the store takes no notices)."""
        path = store.fill_notice(name)
        return None if path is None else cls(path, name)

    def begin(self, spool: GrowingFile[BlobInfo]) -> None:
        """Post it for spool on a thread, while the download goes on: once the spool's file
        is made (a follower that finds no file follows nothing), and once its first reader
        asked for bytes (GrowingFile.first_reader: the thread's GIL hand-overs held that
        reader's headers up)."""
        self._posting = asyncio.ensure_future(self._post_when_read(spool))

    async def _post_when_read(self, spool: GrowingFile[BlobInfo]) -> None:
        await spool.first_reader()
        await spool.when_made(lambda: self.post(spool))

    async def posted(self) -> None:
        """Once begun, wait until it is posted (or could not be)."""
        if self._posting is not None:
            await asyncio.shield(self._posting)

    def end(self) -> None:
        """The fill ended, under its lock: the notice is withdrawn now (blocking, and
        quick: also when the fill is cancelled). One still being posted posts nothing,
        unless it is already between its last look and its rename (microseconds): that one
        is withdrawn once it is there."""
        posting = self._posting
        if posting is None or posting.done():
            self.withdraw()
            return
        self._ended = True
        posting.add_done_callback(retrieved)
        posting.add_done_callback(lambda _posted: quick_soon(self.withdraw))

    def post(self, spool: GrowingFile[BlobInfo]) -> None:
        """Post it for spool (blocking; if it cannot be written, nobody follows the fill).
        Not once its fill ended: the lock is released then, and a late post would replace
        the notice of the fill that took it since."""
        body = json.dumps({"temp": str(spool.temp), "size": spool.size, "pid": os.getpid(),
                           "namespace": _namespace()})
        try:
            posted = _replace_with(self._path, body.encode(), lambda: not self._ended)
        except OSError as exc:
            log.debug("no fill notice for %s: %s", self._name, exc)
            return
        if posted:
            self._temp = str(spool.temp)

    def withdraw(self) -> None:
        """Remove the notice if it was posted and still names this fill (blocking)."""
        if self._temp is None:
            return
        try:
            found = read_notice(self._path)
            if found is not None and found.temp == self._temp:
                self._path.unlink()
        except OSError:
            pass


def _replace_with(path: Path, body: bytes, wanted: Callable[[], bool]) -> bool:
    """path holds body, whole, for every reader (written aside, then renamed), unless it is
    no longer wanted once written aside; whether it was put there."""
    aside = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    try:
        with open(aside, "wb") as handle:
            handle.write(body)
        if not wanted():
            aside.unlink()
            return False
        os.replace(aside, path)
    except BaseException:
        aside.unlink(missing_ok=True)
        raise
    return True


def read_notice(path: Path) -> Notice | None:
    """The notice at path (blocking); None if there is none or it is not one."""
    try:
        with open(path, "rb") as handle:
            raw = json.loads(handle.read(_MOST_BYTES))
        temp, size, pid = raw["temp"], raw["size"], raw["pid"]
        namespace = raw.get("namespace", "")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if (not isinstance(temp, str) or "\0" in temp or not isinstance(namespace, str)
            or type(pid) is not int or not 0 < pid < 1 << 31
            or not (size is None or (type(size) is int and size >= 0))):
        return None
    return Notice(temp, size, pid, namespace)


def remove_dead_notices(directory: Path) -> int:
    """Remove the notices of processes that are gone, and those that are not notices (a
    start's sweep); how many went. Those of processes this one cannot see stay."""
    removed = 0
    for path in directory.glob("*.fill"):
        found = read_notice(path)
        if found is None or found.alive() is False:
            try:
                path.unlink(missing_ok=True)
            except OSError:
                continue
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
        found = await quick(_open_spool, path, name)
        if found is None:
            return None
        notice, fd = found
        return cls(store, path, notice, fd)

    def _look(self) -> tuple[int, FileIdentity, bool]:
        """The spool's size and identity, and whether the notice still names this fill and
        its process lives (blocking)."""
        identity = identity_of(os.fstat(self._fd))
        found = read_notice(self._path)
        return identity.size, identity, found == self._notice and found.alive() is True

    async def follow(self, published: Callable[[], Awaitable[BlobInfo | None]],
                     stall_seconds: float) -> BlobInfo:
        """Tell the spool's readers of each byte that reaches the disk until the fill ends;
        the published blob if it is the file followed (then they get the last byte), else
        they are told the download failed (UpstreamError). A spool that does not grow for
        stall_seconds fails them too (its fill would have failed by then)."""
        spool = self.spool
        grew = time.monotonic()
        try:
            while True:
                size, identity, under_way = await quick(self._look)
                if size > spool.written:
                    spool.advance(size - spool.written)
                    grew = time.monotonic()
                if not under_way or (spool.size is not None and size >= spool.size):
                    final = await published()
                    if final is not None and final.identity == identity:
                        spool.advance(final.size - spool.written)
                        spool.complete(final)
                        return final
                    if not under_way:
                        raise UpstreamError("the download in another worker process did not "
                                            "complete; try again")
                if time.monotonic() - grew > stall_seconds:
                    raise UpstreamError("the download in another worker process stalled; "
                                        "try again")
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


def _open_spool(path: Path, name: str) -> tuple[Notice, int] | None:
    """The notice at path and its spool, open, if its process lives (blocking)."""
    notice = read_notice(path)
    if notice is None or notice.alive() is not True:
        return None
    temp = Path(notice.temp)
    try:
        # A notice names a spool of this store (in the temp area its notices sit in),
        # nothing else; instances that mount the volume elsewhere do not follow.
        if path.parent.parent.resolve() not in temp.resolve().parents:
            log.debug("not following the fill notice of %s: %s is not a spool here", name,
                      temp)
            return None
        return notice, os.open(temp, os.O_RDONLY | os.O_CLOEXEC)
    except (OSError, ValueError):
        return None  # it ended meanwhile (or the path cannot be resolved)
