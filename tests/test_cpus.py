"""server.workers = "auto" follows the CPUs the process can use: the affinity mask and the
cgroup CPU quota (v2 cpu.max, v1 cfs_quota_us over cfs_period_us), on its cgroup and every
ancestor, rounded up, at least 1. Fake cgroup trees stand in for the kernel's files."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.cli.startup import startup_lines
from proxy.config import load_config
from proxy.core.cpus import cgroup_quota, usable_cpus


def _v2(tmp_path: Path, membership: str, limits: dict[str, str]) -> tuple[Path, Path]:
    root = tmp_path / "cgroup"
    for where, text in limits.items():
        directory = root / where.strip("/")
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "cpu.max").write_text(text + "\n")
    root.mkdir(exist_ok=True)
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text(f"0::{membership}\n")
    return root, proc


def _v1(tmp_path: Path, mount: str, membership: str,
        limits: dict[str, tuple[int, int]]) -> tuple[Path, Path]:
    root = tmp_path / "cgroup"
    (root / mount).mkdir(parents=True)
    for where, (quota, period) in limits.items():
        directory = root / mount / where.strip("/")
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "cpu.cfs_quota_us").write_text(f"{quota}\n")
        (directory / "cpu.cfs_period_us").write_text(f"{period}\n")
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text(f"12:memory:/whatever\n4:{mount}:{membership}\n0::/\n")
    return root, proc


def test_a_pod_limited_to_500m_on_a_64_core_node_runs_one_worker(tmp_path: Path) -> None:
    root, proc = _v2(tmp_path, "/", {"/": "50000 100000"})  # a container's own namespace
    usable = usable_cpus(root, proc, affinity=64)
    assert usable.count == 1
    assert "cgroup CPU quota 0.5 CPUs" in usable.why and "rounded up" in usable.why


def test_v2_takes_the_lowest_quota_of_the_cgroup_and_its_ancestors(tmp_path: Path) -> None:
    root, proc = _v2(tmp_path, "/kubepods.slice/pod1/ctr", {
        "/kubepods.slice": "800000 100000",  # 8 CPUs for all pods
        "/kubepods.slice/pod1": "250000 100000",  # 2.5 for this pod
        "/kubepods.slice/pod1/ctr": "max 100000"})  # none of its own
    assert cgroup_quota(root, proc) == (2.5, str(root / "kubepods.slice" / "pod1"))
    assert usable_cpus(root, proc, affinity=64).count == 3
    assert usable_cpus(root, proc, affinity=2).count == 2  # the mask is lower
    assert "2 CPUs in the affinity mask" in usable_cpus(root, proc, affinity=2).why


def test_v1_reads_the_cpu_controllers_quota_and_period(tmp_path: Path) -> None:
    root, proc = _v1(tmp_path, "cpu,cpuacct", "/docker/abc", {"/docker/abc": (150000, 100000)})
    assert usable_cpus(root, proc, affinity=16).count == 2
    root, proc = _v1(tmp_path / "unlimited", "cpu,cpuacct", "/docker/abc",
                     {"/docker/abc": (-1, 100000)})
    assert cgroup_quota(root, proc) is None
    assert usable_cpus(root, proc, affinity=16).count == 16


@pytest.mark.parametrize("text", ["max 100000", "garbage", "0 0"])
def test_no_or_unreadable_quota_leaves_the_affinity_mask(tmp_path: Path, text: str) -> None:
    root, proc = _v2(tmp_path, "/", {"/": text})
    assert usable_cpus(root, proc, affinity=4).count == 4
    assert usable_cpus(tmp_path / "none", tmp_path / "no-proc", affinity=3).count == 3


def test_a_tiny_quota_still_runs_one_worker(tmp_path: Path) -> None:
    root, proc = _v2(tmp_path, "/", {"/": "1000 100000"})
    assert usable_cpus(root, proc, affinity=8).count == 1


def test_the_start_up_log_says_how_many_workers_and_why() -> None:
    config = load_config(None, environ={})
    first = startup_lines(config, None)[0]
    assert f"{config.server.workers} worker process" in first
    assert 'server.workers "auto": ' in first
