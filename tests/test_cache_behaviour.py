"""Offline mode, eviction, and an index that disagrees with the files on disk."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient

from proxy.config import load_config
from tests.support.fake_registry import FakeRegistry
from tests.test_mirror import BASE, ZIP, metric

Make = Callable[..., Awaitable[TestClient]]
MODULE = "/modules/registry.terraform.io/acme/tarball/aws"


def zip_name(platform: str, version: str = "3.2.1") -> str:
    return f"terraform-provider-null_{version}_{platform}.zip"


async def test_offline_mode_serves_the_cache_and_never_contacts_upstream(
        make: Make, registry: FakeRegistry) -> None:
    online = await make()
    assert (await (await online.get(f"{BASE}/{ZIP}")).read())
    location = (await (await online.get(f"{MODULE}/1.0.0/download")).json())["location"]
    await online.close()

    registry.requests.clear()
    offline = await make(upstream_mode="offline", upstream_versions_ttl="0.001")
    await asyncio.sleep(0.01)  # every cached list is past its TTL: still no refresh
    for path in (f"{BASE}/index.json", f"{BASE}/3.2.1.json", f"{BASE}/{ZIP}",
                 f"{MODULE}/versions", f"{MODULE}/1.0.0/download",
                 location.split(":", 2)[2].split("/", 1)[1].join(["/", ""])):
        response = await offline.get(path)
        assert response.status == 200, (path, await response.text())
    # Only what is held: 3.1.0 is not, nor are the other platforms of 3.2.1.
    assert await (await offline.get(f"{BASE}/index.json")).json() == {"versions": {"3.2.1": {}}}
    document = await (await offline.get(f"{BASE}/3.2.1.json")).json()
    assert list(document["archives"]) == ["linux_amd64"]
    for path in (f"{BASE}/3.1.0.json", f"{BASE}/{zip_name('darwin_arm64')}",
                 "/mirror/registry.terraform.io/hashicorp/random/index.json",
                 "/modules/registry.terraform.io/acme/net/aws/versions",
                 "/mirror/registry.opentofu.org/hashicorp/null/index.json"):
        response = await offline.get(path)
        assert response.status == 404, path
        assert "offline" in (await response.json())["errors"][0]
    await asyncio.sleep(0.05)
    assert registry.requests == []


async def test_eviction_keeps_the_cache_under_its_limit(make: Make,
                                                        registry: FakeRegistry) -> None:
    release = registry.releases[("hashicorp", "null", "3.2.1")]
    one = len(release.zips["linux_amd64"])
    client = await make(cache_max_size=str(int(one * 2.5)))
    for platform in ("linux_amd64", "darwin_arm64", "windows_amd64"):
        response = await client.get(f"{BASE}/{zip_name(platform)}")
        assert await response.read() == release.zips[platform]
        await asyncio.sleep(0.02)  # distinct access times
    text = await (await client.get("/metrics")).text()
    assert metric(text, "tfproxy_cache_evictions_total") >= 1
    assert metric(text, "tfproxy_cache_size_bytes") <= one * 2.5
    # The least recently used (linux) went; its verified facts stay, so VERSION.json keeps
    # its h1, and asking for it again fetches it again.
    document = await (await client.get(f"{BASE}/3.2.1.json")).json()
    assert document["archives"]["linux_amd64"]["hashes"][0].startswith("h1:")
    registry.requests.clear()
    response = await client.get(f"{BASE}/{zip_name('linux_amd64')}")
    assert await response.read() == release.zips["linux_amd64"]
    assert len(registry.archive_requests()) == 1


@pytest.mark.parametrize("damage", ["lose the index", "truncate the file"])
async def test_file_without_a_matching_record_is_fetched_again(
        make: Make, registry: FakeRegistry, write_config: Callable[..., Path],
        damage: str) -> None:
    release = registry.releases[("hashicorp", "null", "3.2.1")]
    client = await make()
    assert await (await client.get(f"{BASE}/{ZIP}")).read() == release.zips["linux_amd64"]
    await client.close()
    cache = Path(load_config(write_config(), environ={}).cache.dir)
    stored = next(cache.rglob(ZIP))
    if damage == "lose the index":
        shutil.rmtree(cache / "index")
    else:
        stored.write_bytes(stored.read_bytes()[:-10])

    registry.requests.clear()
    again = await make()
    response = await again.get(f"{BASE}/{ZIP}")
    assert await response.read() == release.zips["linux_amd64"]
    assert len(registry.archive_requests()) == 1
    assert stored.read_bytes() == release.zips["linux_amd64"]
