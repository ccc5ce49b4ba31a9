"""The streaming hand-off of a fill: readers follow a download while the fill writes it to a
file (its newest bytes straight from memory), and learn at the end whether it verified (then
it was published) or not (then they must abort). What a fill publishes (F) is the store's
business (see proxy.store.spool)."""

from __future__ import annotations

import asyncio
import os
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from pathlib import Path
from typing import Generic, TypeVar

from proxy.core.executors import quick, quick_soon, quick_started
from proxy.core.file_reads import ChunkReader

F = TypeVar("F")
T = TypeVar("T")

# Followers behind what is kept in memory read the file in pieces this large (as a cached
# file is sent: see proxy.web.responses).
_CHUNK = 64 << 10
# The newest bytes of a download, kept in memory for the followers of this process: they are
# sent on from there (no write to disk and read back per follower). A follower that falls
# further behind reads the file, so memory stays bounded whatever the followers do.
WINDOW = 4 << 20
# How long a fill waits for its first reader to ask for bytes before it reads the download:
# the reader's headers are out by then, and nothing of the fill (its reads of upstream's
# buffered bytes, its threads) competed with them for this process. Whoever started the fill
# reads at once; a fill nobody reads here (a HEAD request, a client that left) starts late
# by this much.
FIRST_READER_WAIT = 0.05


def _not_readable(_final: object) -> AsyncIterator[bytes]:
    raise OSError("the spool is gone, and nothing says how to read what it became")


class GrowingFile(Generic[F]):
    """A download under way: readers follow it as it grows (its newest bytes from memory,
    older ones from the temp file), and learn at the end whether it verified (then it was
    published as F) or not (then they must abort)."""

    def __init__(self, temp: Path, size: int | None,
                 opened: Callable[[int], None] = lambda _fd: None,
                 published: Callable[[F], AsyncIterator[bytes]] = _not_readable,
                 window: int = WINDOW, made: asyncio.Future[int] | None = None) -> None:
        self.temp = temp
        # The temp file being made (its write descriptor, the fill's); None: it exists.
        # Readers open it once it is made: a download's headers do not wait for it.
        self.made = made
        self._opened = opened  # told each reader's file descriptor (the store marks it in use)
        # Reads what the spool became, for a reader that comes after it was published.
        self._published = published
        self.size = size
        self.received = 0  # bytes the download brought so far: in memory or on disk
        self.written = 0  # bytes of them on disk
        self.final: F | None = None
        self.error: BaseException | None = None
        self._changed = asyncio.Event()
        # (offset, bytes) of the newest chunks, oldest first; a chunk leaves only once it is
        # on disk, so every byte received is in one place or the other.
        self._recent: deque[tuple[int, bytes]] = deque()
        self._recent_bytes = 0
        self._window = window
        self._asked = asyncio.Event()  # a reader asked for bytes: its headers are out

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def arrived(self, chunk: bytes) -> None:
        """More bytes came (not yet on disk): readers get them from memory."""
        if not chunk:
            return
        self._recent.append((self.received, chunk))
        self._recent_bytes += len(chunk)
        self.received += len(chunk)
        self._trim()
        self._wake()

    def advance(self, count: int) -> None:
        """More bytes are on disk (of those that arrived, or new ones: then readers take
        them from the file)."""
        self.written += count
        self._trim()
        if self.written > self.received:
            self.received = self.written
            self._wake()

    def _trim(self) -> None:
        recent = self._recent
        while self._recent_bytes > self._window and recent:
            start, chunk = recent[0]
            if start + len(chunk) > self.written:
                return  # not on disk yet: kept, or a reader could find it nowhere
            recent.popleft()
            self._recent_bytes -= len(chunk)

    def _in_memory(self, offset: int, end: int) -> bytes | memoryview | None:
        """The bytes from offset (before end) that memory holds in one piece, if it does."""
        recent = self._recent
        if not recent or offset < recent[0][0]:
            return None
        for start, chunk in reversed(recent):  # readers are mostly near the newest
            if start <= offset:
                if offset == start and start + len(chunk) <= end:
                    return chunk
                return memoryview(chunk)[offset - start:end - start]
        return None

    async def first_reader(self, within: float = FIRST_READER_WAIT) -> None:
        """Return once a reader asked for bytes, or after `within` seconds (then at once
        from then on: whoever waits for this waits once)."""
        if self._asked.is_set():
            return
        try:
            async with asyncio.timeout(within):
                await self._asked.wait()
        except TimeoutError:
            self._asked.set()

    def complete(self, final: F) -> None:
        """Verified and published as final."""
        self.final = final
        self._wake()

    def fail(self, error: BaseException) -> None:
        """Not verified: nothing was published."""
        self.error = error
        self._recent.clear()
        self._recent_bytes = 0
        self._wake()

    @property
    def done(self) -> bool:
        """Whether the download ended, either way."""
        return self.final is not None or self.error is not None

    async def wait_done(self) -> F:
        """What was published, once it is; raises the fill's error."""
        while not self.done:
            await self._changed.wait()
        if self.error is not None:
            raise self.error
        assert self.final is not None
        return self.final

    async def chunks(self) -> AsyncGenerator[bytes | memoryview, None]:
        """Every byte of the download as it arrives; raises at the end if it did not verify.
        The last byte is held back until the file verified, so a reader of a bad download
        never receives a complete body. A chunk must be sent (or copied) before the next
        one is asked for."""
        self._asked.set()
        # The file is opened meanwhile, for when this reader falls behind what memory holds:
        # the first bytes do not wait for it.
        opening = self.when_made(self._open)
        reader: ChunkReader | None = None
        offset = 0
        try:
            while True:
                changed = self._changed
                if self.error is not None:
                    raise self.error
                end = self.received if self.final is not None else self.received - 1
                if offset < end:
                    piece = self._in_memory(offset, end)
                    if piece is None:  # fell behind what memory holds: from the file
                        if reader is None:
                            try:
                                fd = await asyncio.shield(opening)
                            except FileNotFoundError:
                                # Published (or removed after a failure) before it could be
                                # opened: read what it became.
                                async for chunk in self._published_from(offset):
                                    yield chunk
                                return
                            reader = ChunkReader(fd, _CHUNK)
                        piece = await reader.read(offset, min(_CHUNK, end - offset))
                        if not piece:
                            raise OSError("temp file shorter than reported")
                    offset += len(piece)
                    yield piece
                    continue
                if self.final is not None:
                    return
                await changed.wait()
        finally:
            opening.add_done_callback(close_when_opened)

    def when_made(self, fn: Callable[[], T]) -> asyncio.Future[T]:
        """fn() on the quick pool, once the temp file is made (or could not be: its failure
        is the fill's, and fn just finds no file)."""
        made = self.made
        if made is None or made.done():
            return quick_started(fn)
        return asyncio.ensure_future(self._once_made(made, fn))

    @staticmethod
    async def _once_made(made: asyncio.Future[int], fn: Callable[[], T]) -> T:
        await asyncio.wait([made])
        return await quick(fn)

    def _open(self) -> int:
        """The spool, open for reading and marked in use (blocking): on disk it is the same
        file once published, kept while this reader has it."""
        fd = os.open(self.temp, os.O_RDONLY | os.O_CLOEXEC)
        try:
            self._opened(fd)
        except BaseException:
            os.close(fd)
            raise
        return fd

    async def _published_from(self, offset: int) -> AsyncIterator[bytes | memoryview]:
        """What the spool became, from offset on."""
        async for chunk in self._published(await self.wait_done()):
            if offset >= len(chunk):
                offset -= len(chunk)
                continue
            yield memoryview(chunk)[offset:] if offset else chunk
            offset = 0


def close_when_opened(opening: asyncio.Future[int]) -> None:
    """Close what a reader opened (off the loop), once it is open."""
    if not opening.cancelled() and opening.exception() is None:
        quick_soon(os.close, opening.result())
