"""Reading an open file in chunks to send it: from the page cache on the event loop when the
bytes are already there, on a thread when they are not.

A thread hop per chunk (a future, a wake-up of the loop, a context switch each way) cost the
warm path more CPU than copying the chunk itself. A read with RWF_NOWAIT (Linux) copies from
the page cache and never waits on the disk: it fails instead, and only then does the read go
to the quick pool. The file is read with preadv, never mapped: a file cut short under a
mapping would kill the process with SIGBUS; a read just returns fewer bytes."""

from __future__ import annotations

import errno
import os
import sys

from proxy.core.executors import quick

_NOWAIT: int | None = getattr(os, "RWF_NOWAIT", None)
# Buffers a reader keeps: the chunk it just returned may still be held (by its caller, or a
# transport that has not taken it yet) while the next one is read.
_BUFFERS = 2


class ChunkReader:
    """Reads chunks of one open file, each into one of a few buffers it reuses once nothing
    else holds them (so no new, zeroed buffer per chunk). A chunk it returns must be sent (or
    copied) before the buffer can come round again: the reader checks that nothing holds it."""

    def __init__(self, fd: int, chunk_size: int) -> None:
        self._fd = fd
        self.chunk_size = chunk_size
        self._buffers: list[bytearray] = []
        self._next = 0
        self._nowait = _NOWAIT
        self._free_refs = 0  # what getrefcount says of a buffer no one else holds

    async def read(self, offset: int, size: int) -> bytes | memoryview:
        """Up to size (at most chunk_size) bytes from offset; empty at the end of the file."""
        chunk = self.cached(offset, size)
        if chunk is None:
            return await quick(os.pread, self._fd, size, offset)
        return chunk

    def cached(self, offset: int, size: int) -> memoryview | None:
        """What the page cache holds from offset on (up to size bytes), read on the calling
        thread without waiting for the disk; empty at the end of the file; None when the
        first byte is not in memory (or the platform cannot tell without waiting)."""
        if self._nowait is None:
            return None
        buffer = self._buffer()
        try:
            got = os.preadv(self._fd, [memoryview(buffer)[:size]], offset, self._nowait)
        except BlockingIOError:
            return None
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            self._nowait = None  # a file system without RWF_NOWAIT: every read on a thread
            return None
        return memoryview(buffer)[:got]

    def _buffer(self) -> bytearray:
        for index in range(len(self._buffers)):
            # Referenced by this list only: no chunk of it is held anywhere, neither by a
            # caller nor by a transport's backlog (a memoryview holds its buffer too).
            if sys.getrefcount(self._buffers[index]) == self._free_refs:
                return self._buffers[index]
        if len(self._buffers) < _BUFFERS:
            index = len(self._buffers)
            self._buffers.append(bytearray(self.chunk_size))
        else:  # all still held: the oldest is dropped (freed when its holder lets go)
            index, self._next = self._next, (self._next + 1) % _BUFFERS
            self._buffers[index] = bytearray(self.chunk_size)
        self._free_refs = sys.getrefcount(self._buffers[index])
        return self._buffers[index]
