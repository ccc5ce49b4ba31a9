"""What the figure groups share in one run of the bench: the settings, the upstream, the
certificate, and the long-lived servers (the warm proxies, nginx, the floor), each started on
first use and stopped when the bench ends."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from bench.servers import (
    Server,
    StaticTree,
    file_floor,
    floor,
    nginx,
    proxy,
    serving_certificate,
)
from bench.upstream import Package, Upstream

T = TypeVar("T")


@dataclass(frozen=True)
class Settings:
    """How much the bench measures."""

    quick: bool
    runs: int  # each figure is measured once per run; the report gives median, min, max
    seconds: float  # of each wrk measurement
    rounds: int  # downloads in a row per client, for archive throughput
    big: int  # bytes of the package of the archive, cold and herd figures
    workers: int  # the proxy's default (server.workers = "auto": one per CPU), and nginx's


class Session:
    """The shared pieces of one bench run."""

    def __init__(self, settings: Settings, work: Path, upstream: Upstream,
                 stack: ExitStack) -> None:
        self.settings = settings
        self.work = work
        self.upstream = upstream
        self._stack = stack
        self.state_dir = work / "state"
        self.certificate = serving_certificate(self.state_dir)
        assert self.certificate.ca is not None
        self.ca = self.certificate.ca
        self.tree = StaticTree(work / "static")
        self._warm: dict[tuple[int, str | None], Server] = {}
        self._nginx: Server | None = None
        self._floors: dict[int, Server] = {}
        self._file_floor: Server | None = None
        self._published: set[Package] = set()

    def warm_proxy(self, workers: int, access_log: str | None = None) -> Server:
        """A proxy with `workers` processes on the warm cache (one cache for all of them),
        configured as shipped (access_log: otherwise)."""
        key = (workers, access_log)
        if key not in self._warm:
            self._warm[key] = self._stack.enter_context(
                proxy(self.work, self.upstream, self.state_dir, self.work / "cache-warm",
                      workers, access_log))
        return self._warm[key]

    def nginx(self) -> Server:
        """nginx over the static tree, with as many workers as the proxy's default."""
        if self._nginx is None:
            self._nginx = self._stack.enter_context(
                nginx(self.work, self.tree.root, self.certificate, self.ca,
                      self.settings.workers))
        return self._nginx

    def floor(self, processes: int = 1) -> Server:
        """The bare-aiohttp floor in `processes` processes, answering the JSON files in the
        static tree as they are when it starts."""
        if processes not in self._floors:
            self._floors[processes] = self._stack.enter_context(
                floor(self.work, self.tree.root, self.certificate, self.ca, processes))
        return self._floors[processes]

    def file_floor(self) -> Server:
        """The bare-aiohttp file floor, with as many processes as the proxy's default workers,
        serving the zips in the static tree as they are when it starts."""
        if self._file_floor is None:
            self._file_floor = self._stack.enter_context(
                file_floor(self.work, self.tree.root, self.certificate, self.ca,
                           self.settings.workers))
        return self._file_floor

    def publish(self, package: Package) -> None:
        """The package's zip in the static tree: the bytes upstream serves, which the proxy
        serves once verified."""
        if package not in self._published:
            self.tree.write(package.archive(), self.upstream.zip_bytes(package))
            self._published.add(package)

    @contextmanager
    def proxy(self, cache: Path, workers: int) -> Iterator[Server]:
        """A proxy with `workers` processes on cache."""
        with proxy(self.work, self.upstream, self.state_dir, cache, workers) as server:
            yield server

    @contextmanager
    def fresh_cache(self, name: str) -> Iterator[Path]:
        """An empty cache directory, deleted afterwards (large packages fill the disk)."""
        cache = self.work / f"cache-{name}"
        shutil.rmtree(cache, ignore_errors=True)
        try:
            yield cache
        finally:
            shutil.rmtree(cache, ignore_errors=True)


def in_turn(run: int, proxy_side: Callable[[], T], reference: Callable[[], T]) -> tuple[T, T]:
    """Both measured, the proxy first on even runs and the reference first on odd ones (so
    that neither always gets a warmer machine); (proxy's, reference's)."""
    ours, theirs = each_in_turn(run, [proxy_side, reference])
    return ours, theirs


def each_in_turn(run: int, sides: list[Callable[[], T]]) -> list[T]:
    """Each measured, in the given order on even runs and in reverse on odd ones; the results
    in the given order."""
    order = range(len(sides) - 1, -1, -1) if run % 2 else range(len(sides))
    results = {index: sides[index]() for index in order}
    return [results[index] for index in range(len(sides))]


def progress(message: str) -> None:
    """A line on stdout at once: a full run takes a while."""
    print(message, flush=True)
