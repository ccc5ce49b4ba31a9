"""Lines written in batches by a thread, so that a request's log line costs the event loop a
list append: the lines of HAND_OVER_SECONDS are made (those added as what makes them) and
handed over at once, and the thread
writes them to a file descriptor in chunks of whole lines of at most PIPE_BUF bytes (so
that the lines of several processes on one pipe never interleave mid-line). A stuck reader
(a full pipe) never blocks requests: beyond a bounded backlog, lines are dropped, counted
and reported by the writer thread (the report goes to the same stuck output: only that
thread may wait on it). close() writes out everything handed over."""

from __future__ import annotations

import asyncio
import collections
import errno
import itertools
import logging
import os
import queue
import select
import stat
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

# A line, or what makes it once its batch is handed over: (make, *make's arguments). Made
# one after another, lines cost less than made one per request between requests (their code
# and data stay in the CPU's caches: measured several times cheaper).
Line = str | tuple[Any, ...]

# The most bytes one write may carry and still stay whole on a pipe (POSIX: atomic).
CHUNK_BYTES = select.PIPE_BUF
# Characters handed over and not yet written beyond which new lines are dropped.
BACKLOG_SIZE = 4 << 20
# How lines are encoded unless told (a server passes sys.stderr's, as a logging.StreamHandler
# on it wrote them before): a path's undecodable bytes come out as \udcXX escapes.
ENCODING, ERRORS = "utf-8", "backslashreplace"
# How long lines wait on the loop before they are handed to the writer thread: handing over
# a batch wakes the thread, which then wants the GIL (per loop iteration, that switching
# costs more than building the lines).
HAND_OVER_SECONDS = 0.02
# Lines made per loop callback when a batch is handed over: a busy worker's 20 ms of lines
# (several hundred) made in one callback held the loop about a millisecond, which showed in
# the p99 latency of kept answers (1.3 ms over the access log off, one worker). A bigger
# batch is made in MOST_TURNS callbacks, so that making always keeps up with the requests.
MAKE_AT_ONCE = 64
MOST_TURNS = 8
# How often drops are reported (a WARNING line through the ordinary log).
REPORT_SECONDS = 60.0
# How long a clean stop waits for the lines to be written (within the margin a worker's
# supervisor gives it beyond the grace period).
CLOSE_SECONDS = 2.0
_STOP = None
_chains = itertools.count(1)


class BatchedLineWriter:
    """Lines (each ending in a newline) to fd, written by a thread in batches."""

    def __init__(self, fd: int, backlog_size: int = BACKLOG_SIZE, encoding: str = ENCODING,
                 errors: str = ERRORS) -> None:
        self._fd = fd
        self._backlog_size = backlog_size
        self._encoding, self._errors = encoding, errors
        self._pending: list[Line] = []
        # Batches handed over and not yet made, oldest first (made a few lines per loop
        # callback, in order); how far the oldest is made, and its lines made so far.
        self._unmade: collections.deque[list[Line]] = collections.deque()
        self._made_to = 0
        self._ready: list[str] = []
        self._chain = 0  # which chain of callbacks makes them (0: none under way)
        # Batches with their size in characters.
        self._handed: queue.SimpleQueue[tuple[list[str], int] | None] = queue.SimpleQueue()
        # Characters handed over and written, counted by one thread each: their difference
        # is the backlog.
        self._handed_size = 0  # the loop's
        self._written_size = 0  # the writer thread's
        # Lines dropped since the start, each count kept by one thread: beyond the backlog
        # (the loop's), and lost to a failed write (the writer thread's).
        self._refused = 0
        self._lost = 0
        self._reported_dropped = 0
        self._last_report: float | None = None
        # Started with the first line: a process that writes none (a supervisor that forks
        # the workers) has no thread.
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def dropped(self) -> int:
        """Lines not written, since the start."""
        return self._refused + self._lost

    def add(self, line: Line) -> None:
        """Queue one line (or what makes it); handed over within HAND_OVER_SECONDS (at once
        outside a loop)."""
        if self._closed:
            return
        if not self._pending:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # not on a loop (a command, a test): hand it over now
                self._pending.append(line)
                self._hand_over()
                return
            loop.call_later(HAND_OVER_SECONDS, self._hand_over)
        self._pending.append(line)

    def _hand_over(self, at_once: bool = False) -> None:
        """Make the pending lines as one batch, MAKE_AT_ONCE a loop callback (a bigger batch
        in MOST_TURNS; all at once when told or off a loop), and hand it to the writer
        thread; batches go in the order their lines were added."""
        if self._pending:
            self._unmade.append(self._pending)
            self._pending = []
        if at_once or not _on_a_loop():
            self._chain = 0  # a chain under way finds nothing left, and stops
            while self._unmade:
                self._make(len(self._unmade[0]))
        elif not self._chain and self._unmade:
            self._chain = next(_chains)
            self._make_some(self._chain)

    def _make_some(self, chain: int) -> None:
        if chain != self._chain:
            return
        if self._unmade:
            batch = self._unmade[0]
            self._make(max(MAKE_AT_ONCE, -(-len(batch) // MOST_TURNS)))
        if self._unmade:
            asyncio.get_running_loop().call_soon(self._make_some, chain)
        else:
            self._chain = 0

    def _make(self, count: int) -> None:
        """Make count more lines of the oldest batch; hand it over once all are made."""
        batch = self._unmade[0]
        lines = batch[self._made_to:self._made_to + count]
        self._made_to += len(lines)
        try:
            self._ready.extend([_made(line) for line in lines])
        except Exception:  # a line that cannot be made costs that line only
            self._ready.extend(self._made_one_by_one(lines))
        if self._made_to < len(batch):
            return
        self._unmade.popleft()
        self._made_to = 0
        made, self._ready = self._ready, []
        self._deliver(made)

    def _deliver(self, batch: list[str]) -> None:
        if not batch:
            return
        size = sum(len(line) for line in batch)
        if self._handed_size - self._written_size + size > self._backlog_size:
            self._refused += len(batch)  # reported by the writer thread once it gets through
            return
        self._handed_size += size
        if self._thread is None:
            self._thread = threading.Thread(target=self._write_forever, name="line-writer",
                                            daemon=True)
            self._thread.start()
        self._handed.put((batch, size))

    def _made_one_by_one(self, pending: list[Line]) -> list[str]:
        made: list[str] = []
        for line in pending:
            try:
                made.append(_made(line))
            except Exception:
                log.debug("a log line could not be made", exc_info=True)
                self._refused += 1  # dropped: reported by the writer thread
        return made

    def _report_drops(self, final: bool = False) -> None:
        # On the writer thread only: the report may wait on the output as lines do.
        dropped = self.dropped
        now = time.monotonic()
        recently = self._last_report is not None and now - self._last_report < REPORT_SECONDS
        if dropped == self._reported_dropped or (recently and not final):
            return
        log.warning("%d log lines dropped: their output (fd %d) was not read fast enough, or "
                    "could not be written (%d dropped since the start)",
                    dropped - self._reported_dropped, self._fd, dropped)
        self._reported_dropped, self._last_report = dropped, now

    def flush(self) -> None:
        """Hand over what is queued now, without waiting for it to be written (the thread
        writes it at once; the output is not reopened, so there is nothing to wait for)."""
        if self._pending or self._unmade:
            self._hand_over(at_once=True)

    def close(self, timeout: float = CLOSE_SECONDS) -> None:
        """Write out everything queued, then stop the thread (idempotent); a stuck output
        gets at most timeout."""
        if self._closed:
            return
        if self._pending or self._unmade:
            self._hand_over(at_once=True)
        self._closed = True
        if self._thread is not None and self._thread.is_alive():
            self._handed.put(_STOP)
            self._thread.join(timeout)

    def _write_forever(self) -> None:
        # A regular file takes a batch in one write (each write of a process appends whole,
        # and every write wants the GIL back); anything else (a pipe, a socket, a terminal)
        # gets chunks of whole lines of at most CHUNK_BYTES.
        whole = _regular_file(self._fd)
        while True:
            handed = self._handed.get()
            if handed is _STOP:
                self._report_drops(final=True)
                return
            batch, size = handed
            if whole:  # encoded at once: the same bytes as line by line
                self._write("".join(batch).encode(self._encoding, self._errors), len(batch))
            else:
                self._write_chunks(batch)
            self._written_size += size
            self._report_drops()

    def _write_chunks(self, batch: list[str]) -> None:
        # Chunks counted in bytes (a path may hold multi-byte characters), each of whole
        # lines as added (a record of several lines stays whole); a longer one goes alone.
        chunk: list[bytes] = []
        size = 0
        for line in batch:
            data = line.encode(self._encoding, self._errors)
            if size and size + len(data) > CHUNK_BYTES:
                self._write(b"".join(chunk), len(chunk))
                chunk, size = [], 0
            chunk.append(data)
            size += len(data)
        if chunk:
            self._write(b"".join(chunk), len(chunk))

    def _write(self, data: bytes, lines: int) -> None:
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(self._fd, view):]
            except InterruptedError:
                continue
            except OSError as exc:  # a closed or broken output, a full disk: counted, let go
                if exc.errno == errno.EAGAIN:
                    time.sleep(0.01)
                    continue
                self._lost += lines
                return


def _on_a_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _made(line: Line) -> str:
    return line if isinstance(line, str) else line[0](*line[1:])


def _regular_file(fd: int) -> bool:
    try:
        return stat.S_ISREG(os.fstat(fd).st_mode)
    except OSError:
        return False
