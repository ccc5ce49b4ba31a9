"""How figures are taken: wrk for requests/s and p99 latency, curl for downloads (time to
first byte, whole time, throughput, concurrent clients), /proc for server CPU and peak RSS."""

from __future__ import annotations

import os
import re
import resource
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from proxy.core.tree_memory import rollup

T = TypeVar("T")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
_UNITS_MS = {"us": 0.001, "ms": 1.0, "s": 1000.0, "m": 60_000.0}


@dataclass(frozen=True)
class Load:
    """What wrk measured: requests per second, the 99th percentile latency, and socket errors
    (connect, read, write, timeout: counted, not fatal; the report names them)."""

    requests_per_second: float
    p99_ms: float
    socket_errors: int = 0


def wrk(url: str, seconds: float, connections: int = 64, threads: int = 2) -> Load:
    """`wrk -t2 -c64 --latency` on url; a non-2xx answer raises (a wrong answer is no
    figure)."""
    result = subprocess.run(
        ["wrk", f"-t{threads}", f"-c{connections}", f"-d{seconds:g}s", "--latency", url],
        capture_output=True, text=True, check=True)
    out = result.stdout
    rate = re.search(r"Requests/sec:\s+([\d.]+)", out)
    p99 = re.search(r"^\s+99%\s+([\d.]+)(us|ms|s|m)\s*$", out, re.MULTILINE)
    if rate is None or p99 is None:
        raise RuntimeError(f"wrk said nothing readable on {url}: {out}{result.stderr}")
    if "Non-2xx or 3xx responses" in out:
        raise RuntimeError(f"wrk saw error answers on {url}: {out}")
    errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)",
                       out)
    return Load(float(rate.group(1)), float(p99.group(1)) * _UNITS_MS[p99.group(2)],
                sum(int(n) for n in errors.groups()) if errors else 0)


@dataclass(frozen=True)
class Download:
    """One curl download: seconds to the first byte and to the last, and its size."""

    first_byte: float
    total: float
    size: int


_CURL_OUT = "%{time_starttransfer} %{time_total} %{size_download} %{http_code}"


def _curl(ca: Path, url: str) -> list[str]:
    return ["curl", "-s", "-o", "/dev/null", "--cacert", str(ca), "-w", _CURL_OUT, url]


def _parse(url: str, output: str) -> Download:
    first, total, size, code = output.split()
    if code != "200":
        raise RuntimeError(f"{url}: HTTP {code}")
    return Download(float(first), float(total), int(float(size)))


def download(ca: Path, url: str) -> Download:
    """Download url once with curl (trusting ca) into /dev/null."""
    result = subprocess.run(_curl(ca, url), capture_output=True, text=True, check=True)
    return _parse(url, result.stdout)


def download_after(ca: Path, first: str, url: str) -> Download:
    """Download first, then url on the same connection (one curl); the second download's
    figures (its time to first byte counts from its own request: no connection or
    handshake)."""
    result = subprocess.run(["curl", "-s", "--cacert", str(ca), "-w", _CURL_OUT + "\\n",
                             "-o", "/dev/null", first, "-o", "/dev/null", url],
                            capture_output=True, text=True, check=True)
    answers = result.stdout.splitlines()
    if len(answers) != 2:
        raise RuntimeError(f"curl said nothing readable on {first} then {url}: {result.stdout}")
    _parse(first, answers[0])
    return _parse(url, answers[1])


def fetch(ca: Path, url: str) -> bytes:
    """url's body (curl, trusting ca); anything but 200 raises."""
    result = subprocess.run(["curl", "-s", "--cacert", str(ca), "-w", "\n%{http_code}", url],
                            capture_output=True, check=True)
    body, _, code = result.stdout.rpartition(b"\n")
    if code != b"200":
        raise RuntimeError(f"{url}: HTTP {code.decode(errors='replace')}")
    return body


@dataclass(frozen=True)
class Transfer:
    """Bytes moved by some clients together, and the seconds it took."""

    size: int
    seconds: float

    @property
    def mb_per_second(self) -> float:
        return self.size / 1e6 / self.seconds


def throughput(ca: Path, url: str, clients: int, rounds: int) -> Transfer:
    """`clients` curl processes at once, each downloading url `rounds` times in a row."""
    def client(_: int) -> int:
        return sum(download(ca, url).size for _ in range(rounds))
    started = time.monotonic()
    with ThreadPoolExecutor(clients) as pool:
        size = sum(pool.map(client, range(clients)))
    return Transfer(size, time.monotonic() - started)


def concurrent_downloads(ca: Path, url: str, clients: int) -> float:
    """Seconds from starting `clients` curl downloads of url at once until the last is done."""
    started = time.monotonic()
    processes = [subprocess.Popen(_curl(ca, url), stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, text=True)
                 for _ in range(clients)]
    outputs = [process.communicate()[0] for process in processes]
    elapsed = time.monotonic() - started
    for output in outputs:
        _parse(url, output)
    return elapsed


# --- the server's processes ----------------------------------------------------------------

def _stat_fields(pid: int) -> list[str]:
    """/proc/PID/stat after the command name (which may hold spaces and parentheses)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def process_tree(root: int) -> list[int]:
    """root and all its descendants now alive (a server's workers)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int(_stat_fields(int(entry.name))[1])
            except (OSError, IndexError):
                continue  # gone meanwhile
            children.setdefault(parent, []).append(int(entry.name))
    tree, pending = [], [root]
    while pending:
        pid = pending.pop()
        tree.append(pid)
        pending.extend(children.get(pid, []))
    return tree


def cpu_seconds(pids: Iterable[int]) -> float:
    """User + system CPU seconds the processes used so far (all their threads)."""
    total = 0
    for pid in pids:
        try:
            fields = _stat_fields(pid)
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    return total / CLOCK_TICKS


def settle(root: int, window: float = 0.2, within: float = 10.0) -> None:
    """Wait until the processes under root used under a tenth of a core over `window`
    seconds (at most `within`): a cold fill's work after its last byte (the h1 pass reads
    the whole zip) must not slow down the measurement that comes next."""
    deadline = time.monotonic() + within
    used = cpu_seconds(process_tree(root))
    while time.monotonic() < deadline:
        time.sleep(window)
        now = cpu_seconds(process_tree(root))
        if now - used < window / 10:
            return
        used = now


class MemorySampler:
    """A server's memory while a load runs, sampled every `interval` seconds: the peak sum of
    every process's proportional set size (PSS: a page shared by n processes counts 1/n in
    each, so the sum is what the tree really holds), the peak sum of their RSS, and the
    highest RSS of one worker (any process but the root)."""

    def __init__(self, root: int, interval: float = 0.05) -> None:
        self._root = root
        self._pids = process_tree(root)
        self._interval = interval
        self.tree_pss_bytes = 0
        self.tree_rss_bytes = 0
        self.worker_rss_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        while True:
            # A process that is gone counts nothing: (PSS, RSS) = (0, 0).
            rollups = {pid: rollup(pid) or (0, 0) for pid in self._pids}
            self.tree_pss_bytes = max(self.tree_pss_bytes, sum(p for p, _ in rollups.values()))
            self.tree_rss_bytes = max(self.tree_rss_bytes, sum(r for _, r in rollups.values()))
            self.worker_rss_bytes = max([self.worker_rss_bytes, *(
                r for pid, (_, r) in rollups.items() if pid != self._root)])
            if self._stop.wait(self._interval):
                return


class CpuMeter:
    """Server CPU over a measurement: the whole tree's utime + stime, before and after."""

    def __init__(self, root: int) -> None:
        self.pids = process_tree(root)
        self.start = cpu_seconds(self.pids)

    def seconds(self) -> float:
        """CPU seconds since the meter was made."""
        return cpu_seconds(self.pids) - self.start


def thread_cpu_seconds(thread: threading.Thread) -> float:
    """CPU seconds one running thread of this process used so far (to the nanosecond: a
    small download's upstream uses less than a clock tick)."""
    assert thread.ident is not None, "the thread is not started"
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def _children_cpu_seconds() -> float:
    """CPU seconds of this process's children that ended and were waited for (the curl
    clients: a server still running is not among them)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


@dataclass(frozen=True)
class CpuUse:
    """The CPU seconds every process of a measurement used: the upstream (its thread in this
    process), the server measured (all its processes; none for a direct download) and the
    clients (curl), and the wall time it took."""

    upstream: float
    server: float
    clients: float
    wall: float

    @property
    def total(self) -> float:
        return self.upstream + self.server + self.clients

    def bound(self, cores: int) -> float:
        """The least wall time the work could take on this many cores: all of it CPU,
        spread perfectly (the CPU-bound lower bound)."""
        return self.total / cores


def metered(work: Callable[[], T], upstream_thread: threading.Thread, server: int | None = None
            ) -> tuple[T, CpuUse]:
    """work's result, and the CPU its processes used meanwhile: the upstream's thread, the
    server's process tree (root pid; None: no server, a direct download), and the clients
    work started and waited for. Nothing else may end a child process of this one meanwhile."""
    meter = CpuMeter(server) if server is not None else None
    upstream = thread_cpu_seconds(upstream_thread)
    clients = _children_cpu_seconds()
    started = time.monotonic()
    result = work()
    wall = time.monotonic() - started
    return result, CpuUse(thread_cpu_seconds(upstream_thread) - upstream,
                          meter.seconds() if meter is not None else 0.0,
                          _children_cpu_seconds() - clients, wall)


def load_average() -> tuple[float, float, float]:
    """The 1, 5 and 15 minute load averages."""
    one, five, fifteen = Path("/proc/loadavg").read_text().split()[:3]
    return float(one), float(five), float(fifteen)
