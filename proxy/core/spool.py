"""The streaming hand-off of a fill: readers follow a file while the fill writes it, and
learn at the end whether it verified (then it was published) or not (then they must abort)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from pathlib import Path

import aiofiles

# Followers of a download read in pieces this large: memory per client stays small.
_CHUNK = 256 << 10


class GrowingFile:
    """A download under way: readers follow the temp file as it grows, and learn at the end
    whether it verified (then it was published) or not (then they must abort)."""

    def __init__(self, temp: Path, size: int | None,
                 opened: Callable[[int], None] = lambda _fd: None) -> None:
        self.temp = temp
        self._opened = opened  # told each reader's file descriptor (the store marks it in use)
        self.size = size
        self.written = 0
        self.final: Path | None = None
        self.error: BaseException | None = None
        self._changed = asyncio.Event()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def advance(self, count: int) -> None:
        """More bytes are on disk."""
        self.written += count
        self._wake()

    def complete(self, final: Path) -> None:
        """Verified and published at final."""
        self.final = final
        self._wake()

    def fail(self, error: BaseException) -> None:
        """Not verified: nothing was published."""
        self.error = error
        self._wake()

    @property
    def done(self) -> bool:
        """Whether the download ended, either way."""
        return self.final is not None or self.error is not None

    async def wait_done(self) -> Path:
        """The published file, once there; raises the fill's error."""
        while not self.done:
            await self._changed.wait()
        if self.error is not None:
            raise self.error
        assert self.final is not None
        return self.final

    async def chunks(self) -> AsyncGenerator[bytes, None]:
        """Every byte of the file as it arrives; raises at the end if it did not verify. The
        last byte is held back until the file verified, so a reader of a bad download never
        receives a complete body."""
        try:
            handle = await aiofiles.open(self.temp, "rb")
        except FileNotFoundError:
            # Already renamed into place (or removed after a failure).
            handle = await aiofiles.open(await self.wait_done(), "rb")
        self._opened(handle.fileno())  # the same file once published: eviction skips it
        offset = 0
        try:
            while True:
                changed = self._changed
                if self.error is not None:
                    raise self.error
                readable = self.written if self.final is not None else self.written - 1
                if offset < readable:
                    data = await handle.read(min(_CHUNK, readable - offset))
                    if not data:
                        raise OSError("temp file shorter than reported")
                    offset += len(data)
                    yield data
                    continue
                if self.final is not None:
                    return
                await changed.wait()
        finally:
            await handle.close()
