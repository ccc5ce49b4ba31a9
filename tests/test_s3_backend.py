"""The proxy on the S3 backend (cache.s3), against a real S3 server: replicas share what one
of them filled, hits keep being served while the bucket is unreachable (misses get a 503),
archives may be answered with a redirect to a presigned URL, and the settings."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp.test_utils import TestClient

from proxy.app import create_app
from proxy.config import Config, ConfigError, load_config
from proxy.config.settings import S3Config
from tests.support.fake_registry import FakeRegistry
from tests.support.metrics import sample
from tests.support.mirror_paths import BASE, ZIP, archive_path
from tests.support.proxy_process import free_port
from tests.support.seaweedfs import S3Server, WeedMini
from tests.support.stores import s3_cache_config, use_s3_credentials


def on_s3(config: Config, server: S3Server, bucket: str, cache_dir: Path,
          serve: str = "stream") -> Config:
    """config with its cache in bucket, hot copies under cache_dir."""
    return dataclasses.replace(config, cache=s3_cache_config(server, bucket, cache_dir,
                                                              serve=serve))


@pytest.fixture
def weed() -> Iterator[WeedMini]:
    """An S3 server of this test's own, to stop in the middle of it."""
    server = WeedMini()
    try:
        yield server
    finally:
        server.stop()


async def test_a_second_replica_with_an_empty_cache_dir_serves_a_fill_without_upstream(
        aiohttp_client, proxy_config: Config, registry: FakeRegistry,  # type: ignore[no-untyped-def]
        s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    use_s3_credentials(s3_server, monkeypatch)
    bucket = s3_server.new_bucket()
    whole = registry.releases[("hashicorp", "null", "3.2.1")].zips["linux_amd64"]
    first: TestClient = await aiohttp_client(create_app(
        on_s3(proxy_config, s3_server, bucket, tmp_path / "first")))
    assert (await first.get(f"{BASE}/3.2.1.json")).status == 200
    filled = await first.get(f"{BASE}/{ZIP}")
    assert filled.status == 200 and await filled.read() == whole
    assert registry.archive_requests()

    registry.requests.clear()
    second: TestClient = await aiohttp_client(create_app(
        on_s3(proxy_config, s3_server, bucket, tmp_path / "second")))
    served = await second.get(f"{BASE}/{ZIP}")
    assert served.status == 200 and await served.read() == whole
    document = await (await second.get(f"{BASE}/3.2.1.json")).json()
    assert document["archives"]["linux_amd64"]["url"] == ZIP
    assert registry.requests == []  # the bucket had the package and what vouches for it
    assert list((tmp_path / "second" / "s3" / "archives").rglob("*.zip~*"))  # a hot copy


async def test_hot_copies_serve_while_the_bucket_is_down_misses_get_503_and_ready_stays(
        aiohttp_client, proxy_config: Config, registry: FakeRegistry,  # type: ignore[no-untyped-def]
        weed: WeedMini, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    server = weed.start()
    use_s3_credentials(server, monkeypatch)
    whole = registry.releases[("hashicorp", "null", "3.2.1")].zips["linux_amd64"]
    client: TestClient = await aiohttp_client(create_app(
        on_s3(proxy_config, server, server.new_bucket(), tmp_path / "cache")))
    assert await (await client.get(f"{BASE}/{ZIP}")).read() == whole
    assert (await client.get("/readyz")).status == 200

    weed.stop(remove=False)
    hit = await client.get(f"{BASE}/{ZIP}")
    assert hit.status == 200 and await hit.read() == whole
    miss = await client.get(archive_path("darwin_arm64"))
    assert miss.status == 503
    assert "object store" in (await miss.json())["errors"][0]
    # Still ready (degraded): the store is every replica's, its hot copies still serve.
    ready = await client.get("/readyz")
    assert ready.status == 200
    assert (await ready.json())["status"] == "degraded"
    assert "object store" in (await ready.json())["problem"]
    exposition = await (await client.get("/metrics")).text()
    assert (sample(exposition, "tfproxy_store_operations_total", backend="s3",
                   operation="head", outcome="unreachable") or 0) >= 1
    assert server.secret_key not in exposition


async def test_redirect_mode_answers_hits_with_a_presigned_url_of_the_object(
        aiohttp_client, proxy_config: Config, registry: FakeRegistry,  # type: ignore[no-untyped-def]
        s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    use_s3_credentials(s3_server, monkeypatch)
    whole = registry.releases[("hashicorp", "null", "3.2.1")].zips["linux_amd64"]
    client: TestClient = await aiohttp_client(create_app(on_s3(
        proxy_config, s3_server, s3_server.new_bucket(), tmp_path / "cache", "redirect")))
    first = await client.get(f"{BASE}/{ZIP}")  # a miss: streamed while it is filled
    assert first.status == 200 and await first.read() == whole
    hit = await client.get(f"{BASE}/{ZIP}", allow_redirects=False)
    assert hit.status == 302
    location = hit.headers["Location"]
    assert location.startswith(s3_server.endpoint_url) and "X-Amz-Signature=" in location
    async with aiohttp.ClientSession() as session:
        async with session.get(location) as fetched:
            assert fetched.status == 200 and await fetched.read() == whole
        async with session.get(location.replace("X-Amz-Expires=900",
                                                "X-Amz-Expires=999")) as tampered:
            assert tampered.status == 403


def test_cache_s3_settings_come_from_the_file_and_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "proxy.toml"
    path.write_text('[cache.s3]\nbucket = "tf-cache"\nendpoint_url = "http://127.0.0.1:9000"\n'
                    'prefix = "team-a"\nserve = "redirect"\n')
    config = load_config(path, environ={})
    assert config.cache.s3 == S3Config(bucket="tf-cache", endpoint_url="http://127.0.0.1:9000",
                                       region="us-east-1", prefix="team-a/", serve="redirect")
    overridden = load_config(path, environ={"TF_REGISTRY_PROXY_CACHE_S3_BUCKET": "other",
                                            "TF_REGISTRY_PROXY_CACHE_S3_REGION": "eu-west-1"})
    assert overridden.cache.s3 is not None
    assert (overridden.cache.s3.bucket, overridden.cache.s3.region) == ("other", "eu-west-1")
    assert load_config(None, environ={}).cache.s3 is None
    only_env = load_config(None, environ={"TF_REGISTRY_PROXY_CACHE_S3_BUCKET": "envbucket"})
    assert only_env.cache.s3 == S3Config(bucket="envbucket")


def test_bad_cache_s3_settings_are_all_reported(tmp_path: Path) -> None:
    path = tmp_path / "proxy.toml"
    path.write_text('[cache.s3]\nbucket = "Not_A_Bucket"\n'
                    'endpoint_url = "https://key:secret@s3.example"\nserve = "proxy"\n'
                    'prefix = "a//b"\naccess_key = "x"\n')
    with pytest.raises(ConfigError) as raised:
        load_config(path, environ={})
    problems = "\n".join(raised.value.problems)
    for key in ("cache.s3.bucket", "cache.s3.endpoint_url", "cache.s3.serve",
                "cache.s3.prefix", "cache.s3.access_key: unknown key"):
        assert key in problems
    assert "secret" not in problems
    path.write_text('[cache.s3]\nregion = "eu-west-1"\n')
    with pytest.raises(ConfigError, match=r"cache.s3.bucket: required"):
        load_config(path, environ={})


def test_serve_on_a_missing_bucket_is_one_clear_line_and_exit_2(
        s3_server: S3Server, write_config: Callable[..., Path], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A typo in cache.s3.bucket is a start-up error naming the bucket, not a traceback and
    not a proxy that answers 503 forever."""
    use_s3_credentials(s3_server, monkeypatch)
    config = write_config(cache_dir=tmp_path / "cache", port=free_port())
    monkeypatch.setenv("TF_REGISTRY_PROXY_CACHE_S3_BUCKET", "no-such-bucket")
    monkeypatch.setenv("TF_REGISTRY_PROXY_CACHE_S3_ENDPOINT_URL", s3_server.endpoint_url)
    monkeypatch.setenv("TF_REGISTRY_PROXY_SERVER_WORKERS", "1")
    started = subprocess.run([sys.executable, "-m", "proxy", "serve", "--config", str(config)],
                             capture_output=True, text=True, timeout=60,
                             env={**os.environ, "HOME": str(tmp_path)})
    assert started.returncode == 2, started.stderr
    assert "Traceback" not in started.stderr
    ours = [line for line in started.stderr.splitlines()
            if line.startswith("tf-registry-proxy:")]
    assert len(ours) == 1 and "no-such-bucket" in ours[0], started.stderr
    assert s3_server.secret_key not in started.stderr
