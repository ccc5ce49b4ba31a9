"""The cache commands on the S3 backend (a real SeaweedFS server): list what a proxy process
stored in the bucket, verify it and drop an object damaged in the bucket (fetched again on the
next request), prune by pattern and by size (the order by last use is tested on disk)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.support.cache_cli import (
    expected,
    fill,
    listed,
    no_escapes,
    s3_environment,
    s3_table,
)
from tests.support.fake_registry import FakeRegistry
from tests.support.proxy_process import ProxyProcess, free_port
from tests.support.seaweedfs import S3Server

PREFIX = "tfproxy/"  # where the backend keeps its objects in the bucket


def test_list_verify_and_prune_on_s3(tmp_path: Path, write_config: Callable[..., Path],
                                     registry: FakeRegistry, s3_server: S3Server) -> None:
    bucket = s3_server.new_bucket()
    cache, port = tmp_path / "cache", free_port()
    config = write_config(cache_dir=cache, port=port, extra=s3_table(s3_server, bucket))
    objects: Any = s3_server.client()
    with ProxyProcess(config, cache, port, tmp_path / "proxy.log",
                      env=s3_environment(s3_server)) as proxy:
        fetched = fill(proxy, registry)
        _null_linux, null_darwin, _random, module = fetched
        result = proxy.cli("cache", "list", "--json")
        no_escapes(result)
        assert listed(result) == expected(fetched)
        assert "bucket " + bucket in proxy.cli("cache", "stats").stdout

        good = proxy.cli("cache", "verify")
        assert good.returncode == 0, good.stdout + good.stderr
        assert "verify: 4 good" in good.stdout

        key = PREFIX + null_darwin.key
        body = objects.get_object(Bucket=bucket, Key=key)["Body"].read()
        objects.put_object(Bucket=bucket, Key=key, Body=body[:-8] + bytes(8))  # bit rot
        bad = proxy.cli("cache", "verify")
        no_escapes(bad)
        assert bad.returncode == 1, bad.stdout + bad.stderr
        assert f"BAD {null_darwin.key}: the stored file (the object in the bucket) has " \
            "sha256" in bad.stdout
        assert "1 bad (1 dropped" in bad.stdout
        assert objects.list_objects_v2(Bucket=bucket, Prefix=key).get("KeyCount") == 0
        registry.requests.clear()
        assert proxy.get(f"/mirror/{null_darwin.address}/terraform-provider-null_3.2.1_"
                         "darwin_arm64.zip") == null_darwin.data
        assert registry.archive_requests(), "the dropped package was not fetched again"

        dry = proxy.cli("cache", "prune", "--to-size", "0", "--dry-run")
        assert dry.returncode == 0, dry.stderr
        assert listed(proxy.cli("cache", "list", "--json")) == expected(fetched)
        by_filter = proxy.cli("cache", "prune", "acme/tarball")
        assert f"removed {module.key}" in by_filter.stdout, by_filter.stdout + by_filter.stderr
        by_size = proxy.cli("cache", "prune", "hashicorp/*", "--to-size", "0")
        assert by_size.returncode == 0, by_size.stderr
        assert by_size.stdout.splitlines()[-1].startswith(
            "prune: removed 3 least recently used blobs and 3 records")
        assert listed(proxy.cli("cache", "list", "--json")) == set()
        assert objects.list_objects_v2(Bucket=bucket, Prefix=PREFIX + "archives/") \
            .get("KeyCount") == 0
