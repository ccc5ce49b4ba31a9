"""The cache commands beside a proxy that is serving: a download in flight survives a verify
and a prune that removes the very file being sent, hits meanwhile are answered right, and no
record is left vouching for a blob that went."""

from __future__ import annotations

import hashlib
import ssl
import threading
from collections.abc import Callable
from pathlib import Path

from tests.support.cache_cli import NULL, disk_index, fill, wait_for_h1
from tests.support.fake_registry import FakeRegistry
from tests.support.proxy_process import ProxyProcess, free_port
from tests.support.raw_http import PausedDownload

LARGE = "registry.terraform.io/hashicorp/large"


def _records_without_blobs(cache: Path) -> list[str]:
    """Records that vouch for a stored file (a package's with its size, a module archive's)
    whose file is not there."""
    index = disk_index(cache)
    try:
        missing = []
        for key in index.iterkeys():
            record = index.get(key)
            if key.startswith("package/") and record.get("size") is not None:
                _kind, host, namespace, type_, version, platform = key.split("/")
                blob = (f"archives/{host}/{namespace}/{type_}/{version}/"
                        f"terraform-provider-{type_}_{version}_{platform}.zip")
            elif key.startswith("module-archive/"):
                blob = f"modules/{key.removeprefix('module-archive/')}.tar.gz"
            else:
                continue
            if not (cache / blob).is_file():
                missing.append(key)
        return missing
    finally:
        index.close()


def test_verify_and_prune_beside_a_serving_proxy_break_no_download(
        tmp_path: Path, write_config: Callable[..., Path], registry: FakeRegistry) -> None:
    release = registry.add_large_release("hashicorp", "large", "1.0.0", 16 << 20)
    whole = release.zips["linux_amd64"]
    path = f"/mirror/{LARGE}/{release.filename('linux_amd64')}"
    cache, port = tmp_path / "cache", free_port()
    with ProxyProcess(write_config(cache_dir=cache, port=port), cache, port,
                      tmp_path / "proxy.log") as proxy:
        assert proxy.get(path) == whole
        fetched = fill(proxy, registry)
        wait_for_h1(cache, fetched)
        stop = threading.Event()
        failures: list[str] = []

        def hits() -> None:  # other clients, all along: refetched or not, right bytes
            while not stop.is_set():
                try:
                    if proxy.get(f"/mirror/{NULL}/terraform-provider-null_3.2.1_"
                                 "linux_amd64.zip") != fetched[0].data:
                        failures.append("wrong bytes")
                except OSError as exc:
                    failures.append(repr(exc))

        hitting = threading.Thread(target=hits)
        hitting.start()
        try:
            paused = PausedDownload("127.0.0.1", port, path,
                                    ssl.create_default_context(cafile=str(proxy.ca_file)))
            verified = proxy.cli("cache", "verify")
            assert verified.returncode == 0, verified.stdout + verified.stderr
            assert "verify: 5 good" in verified.stdout
            pruned = proxy.cli("cache", "prune", "hashicorp/large")
            assert pruned.returncode == 0, pruned.stderr
            assert f"removed archives/{LARGE}/1.0.0/" in pruned.stdout
            status, body = paused.finish()
            emptied = proxy.cli("cache", "prune", "--to-size", "0")
            assert emptied.returncode == 0, emptied.stderr
        finally:
            stop.set()
            hitting.join()
        assert status == 200
        assert hashlib.sha256(body).digest() == hashlib.sha256(whole).digest()
        assert failures == []
        assert _records_without_blobs(cache) == []
        registry.requests.clear()
        assert proxy.get(path) == whole  # fetched again
        assert registry.archive_requests()
