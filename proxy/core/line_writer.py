"""Lines written in batches by a thread, so that a request's log line costs the event loop a
list append: the lines of HAND_OVER_SECONDS are handed over at once, and the thread
writes them to a file descriptor in chunks of whole lines of at most PIPE_BUF bytes (so
that the lines of several processes on one pipe never interleave mid-line). A stuck reader
(a full pipe) never blocks requests: beyond a bounded backlog, lines are dropped, counted
and reported. close() writes out everything handed over."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import queue
import select
import threading
import time

log = logging.getLogger(__name__)

# The most bytes one write may carry and still stay whole on a pipe (POSIX: atomic).
CHUNK_BYTES = select.PIPE_BUF
# Characters handed over and not yet written beyond which new lines are dropped.
BACKLOG_SIZE = 4 << 20
# How long lines wait on the loop before they are handed to the writer thread: handing over
# a batch wakes the thread, which then wants the GIL (per loop iteration, that switching
# costs more than building the lines).
HAND_OVER_SECONDS = 0.02
# How often drops are reported (a WARNING line through the ordinary log).
REPORT_SECONDS = 60.0
_STOP = None


class BatchedLineWriter:
    """Lines (each ending in a newline) to fd, written by a thread in batches."""

    def __init__(self, fd: int, backlog_size: int = BACKLOG_SIZE) -> None:
        self._fd = fd
        self._backlog_size = backlog_size
        self._pending: list[str] = []
        self._handed: queue.SimpleQueue[list[str] | None] = queue.SimpleQueue()
        # Characters handed over and written, counted by one thread each: their difference
        # is the backlog.
        self._handed_size = 0  # the loop's
        self._written_size = 0  # the writer thread's
        self.dropped = 0  # lines, since the start
        self._reported_dropped = 0
        self._last_report = 0.0
        # Started with the first line: a process that writes none (a supervisor that forks
        # the workers) has no thread.
        self._thread: threading.Thread | None = None
        self._closed = False

    def add(self, line: str) -> None:
        """Queue one line; handed over within HAND_OVER_SECONDS (at once outside a loop)."""
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

    def _hand_over(self) -> None:
        batch, self._pending = self._pending, []
        size = sum(len(line) for line in batch)
        if self._handed_size - self._written_size + size > self._backlog_size:
            self.dropped += len(batch)
            self._report_drops()
            return
        self._handed_size += size
        if self._thread is None:
            self._thread = threading.Thread(target=self._write_forever, name="line-writer",
                                            daemon=True)
            self._thread.start()
        self._handed.put(batch)

    def _report_drops(self) -> None:
        now = time.monotonic()
        if now - self._last_report < REPORT_SECONDS:
            return
        log.warning("%d log lines dropped: their output (fd %d) is not read fast enough "
                    "(%d dropped since the start)", self.dropped - self._reported_dropped,
                    self._fd, self.dropped)
        self._reported_dropped, self._last_report = self.dropped, now

    def flush(self, timeout: float = 1.0) -> None:
        """Hand over what this iteration queued and wait (at most timeout) until written."""
        if self._pending:
            self._hand_over()
        deadline = time.monotonic() + timeout
        while self._written_size < self._handed_size and time.monotonic() < deadline:
            time.sleep(0.005)

    def close(self, timeout: float = 5.0) -> None:
        """Write out everything queued, then stop the thread (idempotent)."""
        if self._closed:
            return
        if self._pending:
            self._hand_over()
        self._closed = True
        if self._thread is not None and self._thread.is_alive():
            self._handed.put(_STOP)
            self._thread.join(timeout)

    def _write_forever(self) -> None:
        while True:
            batch = self._handed.get()
            if batch is _STOP:
                return
            chunk: list[str] = []
            size = 0
            for line in batch:
                if size and size + len(line) > CHUNK_BYTES:
                    self._write("".join(chunk).encode("utf-8", "replace"))
                    chunk, size = [], 0
                chunk.append(line)
                size += len(line)
            if chunk:
                self._write("".join(chunk).encode("utf-8", "replace"))
            self._written_size += sum(len(line) for line in batch)

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(self._fd, view):]
            except InterruptedError:
                continue
            except OSError as exc:  # a closed or broken output: nothing more to do with it
                if exc.errno == errno.EAGAIN:
                    time.sleep(0.01)
                    continue
                return
