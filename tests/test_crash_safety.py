"""kill -9 in the middle of downloads, restart: nothing partial or unverified is served."""

from __future__ import annotations

import http.client
import ssl
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from tests.support.fake_registry import FakeRegistry
from tests.support.proxy_process import ProxyProcess, free_port

PLATFORMS = ("linux_amd64", "darwin_arm64", "windows_amd64")


def fetch(proxy: ProxyProcess, platform: str) -> bytes:
    context = ssl.create_default_context(cafile=str(proxy.ca_file))
    url = (f"{proxy.url}mirror/registry.terraform.io/hashicorp/null/"
           f"terraform-provider-null_3.2.1_{platform}.zip")
    with urllib.request.urlopen(url, context=context, timeout=30) as response:
        return bytes(response.read())


def test_sigkill_during_fills_then_restart_is_clean(
        tmp_path: Path, write_config: Callable[..., Path], registry: FakeRegistry) -> None:
    port = free_port()
    cache = tmp_path / "cache"
    config = write_config(cache_dir=cache, port=port)
    proxy = ProxyProcess(config, cache, port, tmp_path / "proxy.log").start()
    registry.faults.add("slowzip")

    completed: list[str] = []

    def doomed(platform: str) -> None:
        try:
            fetch(proxy, platform)
            completed.append(platform)
        except (OSError, http.client.HTTPException):
            pass  # the proxy dies under it: the body is cut short

    clients = [threading.Thread(target=doomed, args=(p,)) for p in PLATFORMS]
    for client in clients:
        client.start()
    deadline = time.monotonic() + 20
    while not any(p.stat().st_size > 0 for p in (cache / "tmp").rglob("*.part")):
        assert time.monotonic() < deadline, "no download started"
        time.sleep(0.01)
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
        for platform in PLATFORMS:
            assert fetch(restarted, platform) == release.zips[platform]
    assert len(registry.archive_requests()) == len(PLATFORMS)
