"""kill -9 in the middle of downloads, restart: nothing partial or unverified is served."""

from __future__ import annotations

import http.client
import ssl
import threading
import urllib.request
from collections.abc import Callable
from pathlib import Path

from tests.support.fake_registry import DEFAULT_PLATFORMS, FakeRegistry
from tests.support.mirror_paths import archive_path
from tests.support.proxy_process import ProxyProcess, free_port


def test_sigkill_during_fills_then_restart_is_clean(
        tmp_path: Path, write_config: Callable[..., Path], registry: FakeRegistry) -> None:
    port = free_port()
    cache = tmp_path / "cache"
    config = write_config(cache_dir=cache, port=port)
    proxy = ProxyProcess(config, cache, port, tmp_path / "proxy.log").start()
    registry.faults.add("slowzip")

    completed: list[str] = []
    receiving = threading.Semaphore(0)
    tls = ssl.create_default_context(cafile=str(proxy.ca_file))

    def doomed(platform: str) -> None:
        try:
            with urllib.request.urlopen(proxy.url + archive_path(platform).lstrip("/"),
                                        context=tls, timeout=30) as response:
                response.read(1)  # the download is under way: its first bytes came
                receiving.release()
                response.read()
            completed.append(platform)
        except (OSError, http.client.HTTPException):
            pass  # the proxy dies under it: the body is cut short

    clients = [threading.Thread(target=doomed, args=(p,)) for p in DEFAULT_PLATFORMS]
    for client in clients:
        client.start()
    for _ in clients:
        assert receiving.acquire(timeout=20), "a download did not start"
    assert proxy.process is not None
    proxy.process.kill()
    proxy.process.wait()
    for client in clients:
        client.join(timeout=30)

    assert completed == []                                  # no client took a cut body
    assert list((cache / "tmp").rglob("*.part"))           # it really died mid-download
    assert not list((cache / "archives").rglob("*.zip"))   # and published nothing

    registry.faults.clear()
    registry.requests.clear()
    with ProxyProcess(config, cache, port, tmp_path / "proxy2.log") as restarted:
        assert list((cache / "tmp").rglob("*.part")) == []  # leftovers swept at start
        release = registry.releases[("hashicorp", "null", "3.2.1")]
        for platform in DEFAULT_PLATFORMS:
            assert restarted.get(archive_path(platform)) == release.zips[platform]
    assert len(registry.archive_requests()) == len(DEFAULT_PLATFORMS)
