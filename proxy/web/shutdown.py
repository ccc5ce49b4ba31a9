"""Bounded shutdown: stop accepting at once, give responses under way a grace period, then
cut them; and worker processes that never outlive the process that started them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

log = logging.getLogger(__name__)

# After the grace period: how long cut handlers get to unwind before they are cancelled.
CUT_TIMEOUT = 1.0
# What a process gets beyond the grace period to finish its cleanup before it is killed.
EXIT_MARGIN = 5.0
# How often a worker asks whether its parent is still there (besides the pipe that says so).
PARENT_CHECK_SECONDS = 1.0


class StopSignals:
    """The first signal asks for a graceful stop; a second one cuts at once."""

    def __init__(self) -> None:
        self.stop = asyncio.Event()
        self.cut = asyncio.Event()

    def received(self) -> None:
        """A stop signal arrived."""
        if self.stop.is_set():
            if not self.cut.is_set():
                log.warning("second stop signal: cutting the responses under way now")
            self.cut.set()
        self.stop.set()

    def install(self, signums: tuple[signal.Signals, ...]) -> None:
        """Handle these signals in the running event loop."""
        loop = asyncio.get_running_loop()
        for signum in signums:
            loop.add_signal_handler(signum, self.received)


async def stop_serving(runner: web.BaseRunner, grace: float, cut: asyncio.Event) -> None:
    """Close the listening sockets now, let responses under way finish for up to `grace`
    seconds (less if `cut` is set), abort the connections still open, then clean up the
    runner (the app's cleanup cancels detached fills and removes their temp files)."""
    for site in list(runner.sites):
        await site.stop()
    server = runner.server
    if server is not None:
        server.pre_shutdown()  # idle keep-alive connections close now, busy ones when done
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        # aiohttp signals no "last connection closed": look ten times a second. Only
        # connections with a request under way are waited for: an idle keep-alive one (Go's
        # HTTP client keeps Terraform's between requests) would hold the stop up to the
        # grace period, its handler gone but its transport left open.
        while any(_busy(c) for c in server.connections) \
                and not cut.is_set() and loop.time() < deadline:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(cut.wait(), min(0.1, deadline - loop.time()))
        busy = [c for c in server.connections if _busy(c)]
        if busy:
            log.warning("cutting %d connection(s) still busy after the grace period",
                        len(busy))
        for connection in list(server.connections):
            # abort, not close: close would wait for a slow client to take the buffered data.
            if connection.transport is not None:
                connection.transport.abort()
        # Handlers not waiting on their connection (e.g. on a slow fill) are cancelled.
        await server.shutdown(CUT_TIMEOUT)
    await runner.cleanup()


def _busy(connection: RequestHandler) -> bool:
    """Whether a connection has a request under way (aiohttp's own flag; a version without
    it counts every open connection as busy, as before)."""
    return connection.transport is not None and bool(
        getattr(connection, "_request_in_progress", True))


def die_with_parent(grace: float) -> None:
    """In a worker process: when the parent dies (even by SIGKILL, which gives it no chance
    to stop its workers), shut down as on SIGTERM, and exit regardless once the grace period
    and a margin are over, so that no orphan keeps serving or holding the port."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return
    # The parent holds the other end of this pipe: it reads as closed once the parent is gone
    # (also when that happened before this thread started). Workers forked after this one
    # hold it too (a fork copies the parent's descriptors), so one that hangs would keep it
    # open: whether the parent is still this process's parent is asked as well.
    sentinel = parent.sentinel
    parent_pid = parent.pid

    def watch() -> None:
        while not multiprocessing.connection.wait([sentinel], PARENT_CHECK_SECONDS):
            if os.getppid() != parent_pid:
                break
        log.warning("the parent process is gone; shutting down")
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace + EXIT_MARGIN)
        log.error("still running %.0f s after the parent died; exiting", grace + EXIT_MARGIN)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
