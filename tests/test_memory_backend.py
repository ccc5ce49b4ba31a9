"""The services on the in-memory storage backend: the same app (create_app), the fake
upstream registry, and nothing stored on disk but spools. What the network mirror and the
module registry promise must not depend on the store being a directory."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

import pytest
from aiohttp.test_utils import TestClient

from proxy.app import create_app
from proxy.config import Config
from proxy.store.memory import open_memory_storage
from tests.support.fake_registry import FakeRegistry
from tests.support.mirror_paths import BASE, ZIP, zip_h1

TARBALL = "/modules/registry.terraform.io/acme/tarball/aws/1.0.0"


@pytest.fixture
async def memory_client(aiohttp_client, proxy_config: Config) -> TestClient:  # type: ignore[no-untyped-def, type-arg]
    return await aiohttp_client(  # type: ignore[no-any-return]
        create_app(proxy_config, open_storage=open_memory_storage))


def stored_on_disk(cache: Path) -> list[Path]:
    """What the disk backend would have written: archives, modules, the index."""
    return [path for area in ("archives", "modules", "index") for path in
            (cache / area).rglob("*")] if cache.exists() else []


async def test_mirror_fills_verifies_and_serves_hits_from_memory(
        memory_client: TestClient, registry: FakeRegistry, proxy_config: Config) -> None:
    whole = registry.releases[("hashicorp", "null", "3.2.1")].zips["linux_amd64"]
    assert await (await memory_client.get(f"{BASE}/index.json")).json() == \
        {"versions": {"3.1.0": {}, "3.2.1": {}}}
    document = await (await memory_client.get(f"{BASE}/3.2.1.json")).json()
    assert document["archives"]["linux_amd64"]["url"] == ZIP
    first = await memory_client.get(f"{BASE}/{ZIP}")
    assert first.status == 200 and await first.read() == whole  # a miss: streamed while filled

    registry.requests.clear()
    hit = await memory_client.get(f"{BASE}/{ZIP}")
    assert hit.status == 200 and await hit.read() == whole
    assert hit.headers["Content-Length"] == str(len(whole))
    assert registry.requests == []  # from the store, not upstream
    # The facts recorded at the fill (size, h1) are in the memory index: the document now
    # carries the h1 of the bytes that were checked.
    again = await (await memory_client.get(f"{BASE}/3.2.1.json")).json()
    assert again["archives"]["linux_amd64"]["hashes"][0] == zip_h1(whole)
    assert stored_on_disk(proxy_config.cache.dir) == []


async def test_a_memory_hit_answers_byte_ranges_and_head(
        memory_client: TestClient, registry: FakeRegistry) -> None:
    whole = registry.releases[("hashicorp", "null", "3.2.1")].zips["linux_amd64"]
    assert await (await memory_client.get(f"{BASE}/{ZIP}")).read() == whole
    part = await memory_client.get(f"{BASE}/{ZIP}", headers={"Range": "bytes=10-99"})
    assert part.status == 206
    assert part.headers["Content-Range"] == f"bytes 10-99/{len(whole)}"
    assert await part.read() == whole[10:100]
    tail = await memory_client.get(f"{BASE}/{ZIP}", headers={"Range": "bytes=-25"})
    assert tail.status == 206 and await tail.read() == whole[-25:]
    open_ended = await memory_client.get(f"{BASE}/{ZIP}",
                                         headers={"Range": f"bytes={len(whole) - 5}-"})
    assert open_ended.status == 206 and await open_ended.read() == whole[-5:]
    outside = await memory_client.get(f"{BASE}/{ZIP}",
                                      headers={"Range": f"bytes={len(whole) + 10}-"})
    assert outside.status == 416
    assert outside.headers["Content-Range"] == f"bytes */{len(whole)}"
    assert "range not satisfiable" in (await outside.json())["errors"][0]
    head = await memory_client.head(f"{BASE}/{ZIP}")
    assert head.status == 200 and head.headers["Content-Length"] == str(len(whole))
    assert head.headers["Accept-Ranges"] == "bytes"


async def test_module_archives_are_packed_into_and_served_from_memory(
        memory_client: TestClient, registry: FakeRegistry, proxy_config: Config) -> None:
    answer = await memory_client.get(f"{TARBALL}/download")
    assert answer.status == 200, await answer.text()
    path = urlsplit((await answer.json())["location"]).path
    first = await memory_client.get(path)
    assert first.status == 200
    packed = await first.read()
    assert packed[:2] == b"\x1f\x8b"  # the repacked .tar.gz
    registry.requests.clear()
    hit = await memory_client.get(path)
    assert hit.status == 200 and await hit.read() == packed
    assert registry.requests == []
    assert stored_on_disk(proxy_config.cache.dir) == []
