"""Metrics shared by the worker processes of one `serve`: prometheus_client's multiprocess
mode. Before it starts the workers, the parent makes a fresh directory and names it in
PROMETHEUS_MULTIPROC_DIR, which they inherit; every worker records its counters and gauges in
files there, and whichever worker answers /metrics reads them all, so each scrape shows the
whole service."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

from prometheus_client.metrics_core import CounterMetricFamily, Metric
from prometheus_client.multiprocess import mark_process_dead
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

__all__ = ["ENV", "WorkerProcesses", "WorkerRestarts", "count_restart", "register_worker",
           "remove_shared_metrics", "service_pids", "shared_directory",
           "start_shared_metrics", "worker_exited"]

# prometheus_client reads it when it is first imported (the parent imported it before the
# directory existed): forked workers choose its value class again (proxy.cli.workers).
ENV = "PROMETHEUS_MULTIPROC_DIR"
# Under the directory: one file per live worker, named by its index, holding its pid (not a
# *.db file, so the multiprocess collector does not read it).
_WORKERS = "workers"
# The parent's count of workers it started again after they died (not a *.db file either).
_RESTARTS = "restarts"


def shared_directory() -> Path | None:
    """The directory this process records its metrics in, when it is one of several."""
    value = os.environ.get(ENV)
    return Path(value) if value else None


def start_shared_metrics() -> Path:
    """A fresh directory for this start's workers (counters start at 0 again), named in the
    environment they inherit."""
    directory = Path(tempfile.mkdtemp(prefix="tf-registry-proxy-metrics-"))
    (directory / _WORKERS).mkdir()
    os.environ[ENV] = str(directory)
    return directory


def register_worker(index: int) -> None:
    """In a worker: say which process is worker `index` (its process metrics)."""
    directory = shared_directory()
    if directory is not None and (directory / _WORKERS).is_dir():
        (directory / _WORKERS / str(index)).write_text(str(os.getpid()))


def service_pids(directory: Path | None) -> list[int]:
    """The processes of this service: this one alone, or (as one of several workers) the
    supervisor (this worker's parent) and every live worker."""
    if directory is None:
        return [os.getpid()]
    return [os.getppid(), *_worker_pids(directory / _WORKERS).values()]


def _worker_pids(workers: Path) -> dict[str, int]:
    """Each live worker's pid, by its index."""
    found = {}
    for marker in sorted(workers.glob("*")):
        try:
            found[marker.name] = int(marker.read_text())
        except (OSError, ValueError):  # gone, or being written
            continue
    return found


def worker_exited(directory: Path, index: int, pid: int) -> None:
    """In the parent: a worker is gone; its live gauges (open connections, fills) no longer
    count. Its counters do: what it counted happened."""
    mark_process_dead(pid, str(directory))  # type: ignore[no-untyped-call]
    (directory / _WORKERS / str(index)).unlink(missing_ok=True)


def count_restart(directory: Path) -> int:
    """In the parent: one more worker started again; the count so far."""
    count = _restarts(directory) + 1
    temp = directory / f".{_RESTARTS}.tmp"
    temp.write_text(str(count))
    temp.replace(directory / _RESTARTS)
    return count


def _restarts(directory: Path | None) -> int:
    if directory is None:
        return 0
    try:
        return int((directory / _RESTARTS).read_text())
    except (OSError, ValueError):
        return 0


def remove_shared_metrics(directory: Path) -> None:
    """In the parent, once every worker stopped: the directory is of no further use."""
    shutil.rmtree(directory, ignore_errors=True)
    if os.environ.get(ENV) == str(directory):
        del os.environ[ENV]


class WorkerProcesses(Collector):
    """The process_* metrics (CPU, memory, file descriptors, start time) of every live
    worker, each labelled worker="N"."""

    def __init__(self, directory: Path) -> None:
        self._workers = directory / _WORKERS
        self._pid = 0
        self._process = ProcessCollector(pid=lambda: self._pid, registry=None)

    def collect(self) -> Iterable[Metric]:
        """One family per process metric, one sample per worker."""
        families: dict[str, Metric] = {}
        for index, pid in _worker_pids(self._workers).items():
            self._pid = pid
            for family in self._process.collect():
                merged = families.setdefault(
                    family.name, Metric(family.name, family.documentation, family.type))
                for found in family.samples:
                    merged.add_sample(found.name, {**found.labels, "worker": index},
                                      found.value)
        return list(families.values())


class WorkerRestarts(Collector):
    """tfproxy_worker_restarts_total: workers the parent started again after one died (an
    OOM kill, a crash); 0 for a single process."""

    def __init__(self, directory: Path | None) -> None:
        self._directory = directory

    def collect(self) -> Iterable[Metric]:
        """The parent's count."""
        family = CounterMetricFamily(
            "tfproxy_worker_restarts", "Worker processes started again after one died "
            "(killed, crashed); a crash loop (5 in 60 s) stops the service.")
        family.add_metric([], _restarts(self._directory))
        return [family]
