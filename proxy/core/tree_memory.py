"""tfproxy_process_tree_pss_bytes and tfproxy_process_tree_rss_bytes: what the whole service
(the supervisor and its workers, or the one process) holds in memory. RSS counts a page
shared by several processes (the code the workers inherit from the supervisor) in each of
them; PSS splits it among them, so the tree's PSS is what the service costs the machine
(Linux: /proc/PID/smaps_rollup)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

_PROC = Path("/proc")


def rollup(pid: int, proc: Path = _PROC) -> tuple[int, int] | None:
    """A process's (PSS, RSS) in bytes; None when it is gone or the kernel does not say."""
    try:
        text = (proc / str(pid) / "smaps_rollup").read_text()
    except OSError:
        return None
    sizes: dict[str, int] = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name in ("Pss", "Rss"):
            amount, _, unit = rest.strip().partition(" ")
            if unit == "kB" and amount.isdigit():
                sizes[name] = int(amount) * 1024
    if "Pss" not in sizes or "Rss" not in sizes:
        return None
    return sizes["Pss"], sizes["Rss"]


class ProcessTreeMemory(Collector):
    """The summed PSS and RSS of the service's processes (pids: asked at each scrape)."""

    def __init__(self, pids: Callable[[], Iterable[int]], proc: Path = _PROC) -> None:
        self._pids = pids
        self._proc = proc

    def collect(self) -> Iterable[Metric]:
        """Both gauges, or none where no process's memory can be read (not Linux)."""
        found = [sizes for pid in self._pids() if (sizes := rollup(pid, self._proc))]
        if not found:
            return []
        pss = GaugeMetricFamily(
            "tfproxy_process_tree_pss_bytes", "Proportional set size of the service's "
            "processes (supervisor and workers) summed: shared pages counted once.")
        pss.add_metric([], sum(sizes[0] for sizes in found))
        rss = GaugeMetricFamily(
            "tfproxy_process_tree_rss_bytes", "Resident set size of the service's processes "
            "summed: shared pages counted in each process.")
        rss.add_metric([], sum(sizes[1] for sizes in found))
        return [pss, rss]
