"""The fleet keeps the single box's promise, tried as an operator would: real proxy processes
on a real S3 server (SeaweedFS). A replica's damaged hot copy is never served and never takes
the bucket's object with it; an object replaced in the bucket is refused; a lease nobody can
read is taken over; a stopped store shows within seconds without traffic while every replica
stays ready and serves what it holds; concurrent readiness probes do not trip each other."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.support.cache_cli import s3_environment
from tests.support.fake_registry import FakeRegistry
from tests.support.metrics import sample, total
from tests.support.mirror_paths import BASE, ZIP
from tests.support.proxy_process import ProxyProcess, free_port
from tests.support.s3_replicas import fetch, s3_table
from tests.support.seaweedfs import S3Server, WeedMini

PREFIX = "tfproxy/"
KEY = f"archives/registry.terraform.io/hashicorp/null/3.2.1/{ZIP}"
LEASE = f"{PREFIX}index/leases/registry.terraform.io/hashicorp/null/3.2.1/linux_amd64"
UPSTREAM_ZIP = f"/files/hashicorp/null/3.2.1/{ZIP}"


def replica(tmp_path: Path, write_config: Callable[..., Path], server: S3Server, bucket: str,
            name: str = "replica", extra: str = "", env: dict[str, str] | None = None
            ) -> ProxyProcess:
    """A proxy process on the bucket, its hot copies under a cache.dir of its own."""
    port, cache = free_port(), tmp_path / name
    config = write_config(cache_dir=cache, port=port, extra=extra + s3_table(server, bucket))
    config = config.rename(tmp_path / f"{name}.toml")
    return ProxyProcess(config, cache, port, tmp_path / f"{name}.log",
                        env={**s3_environment(server), **(env or {})})


def hot_copy(proxy: ProxyProcess) -> Path:
    """The one hot copy of the package under the replica's cache.dir."""
    [found] = (proxy.cache_dir / "s3" / Path(KEY).parent).glob(ZIP + "~*")
    return found


def bucket_object(server: S3Server, bucket: str) -> bytes | None:
    client: Any = server.client()
    try:
        return bytes(client.get_object(Bucket=bucket, Key=PREFIX + KEY)["Body"].read())
    except client.exceptions.NoSuchKey:
        return None


def downloads(registry: FakeRegistry) -> int:
    return registry.archive_requests().count(UPSTREAM_ZIP)


@pytest.fixture
def whole(registry: FakeRegistry) -> bytes:
    return registry.releases[("hashicorp", "null", "3.2.1")].zips["linux_amd64"]


DAMAGE = {"in place": lambda data: bytes(len(data)), "truncated": lambda data: data[:-1000],
          "emptied": lambda _data: b""}


def test_a_damaged_hot_copy_is_never_served_before_or_after_a_restart(
        tmp_path: Path, write_config: Callable[..., Path], registry: FakeRegistry,
        s3_server: S3Server, whole: bytes) -> None:
    bucket = s3_server.new_bucket()
    proxy = replica(tmp_path, write_config, s3_server, bucket)
    with proxy:
        assert fetch(proxy, f"{BASE}/{ZIP}") == (200, whole)  # the fill: its hot copy
        for how, damage in DAMAGE.items():
            copy = hot_copy(proxy)
            time.sleep(0.02)  # a write in the same clock tick could keep the mtime
            copy.write_bytes(damage(whole))
            assert fetch(proxy, f"{BASE}/{ZIP}") == (200, whole), how
            assert hot_copy(proxy).read_bytes() == whole, how  # fetched again from the bucket
        log = proxy.log.read_text()
        assert log.count("integrity failure (hot_copy)") == len(DAMAGE)
        metrics = proxy.get("/metrics").decode()
        assert sample(metrics, "tfproxy_integrity_failures_total", kind="hot_copy") == 3
        hot_copy(proxy).write_bytes(b"")  # damaged while the replica is down
    with proxy:  # restarted
        assert fetch(proxy, f"{BASE}/{ZIP}") == (200, whole)
    assert downloads(registry) == 1  # from the bucket every time, never from upstream
    assert bucket_object(s3_server, bucket) == whole


def test_cache_verify_drops_a_damaged_hot_copy_alone_and_names_it(
        tmp_path: Path, write_config: Callable[..., Path], registry: FakeRegistry,
        s3_server: S3Server, whole: bytes) -> None:
    bucket = s3_server.new_bucket()
    proxy = replica(tmp_path, write_config, s3_server, bucket,
                    env={"TF_REGISTRY_PROXY_SERVER_AUDIT_LOG": str(tmp_path / "audit.log")})
    with proxy:
        assert fetch(proxy, f"{BASE}/{ZIP}") == (200, whole)
        copy = hot_copy(proxy)
        time.sleep(0.02)
        copy.write_bytes(bytes(len(whole)))  # same size, other bytes
        verified = proxy.cli("cache", "verify")
        assert verified.returncode == 1, verified.stdout + verified.stderr
        assert f"BAD {KEY}: the local hot copy has sha256" in verified.stdout
        assert "the object in the bucket read back intact, and stays" in verified.stdout
        assert bucket_object(s3_server, bucket) == whole  # every replica keeps the package
        audit = [json.loads(line) for line in (tmp_path / "audit.log").read_text().splitlines()]
        [dropped] = [line for line in audit if line["event"] == "dropped"]
        assert dropped["copy"] == "local" and "the local hot copy" in dropped["reason"]
        page = json.loads(proxy.get("/status.json"))
        assert [failure["kind"] for failure in page["integrity_failures"]] == ["hot_copy"]
        # The bucket's objects themselves: intact.
        objects = proxy.cli("cache", "verify", "--objects")
        assert objects.returncode == 0, objects.stdout + objects.stderr
        assert "verify: 1 good" in objects.stdout
        registry.requests.clear()
        assert fetch(proxy, f"{BASE}/{ZIP}") == (200, whole)
    assert registry.archive_requests() == []


def test_cache_verify_objects_reads_the_bucket_itself_and_deletes_a_damaged_object(
        tmp_path: Path, write_config: Callable[..., Path], registry: FakeRegistry,
        s3_server: S3Server, whole: bytes) -> None:
    bucket = s3_server.new_bucket()
    proxy = replica(tmp_path, write_config, s3_server, bucket)
    with proxy:
        assert fetch(proxy, f"{BASE}/{ZIP}") == (200, whole)
    hot_copy(proxy).unlink()
    client: Any = s3_server.client()
    client.put_object(Bucket=bucket, Key=PREFIX + KEY, Body=bytes(len(whole)))  # bit rot
    verified = proxy.cli("cache", "verify", "--objects")
    assert verified.returncode == 1, verified.stdout + verified.stderr
    assert f"BAD {KEY}: the stored file has sha256" in verified.stdout
    assert bucket_object(s3_server, bucket) is None  # its own bytes failed: deleted
    # Read from the bucket, not through a hot copy.
    assert not list((proxy.cache_dir / "s3" / Path(KEY).parent).glob(ZIP + "~*"))


@pytest.mark.parametrize("mode", ["online", "offline"])
def test_an_object_replaced_in_the_bucket_is_refused(
        tmp_path: Path, write_config: Callable[..., Path], registry: FakeRegistry,
        s3_server: S3Server, whole: bytes, mode: str) -> None:
    bucket = s3_server.new_bucket()
    filler = replica(tmp_path, write_config, s3_server, bucket, "filler")
    with filler:
        assert fetch(filler, f"{BASE}/{ZIP}") == (200, whole)
    client: Any = s3_server.client()
    client.put_object(Bucket=bucket, Key=PREFIX + KEY, Body=whole[:-8] + bytes(8))
    reader = replica(tmp_path, write_config, s3_server, bucket, "reader",
                     env={"TF_REGISTRY_PROXY_UPSTREAM_MODE": mode})
    with reader:
        status, body = fetch(reader, f"{BASE}/{ZIP}")
        if mode == "online":
            assert (status, body) == (200, whole)  # refused, then filled again from upstream
            assert downloads(registry) == 2
            assert bucket_object(s3_server, bucket) == whole
        else:
            assert status == 502, body
            assert "damaged" in json.loads(body)["errors"][0]
            assert bucket_object(s3_server, bucket) is None  # its own bytes failed
            assert downloads(registry) == 1


def test_a_lease_nobody_can_read_is_taken_over_within_its_duration_and_a_poll(
        tmp_path: Path, write_config: Callable[..., Path], registry: FakeRegistry,
        s3_server: S3Server, whole: bytes) -> None:
    bucket = s3_server.new_bucket()
    client: Any = s3_server.client()
    client.put_object(Bucket=bucket, Key=LEASE, Body=b'{"owner": "gone", "hold')  # cut short
    proxy = replica(tmp_path, write_config, s3_server, bucket,
                    env={"TF_REGISTRY_PROXY_CACHE_LEASE_SECONDS": "2"})
    with proxy:
        assert fetch(proxy, f"{BASE}/3.2.1.json")[0] == 200
        before = total(proxy.get("/metrics").decode(), "tfproxy_store_operations_total")
        assert before
        started = time.monotonic()
        assert fetch(proxy, f"{BASE}/{ZIP}") == (200, whole)
        waited = time.monotonic() - started
        metrics = proxy.get("/metrics").decode()
        after = total(metrics, "tfproxy_store_operations_total")
        assert after
    assert 2 <= waited < 2 + 0.25 + 1.5, waited  # the duration, a poll, the fill itself
    assert (after - before) / waited < 20  # the wait backs off: no loop of requests
    assert sample(metrics, "tfproxy_fill_leases_total", outcome="taken_over") == 1


@pytest.fixture
def weed() -> Iterator[WeedMini]:
    """An S3 server of this test's own, to stop in the middle of it."""
    server = WeedMini()
    try:
        yield server
    finally:
        server.stop()


def test_a_stopped_store_shows_within_seconds_while_every_replica_stays_ready_and_serves(
        tmp_path: Path, write_config: Callable[..., Path], registry: FakeRegistry,
        weed: WeedMini, whole: bytes) -> None:
    server = weed.start()
    bucket = server.new_bucket()
    proxy = replica(tmp_path, write_config, server, bucket)
    with proxy:
        assert fetch(proxy, f"{BASE}/{ZIP}") == (200, whole)
        assert sample(proxy.get("/metrics").decode(), "tfproxy_store_up", backend="s3") == 1
        weed.stop(remove=False)
        stopped = time.monotonic()
        while json.loads(proxy.get("/status.json"))["cache"]["store"]["reachable"]:
            assert time.monotonic() - stopped < 10, "the outage did not show within 10 s"
            time.sleep(0.2)
        assert sample(proxy.get("/metrics").decode(), "tfproxy_store_up", backend="s3") == 0
        ready = fetch(proxy, "/readyz")
        assert ready[0] == 200 and json.loads(ready[1])["status"] == "degraded"
        assert "object store" in json.loads(ready[1])["problem"]
        assert "object store is unreachable" in proxy.get("/").decode()  # the status page
        assert fetch(proxy, f"{BASE}/{ZIP}") == (200, whole)  # the hot copy serves
        miss = fetch(proxy, f"{BASE}/terraform-provider-null_3.2.1_darwin_arm64.zip")
        assert miss[0] == 503 and "object store" in json.loads(miss[1])["errors"][0]


def test_concurrent_readiness_probes_all_answer_200(
        tmp_path: Path, write_config: Callable[..., Path], registry: FakeRegistry) -> None:
    port, cache = free_port(), tmp_path / "cache"
    with ProxyProcess(write_config(cache_dir=cache, port=port), cache, port,
                      tmp_path / "proxy.log") as proxy, ThreadPoolExecutor(50) as pool:
        for _ in range(4):  # Kubernetes, a load balancer and monitoring, at once
            answers = list(pool.map(lambda _n: fetch(proxy, "/readyz"), range(50)))
            assert [status for status, _ in answers] == [200] * 50, answers
