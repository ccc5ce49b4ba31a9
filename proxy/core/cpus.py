"""How many CPUs this process can really use: the affinity mask (a cpuset) and the cgroup's
CPU quota (cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`, on this
process's cgroup and every ancestor), whichever is lower, rounded up, at least 1. A pod
limited to 500m on a 64-core node can use one, not 64."""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")


@dataclass(frozen=True)
class UsableCpus:
    """The count, and why (for the start-up log)."""

    count: int
    why: str


def usable_cpus(root: Path = CGROUP_ROOT, membership: Path = PROC_SELF_CGROUP,
                affinity: int | None = None) -> UsableCpus:
    """The CPUs this process can use, and why that many."""
    mask = affinity if affinity is not None else _affinity()
    quota = cgroup_quota(root, membership)
    if quota is None or math.ceil(quota[0]) >= mask:
        return UsableCpus(mask, f"{mask} CPU{'s' if mask != 1 else ''} in the affinity mask"
                          + ("" if quota is None else f"; the cgroup quota ({quota[0]:g} CPUs, "
                             f"{quota[1]}) is no lower"))
    count = max(1, math.ceil(quota[0]))
    return UsableCpus(count, f"cgroup CPU quota {quota[0]:g} CPUs ({quota[1]}), rounded up; "
                             f"{mask} in the affinity mask")


def cgroup_quota(root: Path = CGROUP_ROOT,
                 membership: Path = PROC_SELF_CGROUP) -> tuple[float, str] | None:
    """The lowest CPU quota (in CPUs) on this process's cgroup and its ancestors, and the
    file that sets it; None without one (unlimited, or no cgroup file system)."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        return None
    found: list[tuple[float, str]] = []
    for line in lines:
        _hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if controllers == "":  # cgroup v2: one unified hierarchy
            found += _limits(root, path, _v2_quota)
        elif "cpu" in controllers.split(","):  # cgroup v1: the cpu controller's hierarchy
            for mount in (controllers, "cpu", "cpu,cpuacct"):
                if (root / mount).is_dir():
                    found += _limits(root / mount, path, _v1_quota)
                    break
    return min(found, default=None)


def _limits(base: Path, path: str,
            quota_of: Callable[[Path], float | None]) -> list[tuple[float, str]]:
    """The quotas set on the cgroup at path under base and on each of its ancestors (a
    container sees its own cgroup as the root: then base itself)."""
    found = []
    parts = [part for part in path.split("/") if part]
    for depth in range(len(parts), -1, -1):
        directory = base.joinpath(*parts[:depth])
        quota = quota_of(directory)
        if quota is not None:
            found.append((quota, str(directory)))
    return found


def _v2_quota(directory: Path) -> float | None:
    """`cpu.max`: "QUOTA PERIOD" in microseconds, or "max PERIOD" (no limit)."""
    try:
        quota, _, period = (directory / "cpu.max").read_text().strip().partition(" ")
        return None if quota == "max" else int(quota) / int(period or "100000")
    except (OSError, ValueError, ZeroDivisionError):
        return None


def _v1_quota(directory: Path) -> float | None:
    """`cpu.cfs_quota_us` over `cpu.cfs_period_us`; a quota of -1: no limit."""
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text().strip())
        period = int((directory / "cpu.cfs_period_us").read_text().strip())
        return None if quota <= 0 or period <= 0 else quota / period
    except (OSError, ValueError):
        return None


def _affinity() -> int:
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


@functools.cache
def process_cpus() -> UsableCpus:
    """usable_cpus() of this process, read once (the worker count and the thread pools are
    sized from it at start; workers forked later share the supervisor's answer)."""
    return usable_cpus()


def available_cpus() -> int:
    """How many CPUs this process can use (process_cpus)."""
    return process_cpus().count
