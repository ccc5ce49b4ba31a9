"""`serve` with server.workers > 1: N processes on one port (SO_REUSEPORT) sharing the disk
cache, supervised by the parent."""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import tempfile
import time
from pathlib import Path

from proxy.cli.logs import configure_server_logging
from proxy.cli.messages import fail
from proxy.cli.server import run_loop, run_server
from proxy.config import Config
from proxy.core.shared_metrics import (
    register_worker,
    remove_shared_metrics,
    start_shared_metrics,
    worker_exited,
)
from proxy.store.archives import ArchiveStore
from proxy.tls.certificates import ensure_certificate, ssl_context
from proxy.web.shutdown import EXIT_MARGIN, die_with_parent

log = logging.getLogger("proxy")


def serve_workers(config: Config, generated_ca: Path | None) -> int:
    """Start the workers and wait for them. The parent forwards SIGTERM/SIGINT and waits
    for the workers' graceful stop (killing any still there after the grace period and a
    margin); when one worker dies, it stops the others and exits with its status. Workers
    watch the parent and stop when it dies, however it dies."""
    try:
        metrics_dir = start_shared_metrics()  # before the workers: they inherit it
    except OSError as exc:
        return fail(f"cannot make the workers' metrics directory in {tempfile.gettempdir()} "
                    f"(TMPDIR): {exc.strerror or exc}")
    spawn = multiprocessing.get_context("spawn")
    workers = [spawn.Process(target=_worker_main, args=(config, generated_ca, index),
                             name=f"worker-{index}") for index in range(config.server.workers)]
    deadline: float | None = None

    def stop(_signum: int = signal.SIGTERM, _frame: object = None) -> None:
        nonlocal deadline
        if deadline is None:
            deadline = time.monotonic() + config.server.shutdown_timeout + EXIT_MARGIN
        for worker in workers:  # a second signal is forwarded too: the workers cut at once
            if worker.is_alive():
                worker.terminate()

    # A signal interrupts the wait below (its handler alone would not: the wait resumes).
    wake_read, wake_write = socket.socketpair()
    wake_write.setblocking(False)
    signal.set_wakeup_fd(wake_write.fileno(), warn_on_full_buffer=False)
    signal.signal(signal.SIGTERM, stop)  # before any worker exists: none is ever orphaned
    signal.signal(signal.SIGINT, stop)
    # Workers start with SIGHUP ignored (inherited) until they handle it (reopen the audit
    # log): a SIGHUP forwarded during their start-up must not kill them.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    running = []
    for worker in workers:
        if deadline is None:  # not if a signal came meanwhile: it could not reach this one
            worker.start()
            running.append(worker)

    def forward_hangup(_signum: int, _frame: object) -> None:
        for worker in running:
            if worker.pid is not None and worker.is_alive():
                os.kill(worker.pid, signal.SIGHUP)

    signal.signal(signal.SIGHUP, forward_hangup)
    log.info("started %d worker processes", len(running))
    code = 0
    while running:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready = multiprocessing.connection.wait([wake_read, *(w.sentinel for w in running)],
                                                timeout)
        if wake_read in ready:
            wake_read.recv(512)
        for worker in [w for w in running if not w.is_alive()]:
            running.remove(worker)
            worker.join()
            if worker.pid is not None:
                worker_exited(metrics_dir, workers.index(worker), worker.pid)
            if deadline is None:
                log.error("%s exited (%s); stopping the others", worker.name, worker.exitcode)
                code = worker.exitcode or 1
                stop()
        if running and deadline is not None and time.monotonic() >= deadline:
            for worker in running:
                log.error("%s did not stop within %.0f s; killing it", worker.name,
                          config.server.shutdown_timeout + EXIT_MARGIN)
                worker.kill()
                worker.join()
            running, code = [], code or 1
    for worker in workers:  # its own shutdown removes them; a killed worker's stay
        if worker.pid is not None:
            ArchiveStore.remove_temp_of(config.cache.dir, worker.pid)
    remove_shared_metrics(metrics_dir)
    return code if code >= 0 else 1


def _worker_main(config: Config, generated_ca: Path | None, index: int) -> None:
    configure_server_logging(config.server, worker=index)
    register_worker(index)
    # Ctrl-C reaches the whole process group: the parent alone decides, and forwards SIGTERM.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(config.server.shutdown_timeout)
    certificate = ensure_certificate(config.server)
    raise SystemExit(run_loop(run_server(config, ssl_context(certificate), generated_ca,
                                         reuse_port=True),
                              config.server.event_loop))
