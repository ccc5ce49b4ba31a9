"""Several proxy processes on one cache directory (separate instances on one volume): the
size limit counts every process's files, and no process evicts a file another is sending."""

from __future__ import annotations

import asyncio
import hashlib
import os
import ssl
import time
from collections.abc import Callable
from pathlib import Path

from proxy.store.archives import ArchiveStore
from tests.support.fake_registry import FakeRegistry
from tests.support.metrics import sample
from tests.support.proxy_process import ProxyProcess, free_port
from tests.support.raw_http import PausedDownload

NULL = "/mirror/registry.terraform.io/hashicorp/null"


def own_config(write_config: Callable[..., Path], cache: Path, port: int) -> Path:
    """A config file of its own for an instance listening on port."""
    written = write_config(cache_dir=cache, port=port)  # always the same file
    own = written.with_name(f"proxy-{port}.toml")
    own.write_text(written.read_text())
    return own


def stored_zips(cache: Path) -> list[Path]:
    return sorted((cache / "archives").rglob("*.zip"))


def test_size_limit_holds_across_instances_sharing_the_cache(
        tmp_path: Path, write_config: Callable[..., Path], registry: FakeRegistry) -> None:
    null = {version: registry.releases[("hashicorp", "null", version)]
            for version in ("3.2.1", "3.1.0")}
    largest = max(len(z) for release in null.values() for z in release.zips.values())
    limit = int(largest * 2.5)
    cache = tmp_path / "cache"
    env = {"TF_REGISTRY_PROXY_CACHE_MAX_SIZE": str(limit)}
    first_port, second_port = free_port(), free_port()
    first = ProxyProcess(own_config(write_config, cache, first_port), cache, first_port,
                         tmp_path / "first.log", env=env)
    second = ProxyProcess(own_config(write_config, cache, second_port), cache, second_port,
                          tmp_path / "second.log", env=env)
    with first, second:
        # Two packages through each: each process wrote less than the limit, together more.
        for proxy, version, platform in ((first, "3.2.1", "linux_amd64"),
                                         (first, "3.2.1", "darwin_arm64"),
                                         (second, "3.2.1", "windows_amd64"),
                                         (second, "3.1.0", "linux_amd64")):
            name = null[version].filename(platform)
            assert proxy.get(f"{NULL}/{name}") == null[version].zips[platform]
        on_disk = [path.stat().st_size for path in stored_zips(cache)]
        assert sum(on_disk) <= limit, f"{sum(on_disk)} bytes on disk, limit {limit}"
        # Either process reports the cache as it is on disk, not only its own writes.
        for proxy in (first, second):
            text = proxy.get("/metrics").decode()
            assert sample(text, "tfproxy_cache_size_bytes") == sum(on_disk)
            assert sample(text, "tfproxy_cache_files") == len(on_disk)


def test_file_another_process_is_sending_is_not_evicted(
        tmp_path: Path, write_config: Callable[..., Path], registry: FakeRegistry) -> None:
    # Larger than what the kernel buffers for one connection: while the client pauses, the
    # proxy is still sending it.
    release = registry.add_large_release("hashicorp", "large", "1.0.0", 16 << 20)
    whole = release.zips["linux_amd64"]
    path = f"/mirror/registry.terraform.io/hashicorp/large/{release.filename('linux_amd64')}"
    cache = tmp_path / "cache"
    port = free_port()
    with ProxyProcess(write_config(cache_dir=cache, port=port), cache, port,
                      tmp_path / "proxy.log") as proxy:
        assert proxy.get(path) == whole  # now stored
        [stored] = stored_zips(cache)
        context = ssl.create_default_context(cafile=str(proxy.ca_file))
        paused = PausedDownload("127.0.0.1", port, path, context)

        # Another process sharing the cache fills three newer files past its limit: the
        # package being sent is the least recently used, and still it must stay.
        other = ArchiveStore(cache, max_size=len(whole) + 2500)
        other.measure()  # as a process does when it starts
        newer = time.time() + 60

        async def fill_others() -> list[Path]:
            placed = []
            for index in range(3):
                temp = other.temp_file()
                temp.write_bytes(b"x" * 1000)
                os.utime(temp, (newer + index, newer + index))
                placed.append(await other.publish(
                    temp, ["archives", "registry.terraform.io", "acme", "other", "1.0.0",
                           f"f{index}.zip"]))
            return placed

        placed = asyncio.run(fill_others())
        other.close()
        assert stored.exists(), "a package being sent was evicted"
        assert [p.exists() for p in placed] == [False, False, True]
        status, body = paused.finish()
        assert status == 200
        assert hashlib.sha256(body).hexdigest() == hashlib.sha256(whole).hexdigest()
