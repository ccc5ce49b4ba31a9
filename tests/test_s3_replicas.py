"""Three real proxy processes on one S3 bucket (a real SeaweedFS), each with an empty cache.dir
of its own: what one filled the others serve without upstream, concurrent misses spread over
them download a package once, and when the replica filling it is killed another takes the
fill over once its lease expires and serves the clients that waited."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.support.fake_registry import FakeRegistry
from tests.support.mirror_paths import BASE, ZIP
from tests.support.proxy_process import ProxyProcess
from tests.support.s3_replicas import fetch, lease_holder, s3_env, s3_replicas, s3_table
from tests.support.seaweedfs import S3Server
from tests.support.terraform import NULL_AND_RANDOM, terraform_env, terraform_init

UPSTREAM_ZIP = f"/files/hashicorp/null/3.2.1/{ZIP}"
LEASE_SECONDS = 3.0
ROOT_MODULE = NULL_AND_RANDOM


@pytest.fixture
def replicas(tmp_path: Path, write_config: Callable[..., Path], s3_server: S3Server
             ) -> Iterator[tuple[list[ProxyProcess], str]]:
    """Three replicas on a fresh bucket (fill leases of LEASE_SECONDS), and the bucket."""
    bucket = s3_server.new_bucket()

    def write(cache: Path, port: int) -> str:
        return write_config(extra=s3_table(s3_server, bucket), cache_dir=cache,
                            port=port).read_text()

    with s3_replicas(tmp_path, 3, write, s3_env(s3_server, LEASE_SECONDS)) as running:
        yield running, bucket


def archive_downloads(registry: FakeRegistry) -> int:
    return registry.archive_requests().count(UPSTREAM_ZIP)


@pytest.mark.e2e
def test_terraform_init_through_each_replica_in_turn_asks_upstream_once(
        tmp_path: Path, replicas: tuple[list[ProxyProcess], str],
        registry: FakeRegistry) -> None:
    null = registry.releases[("hashicorp", "null", "3.2.1")]
    for n, proxy in enumerate(replicas[0]):
        printed = proxy.cli("client-config")
        assert printed.returncode == 0, printed.stderr
        cli_config = tmp_path / f"client-{n}.tfrc"
        cli_config.write_text(printed.stdout)
        workdir = tmp_path / f"work-{n}"
        workdir.mkdir()
        (workdir / "main.tf").write_text(ROOT_MODULE)
        result = terraform_init(workdir, terraform_env(tmp_path / f"home-{n}", cli_config,
                                                       proxy.ca_file))
        assert result.retcode == 0, result.output
        assert "Installed hashicorp/null v3.2.1 (verified checksum)" in result.stdout
        installed = (workdir / ".terraform/providers/registry.terraform.io/hashicorp/null"
                     "/3.2.1/linux_amd64/terraform-provider-null_v3.2.1")
        assert installed.read_bytes() == null.binaries["linux_amd64"]
        if n == 0:
            assert archive_downloads(registry) == 1
            registry.requests.clear()
        else:  # the bucket had the packages and everything that vouches for them
            assert registry.requests == [], f"replica {n} asked upstream"


def test_concurrent_cold_misses_over_three_replicas_download_the_package_once(
        replicas: tuple[list[ProxyProcess], str], registry: FakeRegistry) -> None:
    whole = registry.releases[("hashicorp", "null", "3.2.1")].zips["linux_amd64"]
    proxies = replicas[0]
    for proxy in proxies:  # as Terraform does: the release's document first, then the zip
        assert fetch(proxy, f"{BASE}/3.2.1.json")[0] == 200
    registry.faults.add("holdzip")  # every replica misses while the fill runs
    with ThreadPoolExecutor(100) as pool:
        pending = [pool.submit(fetch, proxies[n % 3], f"{BASE}/{ZIP}") for n in range(100)]
        deadline = time.monotonic() + 20
        while archive_downloads(registry) == 0:
            assert time.monotonic() < deadline, "no replica started the fill"
            time.sleep(0.05)
        time.sleep(2)  # time for the other replicas to start fills of their own, if they do
        registry.faults.discard("holdzip")
        answers = [answer.result(timeout=30) for answer in pending]
    assert [status for status, _ in answers] == [200] * 100
    assert all(body == whole for _, body in answers)
    assert archive_downloads(registry) == 1


def test_a_killed_fillers_lease_is_taken_over_and_its_waiters_served(
        s3_server: S3Server, replicas: tuple[list[ProxyProcess], str],
        registry: FakeRegistry) -> None:
    whole = registry.releases[("hashicorp", "null", "3.2.1")].zips["linux_amd64"]
    proxies, bucket = replicas
    registry.faults.add("holdzip")  # the download hangs after its headers
    with ThreadPoolExecutor(6) as pool:
        waiting: list[tuple[ProxyProcess, Future[tuple[int, bytes]]]] = [
            (proxy, pool.submit(fetch, proxy, f"{BASE}/{ZIP}"))
            for proxy in proxies for _ in range(2)]
        deadline = time.monotonic() + 20
        while archive_downloads(registry) == 0 or lease_holder(s3_server, bucket) is None:
            assert time.monotonic() < deadline, "no replica started the fill"
            time.sleep(0.05)
        holder = lease_holder(s3_server, bucket)
        assert holder is not None
        pid = int(re.findall(r"pid (\d+)", holder)[0])
        [filler] = [proxy for proxy in proxies
                    if proxy.process is not None and proxy.process.pid == pid]
        assert filler.process is not None
        filler.process.kill()  # SIGKILL: no release, no renewal
        filler.process.wait()
        killed_at = time.monotonic()
        registry.faults.discard("holdzip")
        for proxy, answer in waiting:
            if proxy is not filler:
                status, body = answer.result(timeout=30)
                assert (status, body == whole) == (200, True)
        taken_over_after = time.monotonic() - killed_at
    assert archive_downloads(registry) == 2  # the killed fill, and the one that took over
    assert taken_over_after < LEASE_SECONDS + 10
