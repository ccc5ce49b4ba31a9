"""`serve` with server.workers > 1: N processes on one port (SO_REUSEPORT) sharing the disk
cache, supervised by the parent.

The parent is a thin supervisor: no app, no store, no event loop, no thread. It imports the
serving code once (and the S3 client library when the cache is a bucket), freezes those
objects out of the garbage collector's reach, and forks the workers from there: the pages of
that code are shared by every process instead of copied into each (a spawned worker would
import it all again)."""

from __future__ import annotations

import collections
import gc
import importlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import tempfile
import time
from multiprocessing.context import ForkProcess
from pathlib import Path

from prometheus_client import values as prometheus_values

from proxy.cli.logs import configure_server_logging
from proxy.cli.messages import fail
from proxy.cli.server import run_loop, run_server
from proxy.config import Config
from proxy.core import siblings
from proxy.core.shared_metrics import (
    count_restart,
    register_worker,
    remove_shared_metrics,
    start_shared_metrics,
    worker_exited,
)
from proxy.store.archives import ArchiveStore
from proxy.tls.certificates import ensure_certificate, ssl_context
from proxy.web.shutdown import EXIT_MARGIN, die_with_parent

log = logging.getLogger("proxy")
# A worker that exits with this refused to start (it said why): replacing it would not help.
STARTUP_REFUSED = 2
# More than this many restarts within CRASH_WINDOW seconds stop the service (a crash loop).
CRASH_LOOP = 5
CRASH_WINDOW = 60.0
# The signals the supervisor handles: held while a worker is forked, released by the worker
# once it has its own handlers (until then it would run the supervisor's).
SUPERVISOR_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP})


def serve_workers(config: Config, generated_ca: Path | None) -> int:
    """Start the workers and wait for them. The parent forwards SIGTERM/SIGINT and waits
    for the workers' graceful stop (killing any still there after the grace period and a
    margin). A worker that dies (an OOM kill, a crash) is replaced, as gunicorn and nginx
    do, logged and counted (tfproxy_worker_restarts_total); the service stops only on a
    crash loop (CRASH_LOOP restarts within CRASH_WINDOW seconds), or when a worker refuses
    to start (exit status 2: its message says why). Workers watch the parent and stop when
    it dies, however it dies."""
    try:
        metrics_dir = start_shared_metrics()  # before the workers: they inherit it
    except OSError as exc:
        return fail(f"cannot make the workers' metrics directory in {tempfile.gettempdir()} "
                    f"(TMPDIR): {exc.strerror or exc}")
    forked = multiprocessing.get_context("fork")
    _share_imports(config)
    # Kept here for the life of the service: a worker started again joins the same ones.
    channels = siblings.make(config.server.workers)

    def worker(index: int) -> ForkProcess:
        return forked.Process(target=_worker_main,
                              args=(config, generated_ca, index, channels),
                              name=f"worker-{index}")

    workers = [worker(index) for index in range(config.server.workers)]
    deadline: float | None = None
    restarts = RestartBudget()

    def stop(_signum: int = signal.SIGTERM, _frame: object = None) -> None:
        nonlocal deadline
        if deadline is None:
            deadline = time.monotonic() + config.server.shutdown_timeout + EXIT_MARGIN
        for running_worker in running:  # a second signal is forwarded too: they cut at once
            if running_worker.is_alive():
                running_worker.terminate()

    # A signal interrupts the wait below (its handler alone would not: the wait resumes).
    wake_read, wake_write = socket.socketpair()
    wake_write.setblocking(False)
    signal.set_wakeup_fd(wake_write.fileno(), warn_on_full_buffer=False)
    running: list[ForkProcess] = []
    signal.signal(signal.SIGTERM, stop)  # before any worker exists: none is ever orphaned
    signal.signal(signal.SIGINT, stop)
    # Workers start with SIGHUP ignored (inherited) until they handle it (reopen the audit
    # log): a SIGHUP forwarded during their start-up must not kill them.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    for started in workers:
        if deadline is None:  # not if a signal came meanwhile: it could not reach this one
            start_worker(started)
            running.append(started)

    def forward_hangup(_signum: int, _frame: object) -> None:
        for running_worker in running:
            if running_worker.pid is not None and running_worker.is_alive():
                os.kill(running_worker.pid, signal.SIGHUP)

    signal.signal(signal.SIGHUP, forward_hangup)
    log.info("started %d worker processes", len(running))
    code = 0
    while running:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready = multiprocessing.connection.wait([wake_read, *(w.sentinel for w in running)],
                                                timeout)
        if wake_read in ready:
            wake_read.recv(512)
        for dead in [w for w in running if not w.is_alive()]:
            running.remove(dead)
            dead.join()
            name, pid, exitcode = dead.name, dead.pid, dead.exitcode
            dead.close()  # its pipe's descriptors: restarts must not leak them
            index = int(name.rpartition("-")[2])
            if pid is not None:
                worker_exited(metrics_dir, index, pid)
                # Its own shutdown removes its temp directories; a killed worker's stay.
                ArchiveStore.remove_temp_of(config.cache.dir, pid)
            if deadline is not None:
                continue  # stopping: they are meant to go
            how = _how_it_ended(exitcode)
            if exitcode == STARTUP_REFUSED:
                log.error("%s could not start (its message above says why); stopping the "
                          "others", name)
                code = STARTUP_REFUSED
                stop()
                continue
            if not restarts.allow(time.monotonic()):
                log.error("%s %s: more than %d workers died within %.0f s (a crash loop); "
                          "stopping the service", name, how, CRASH_LOOP, CRASH_WINDOW)
                code = exitcode if exitcode and exitcode > 0 else 1
                stop()
                continue
            count = count_restart(metrics_dir)
            log.warning("%s %s; starting a new one (%d restarts so far)", name, how, count)
            replacement = worker(index)
            start_worker(replacement)
            running.append(replacement)
        if running and deadline is not None and time.monotonic() >= deadline:
            for late in running:
                log.error("%s did not stop within %.0f s; killing it", late.name,
                          config.server.shutdown_timeout + EXIT_MARGIN)
                late.kill()
                late.join()
            running, code = [], code or 1
    remove_shared_metrics(metrics_dir)
    return code if code >= 0 else 1


class RestartBudget:
    """How many workers may be started again: CRASH_LOOP within any CRASH_WINDOW seconds."""

    def __init__(self, most: int = CRASH_LOOP, window: float = CRASH_WINDOW) -> None:
        self._most = most
        self._window = window
        self._times: collections.deque[float] = collections.deque()

    def allow(self, now: float) -> bool:
        """Whether one more restart at `now` (monotonic seconds) is within the budget."""
        while self._times and self._times[0] <= now - self._window:
            self._times.popleft()
        if len(self._times) >= self._most:
            return False
        self._times.append(now)
        return True


def _how_it_ended(exitcode: int | None) -> str:
    """A dead worker's end in words: its signal, or its exit status."""
    if exitcode is not None and exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited ({exitcode})"


def start_worker(process: ForkProcess) -> None:
    """Fork process with the supervisor's signals held; the worker releases them once it
    handles them itself (take_own_signals)."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, SUPERVISOR_SIGNALS)
    try:
        process.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def take_own_signals() -> None:
    """In a worker just forked: drop the supervisor's signal handlers and wake-up fd, then
    let the signals held during the fork arrive. SIGTERM stops it at once until the server
    handles it; SIGHUP is ignored until the server handles it (reopen the audit log); SIGINT
    always: Ctrl-C reaches the whole process group, and the supervisor alone decides."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SUPERVISOR_SIGNALS)


def _share_imports(config: Config) -> None:
    """Import what every worker runs, then keep the garbage collector off those objects (its
    passes would write to their pages, which forked workers then copy)."""
    if config.cache.s3 is not None:
        importlib.import_module("proxy.store.s3_objects")  # botocore: ~30 MiB, once
    gc.collect()
    gc.freeze()


def _worker_main(config: Config, generated_ca: Path | None, index: int,
                 channels: siblings.Channels) -> None:
    take_own_signals()
    siblings.join(channels, index)
    # prometheus_client chose its value class when the parent imported it, before the
    # shared metrics directory existed: choose again, now that it does.
    prometheus_values.ValueClass = prometheus_values.get_value_class()  # type: ignore[no-untyped-call]
    configure_server_logging(config.server, worker=index)
    register_worker(index)
    die_with_parent(config.server.shutdown_timeout)
    certificate = ensure_certificate(config.server)
    raise SystemExit(run_loop(run_server(config, ssl_context(certificate), generated_ca,
                                         reuse_port=True),
                              config.server.event_loop))
