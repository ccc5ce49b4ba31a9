"""Replicas on S3: three proxy processes on one SeaweedFS bucket, each with an empty cache.dir
of its own. Reports upstream downloads for 100 concurrent cold GETs spread over the replicas,
archive throughput from a replica whose hot copy is cold (fetched from the bucket) and warm,
and how long a replica takes to take over a fill whose owner was killed.

    python bench/run.py --replicas [--quick]
"""

from __future__ import annotations

import os
import platform
import re
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import trustme

from bench.measure import load_average
from bench.report import idle_line
from bench.servers import proxy_config
from bench.upstream import HOST
from tests.support.fake_registry import FakeRegistry
from tests.support.gpg import generate_key, stop_agent
from tests.support.proxy_process import ProxyProcess
from tests.support.s3_replicas import fetch, lease_holder, s3_env, s3_replicas, s3_table
from tests.support.seaweedfs import S3Server, WeedMini

LEASE_SECONDS = 5.0


def _config(registry: FakeRegistry, ca_file: Path, state: Path, server: S3Server,
            bucket: str) -> Callable[[Path, int], str]:
    def write(cache: Path, port: int) -> str:
        return proxy_config(port, state, cache, registry, ca_file) + s3_table(server, bucket)
    return write


def _timed(proxy: ProxyProcess, path: str) -> float:
    started = time.monotonic()
    status, _ = fetch(proxy, path)
    if status != 200:
        raise RuntimeError(f"{path}: HTTP {status}")
    return time.monotonic() - started


def run(quick: bool, runs: int, big_zip: Callable[[int, str], bytes]) -> str:
    """The replicas figures, as a Markdown section."""
    load = load_average()  # before the bench itself loads the machine
    size = (8 if quick else 64) << 20
    work = Path(tempfile.mkdtemp(prefix="tfproxy-bench-replicas-"))
    ca = trustme.CA()
    ca_file = work / "upstream-ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    signer = generate_key(work / "gpg-signer", "Bench Signer")
    impostor = generate_key(work / "gpg-impostor", "Bench Impostor")
    registry = FakeRegistry(ca, signer, impostor)
    weed = WeedMini()
    downloads: list[float] = []
    cold_mbs: list[float] = []
    warm_mbs: list[float] = []
    takeovers: list[float] = []
    try:
        for run_no in range(runs):
            release = registry.add_release("bench", f"r{run_no}", "1.0.0",
                                           platforms=("linux_amd64",))
            release.zips["linux_amd64"] = big_zip(size, f"r{run_no}")
            release.sums = (f"{release.sha256('linux_amd64')}  "
                            f"{release.filename('linux_amd64')}\n").encode()
            release.signature = signer.detach_sign(release.sums)
            registry.add_release("bench", f"s{run_no}", "1.0.0", platforms=("linux_amd64",))
        registry.start()
        server = weed.start()
        for run_no in range(runs):
            bucket = server.new_bucket()
            base = f"/mirror/{HOST}/bench/r{run_no}"
            path = f"{base}/terraform-provider-r{run_no}_1.0.0_linux_amd64.zip"
            slow_base = f"/mirror/{HOST}/bench/s{run_no}"
            slow_path = f"{slow_base}/terraform-provider-s{run_no}_1.0.0_linux_amd64.zip"
            root = work / f"run-{run_no}"
            root.mkdir()
            with s3_replicas(root, 3, _config(registry, ca_file, root / "state", server,
                                              bucket),
                             s3_env(server, LEASE_SECONDS)) as proxies:
                for proxy in proxies:  # as Terraform does: the release's document first
                    fetch(proxy, f"{base}/1.0.0.json")
                    fetch(proxy, f"{slow_base}/1.0.0.json")
                # 100 concurrent cold GETs spread over the replicas.
                before = len(registry.archive_requests())
                with ThreadPoolExecutor(100) as pool:
                    answers = list(pool.map(fetch, [proxies[n % 3] for n in range(100)],
                                            [path] * 100))
                if {status for status, _ in answers} != {200}:
                    raise RuntimeError("a concurrent cold GET failed")
                downloads.append(float(len(registry.archive_requests()) - before))
                # Throughput from a replica whose hot copy is cold, then warm. The herd
                # left hot copies on every replica: drop replica 2's.
                proxies[2].stop()
                for copy in (proxies[2].cache_dir / "s3").rglob("*.zip~*"):
                    copy.unlink()
                proxies[2].start()
                cold_mbs.append(size / 2**20 / _timed(proxies[2], path))
                warm_mbs.append(size / 2**20 / statistics.median(
                    _timed(proxies[2], path) for _ in range(3)))
                takeovers.append(_takeover(registry, server, bucket, proxies, slow_path))
    finally:
        weed.stop()
        registry.stop()
        stop_agent(signer)
        stop_agent(impostor)
    return _section(quick, size, runs, load, downloads, cold_mbs, warm_mbs, takeovers)


def _takeover(registry: FakeRegistry, server: S3Server, bucket: str,
              proxies: list[ProxyProcess], path: str) -> float:
    """Seconds from killing the replica that fills path to the first survivor's answer."""
    registry.faults.add("holdzip")
    try:
        with ThreadPoolExecutor(6) as pool:
            pending = [(proxy, pool.submit(fetch, proxy, path))
                       for proxy in proxies for _ in range(2)]
            deadline = time.monotonic() + 30
            while (holder := lease_holder(server, bucket)) is None:
                if time.monotonic() > deadline:
                    raise RuntimeError("no replica took the fill lease")
                time.sleep(0.02)
            pid = int(re.findall(r"pid (\d+)", holder)[0])
            [filler] = [p for p in proxies if p.process is not None and p.process.pid == pid]
            assert filler.process is not None
            filler.process.kill()
            filler.process.wait()
            killed = time.monotonic()
            registry.faults.discard("holdzip")
            first = min(_answered_at(answer.result) for proxy, answer in pending
                        if proxy is not filler)
            return first - killed
    finally:
        registry.faults.discard("holdzip")


def _answered_at(result: Callable[[], tuple[int, bytes]]) -> float:
    status, _ = result()
    if status != 200:
        raise RuntimeError(f"a waiting client got HTTP {status}")
    return time.monotonic()


def _section(quick: bool, size: int, runs: int, load: tuple[float, float, float],
             downloads: list[float], cold: list[float], warm: list[float],
             takeovers: list[float]) -> str:
    def span(values: list[float], fmt: str) -> str:
        return (f"{fmt.format(statistics.median(values))} (min {fmt.format(min(values))}, "
                f"max {fmt.format(max(values))})")
    return "\n".join([
        "## Replicas on S3",
        "",
        f"{time.strftime('%Y-%m-%d')}, {platform.node()} ({platform.machine()}, "
        f"{os.cpu_count() or 1} cores). Three proxy "
        f"processes on one SeaweedFS bucket (`weed mini` on loopback), each with an empty "
        f"cache.dir; a {size >> 20} MiB package; {runs} run(s){' (--quick)' if quick else ''}; "
        f"cache.lease_seconds = {LEASE_SECONDS:g}.",
        "",
        f"The machine was {idle_line(load)}",
        "",
        "| figure | median (min, max) |",
        "| --- | --- |",
        f"| upstream downloads, 100 concurrent cold GETs over 3 replicas | "
        f"{span(downloads, '{:.0f}')} |",
        f"| archive from a replica whose hot copy is cold (fetched from the bucket), MiB/s | "
        f"{span(cold, '{:.0f}')} |",
        f"| archive from a replica whose hot copy is warm, MiB/s | {span(warm, '{:.0f}')} |",
        f"| takeover of a killed replica's fill: kill to first waiter served, s | "
        f"{span(takeovers, '{:.1f}')} |",
        "",
        "The takeover includes waiting for the lease to expire (at most lease_seconds after "
        "its last renewal) and the new download.",
        "",
    ])

