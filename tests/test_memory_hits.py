"""Metadata hits are answered from memory: no index read, the same bytes with a strong ETag,
304 for a client that holds them; a fill that records an h1 shows in the next document."""

from __future__ import annotations

import asyncio
import hashlib

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from proxy.app import create_app
from proxy.config import Config
from proxy.core.models import normalize_hostname
from proxy.protocols import network_mirror
from tests.support.fake_registry import FakeRegistry
from tests.support.metrics import sample
from tests.support.mirror_paths import BASE, ZIP, zip_h1

Client = TestClient[web.Request, web.Application]


async def index_reads(client: Client) -> float:
    """How many metadata index reads the proxy has made so far."""
    exposition = await (await client.get("/metrics")).text()
    found = sample(exposition, "tfproxy_store_operations_total", backend="disk",
                   operation="index_get", outcome="ok")
    assert found is not None, "the index_get series is missing"
    return found


async def test_warm_metadata_hits_read_no_index(client: Client) -> None:
    # Warm: the list, a document with no h1 yet (incomplete), one zip (adds its h1).
    assert (await client.get(f"{BASE}/index.json")).status == 200
    assert (await client.get(f"{BASE}/3.2.1.json")).status == 200
    assert (await (await client.get(f"{BASE}/{ZIP}")).read())[:2] == b"PK"
    # The h1 is recorded by the fill just after the last byte (or by the next document):
    # once the document shows it, the next build is the one kept.
    for _ in range(50):
        document = await (await client.get(f"{BASE}/3.2.1.json")).json()
        if len(document["archives"]["linux_amd64"]["hashes"]) == 2:
            break
        await asyncio.sleep(0.1)
    assert (await client.get(f"{BASE}/3.2.1.json")).status == 200
    before = await index_reads(client)
    for _ in range(3):
        for path in ("index.json", "3.2.1.json"):
            response = await client.get(f"{BASE}/{path}")
            assert response.status == 200
            await response.read()
    assert await index_reads(client) == before


async def test_metadata_answers_carry_a_strong_etag_and_304_when_held(client: Client) -> None:
    for path in ("index.json", "3.2.1.json"):
        response = await client.get(f"{BASE}/{path}")
        assert response.status == 200
        body = await response.read()
        etag = response.headers.get("ETag")
        assert etag == f'"{hashlib.sha256(body).hexdigest()}"'
        again = await client.get(f"{BASE}/{path}", headers={"If-None-Match": etag})
        assert again.status == 304
        assert again.headers.get("ETag") == etag
        assert await again.read() == b""
        other = await client.get(f"{BASE}/{path}", headers={"If-None-Match": '"other"'})
        assert other.status == 200
        assert await other.read() == body


async def test_a_fill_that_records_the_h1_changes_the_next_version_document(
        client: Client, registry: FakeRegistry) -> None:
    release = registry.releases[("hashicorp", "null", "3.2.1")]
    before = await client.get(f"{BASE}/3.2.1.json")
    assert (await before.json())["archives"]["linux_amd64"]["hashes"] == [
        f"zh:{release.sha256('linux_amd64')}"]
    # Held in memory now: answered again as it is.
    held = await client.get(f"{BASE}/3.2.1.json")
    assert held.headers.get("ETag") == before.headers.get("ETag") is not None

    assert await (await client.get(f"{BASE}/{ZIP}")).read() == release.zips["linux_amd64"]
    after = await client.get(f"{BASE}/3.2.1.json")
    assert (await after.json())["archives"]["linux_amd64"]["hashes"] == [
        zip_h1(release.zips["linux_amd64"]), f"zh:{release.sha256('linux_amd64')}"]
    assert after.headers.get("ETag") not in (None, before.headers.get("ETag"))
    stale = await client.get(f"{BASE}/3.2.1.json",
                             headers={"If-None-Match": before.headers["ETag"]})
    assert stale.status == 200


async def test_an_h1_recorded_by_another_process_shows_within_the_bound(
        aiohttp_client, proxy_config: Config, registry: FakeRegistry,  # type: ignore[no-untyped-def]
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(network_mirror, "INCOMPLETE_DOCUMENT_SECONDS", 0.5, raising=False)
    first: Client = await aiohttp_client(create_app(proxy_config))
    second: Client = await aiohttp_client(create_app(proxy_config))  # the same store
    release = registry.releases[("hashicorp", "null", "3.2.1")]
    before = await first.get(f"{BASE}/3.2.1.json")
    assert before.status == 200
    assert before.headers.get("ETag") is not None
    assert await (await second.get(f"{BASE}/{ZIP}")).read() == release.zips["linux_amd64"]
    deadline = asyncio.get_running_loop().time() + 5.0
    while True:
        after = await first.get(f"{BASE}/3.2.1.json")
        hashes = (await after.json())["archives"]["linux_amd64"]["hashes"]
        if len(hashes) == 2:
            break
        assert asyncio.get_running_loop().time() < deadline, "the h1 never showed"
        await asyncio.sleep(0.1)
    assert hashes[0] == zip_h1(release.zips["linux_amd64"])
    assert after.headers.get("ETag") not in (None, before.headers.get("ETag"))


def test_hostname_normalization_is_remembered() -> None:
    normalize_hostname("Registry.Example.COM:8443")
    hits = normalize_hostname.cache_info().hits
    assert normalize_hostname("Registry.Example.COM:8443") == "registry.example.com:8443"
    assert normalize_hostname.cache_info().hits == hits + 1
