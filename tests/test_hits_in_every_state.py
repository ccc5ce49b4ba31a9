"""Every metadata answer is a memory hit whatever the state of its document: complete, still
lacking h1s (also past the bound after which it is rebuilt), offline, with signed URLs, and
the providers.v1 and modules.v1 documents. A hit touches neither the metadata index nor the
blob store (both are frozen while it is answered), sends the held bytes with a strong ETag,
and answers If-None-Match with a 304."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
from aiohttp.test_utils import TestClient

from proxy.app import create_app
from proxy.config import load_config
from proxy.protocols import held_documents, network_mirror
from proxy.store import freshness
from proxy.web import url_signing
from tests.support.fake_registry import FakeRegistry
from tests.support.frozen_storage import FreezableStorage
from tests.support.metrics import total
from tests.support.mirror_paths import BASE, ZIP, zip_h1

TOKEN = "client-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
WITH_AUTH = f'[auth]\ntokens = ["{TOKEN}"]\n'
REG = "/providers/registry.terraform.io/hashicorp/null"
MODULE = "/modules/registry.terraform.io/acme/tarball/aws"
PLATFORMS = ("linux_amd64", "darwin_arm64", "windows_amd64")
HIT_SECONDS = 5.0  # a hit that waits for a frozen store never ends: give up after this
Start = Callable[..., Awaitable[tuple[TestClient, FreezableStorage]]]  # type: ignore[type-arg]


@pytest.fixture
def start(aiohttp_client, write_config: Callable[..., Path]) -> Start:  # type: ignore[no-untyped-def]
    """A proxy on freezable storage, with extra config lines and TF_REGISTRY_PROXY_*
    overrides given as keyword arguments."""

    async def build(extra: str = "", **env: str) -> tuple[TestClient, FreezableStorage]:  # type: ignore[type-arg]
        environ = {f"TF_REGISTRY_PROXY_{k.upper()}": v for k, v in env.items()}
        storage = FreezableStorage()
        config = load_config(write_config(extra=extra), environ=environ)
        return await aiohttp_client(create_app(config, storage.open)), storage

    return build


async def store_operations(client: TestClient) -> float:  # type: ignore[type-arg]
    """How many store operations (index and blobs) the proxy has made so far."""
    exposition = await (await client.get("/metrics")).text()
    found = total(exposition, "tfproxy_store_operations_total", backend="disk")
    assert found is not None, "the store operation series are missing"
    return found


async def settled_store_operations(client: TestClient) -> float:  # type: ignore[type-arg]
    """store_operations once it held still for 0.1 s: what fills finished just before (a
    fill lock released after its h1 was recorded) is not counted as the hits' work."""
    seen = await store_operations(client)
    for _ in range(30):
        await asyncio.sleep(0.1)
        now = await store_operations(client)
        if now == seen:
            return now
        seen = now
    pytest.fail("the store never stopped being used")


async def held_answer(client: TestClient, path: str,  # type: ignore[type-arg]
                      headers: dict[str, str] | None = None) -> bytes:
    """Three answers on path with the same bytes and a strong ETag naming them; a 304 with
    that ETag for If-None-Match; the bytes."""
    headers = headers or {}
    bodies, etags = [], []
    for _ in range(3):
        response = await client.get(path, headers=headers)
        assert response.status == 200, (path, await response.text())
        bodies.append(await response.read())
        etags.append(response.headers.get("ETag"))
    assert bodies == [bodies[0]] * 3, path
    assert etags == [f'"{hashlib.sha256(bodies[0]).hexdigest()}"'] * 3, path
    held = await client.get(path, headers={**headers, "If-None-Match": etags[0]})
    assert held.status == 304, path
    assert held.headers.get("ETag") == etags[0]
    assert await held.read() == b""
    return bodies[0]


async def answered_from_memory(client: TestClient, storage: FreezableStorage,  # type: ignore[type-arg]
                               paths: list[str], headers: dict[str, str] | None = None,
                               past_bound: bool = False) -> list[bytes]:
    """The held answers on paths, given while the store is frozen; none of them made a store
    operation (unless past_bound: then the first one had its document rebuilt in the
    background, which waited for the thaw)."""
    before = await settled_store_operations(client)
    storage.freeze()
    try:
        bodies = [await asyncio.wait_for(held_answer(client, path, headers), HIT_SECONDS)
                  for path in paths]
    except TimeoutError:
        pytest.fail("a hit waited for the store")
    finally:
        storage.thaw()
    if not past_bound:
        assert await store_operations(client) == before
    return bodies


async def every_h1_recorded(client: TestClient) -> None:  # type: ignore[type-arg]
    """Fetch every platform's zip of 3.2.1; return once VERSION.json shows every h1."""
    for platform in PLATFORMS:
        zip_name = ZIP.replace("linux_amd64", platform)
        assert (await (await client.get(f"{BASE}/{zip_name}")).read())[:2] == b"PK"
    for _ in range(100):
        archives = (await (await client.get(f"{BASE}/3.2.1.json")).json())["archives"]
        if all(len(archives[p]["hashes"]) == 2 for p in PLATFORMS):
            return
        await asyncio.sleep(0.05)
    pytest.fail("the h1s never showed")


async def test_a_complete_version_document_is_a_memory_hit(start: Start) -> None:
    client, storage = await start()
    await every_h1_recorded(client)
    await answered_from_memory(client, storage, [f"{BASE}/index.json", f"{BASE}/3.2.1.json"])


async def test_a_document_lacking_h1s_is_a_memory_hit_also_past_its_bound(
        start: Start, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(network_mirror, "INCOMPLETE_DOCUMENT_SECONDS", 0.1)
    client, storage = await start()
    # No zip was fetched: every platform lacks its h1.
    document = await (await client.get(f"{BASE}/3.2.1.json")).json()
    assert all(len(document["archives"][p]["hashes"]) == 1 for p in PLATFORMS)
    await answered_from_memory(client, storage, [f"{BASE}/3.2.1.json"])
    await asyncio.sleep(0.2)  # past the bound: answered as held, rebuilt in the background
    await answered_from_memory(client, storage, [f"{BASE}/3.2.1.json"], past_bound=True)


async def test_offline_answers_are_memory_hits_also_past_their_bound(
        start: Start, monkeypatch: pytest.MonkeyPatch, registry: FakeRegistry) -> None:
    online, _ = await start()
    assert (await (await online.get(f"{BASE}/{ZIP}")).read())[:2] == b"PK"
    assert (await online.get(f"{REG}/3.2.1/download/linux/amd64")).status == 200
    assert (await online.get(f"{MODULE}/versions")).status == 200
    await online.close()

    registry.requests.clear()
    paths = [f"{BASE}/index.json", f"{BASE}/3.2.1.json", f"{REG}/versions",
             f"{REG}/3.2.1/download/linux/amd64", f"{MODULE}/versions"]
    client, storage = await start(upstream_mode="offline")
    for path in paths:  # built once: from what the store holds
        assert (await client.get(path)).status == 200, path
    document = await (await client.get(f"{BASE}/3.2.1.json")).json()
    assert list(document["archives"]) == ["linux_amd64"]
    first = await answered_from_memory(client, storage, paths)
    await client.close()

    for module, name in ((network_mirror, "INCOMPLETE_DOCUMENT_SECONDS"),
                         (held_documents, "OFFLINE_DOCUMENT_SECONDS"),
                         (freshness, "OFFLINE_RECHECK_SECONDS")):
        monkeypatch.setattr(module, name, 0.1)
    client, storage = await start(upstream_mode="offline")
    for path in paths:
        assert (await client.get(path)).status == 200, path
    await asyncio.sleep(0.2)  # past the bound: answered as held, rebuilt in the background
    again = await answered_from_memory(client, storage, paths, past_bound=True)
    # The same answers (the download document's URLs name each proxy's own port).
    assert again[:3] + again[4:] == first[:3] + first[4:]
    assert registry.requests == []


async def test_version_documents_with_signed_urls_are_memory_hits(start: Start) -> None:
    client, storage = await start(WITH_AUTH)
    await every_h1_recorded_signed(client)
    incomplete = f"{BASE}/3.1.0.json"  # no zip fetched: no h1 in it
    assert (await client.get(incomplete, headers=AUTH)).status == 200
    bodies = await answered_from_memory(client, storage, [f"{BASE}/3.2.1.json", incomplete],
                                        AUTH)
    assert all(b"sig=" in body for body in bodies)


async def every_h1_recorded_signed(client: TestClient) -> None:  # type: ignore[type-arg]
    """Fetch every platform's zip of 3.2.1 through its signed URL; return once the signed
    VERSION.json shows every h1."""
    document = await (await client.get(f"{BASE}/3.2.1.json", headers=AUTH)).json()
    for platform in PLATFORMS:
        url = document["archives"][platform]["url"]
        assert (await (await client.get(f"{BASE}/{url}")).read())[:2] == b"PK"
    for _ in range(100):
        document = await (await client.get(f"{BASE}/3.2.1.json", headers=AUTH)).json()
        if all(len(document["archives"][p]["hashes"]) == 2 for p in PLATFORMS):
            return
        await asyncio.sleep(0.05)
    pytest.fail("the h1s never showed")


@pytest.mark.parametrize("extra", ["", WITH_AUTH], ids=["anonymous", "signed"])
async def test_providers_v1_answers_are_memory_hits(start: Start, extra: str) -> None:
    client, storage = await start(extra)
    headers = AUTH if extra else {}
    paths = [f"{REG}/versions", f"{REG}/3.2.1/download/linux/amd64"]
    for path in paths:  # the zip is not fetched: its facts carry no h1
        assert (await client.get(path, headers=headers)).status == 200, path
    await answered_from_memory(client, storage, paths, headers)


async def test_module_versions_are_memory_hits(start: Start) -> None:
    client, storage = await start()
    assert (await client.get(f"{MODULE}/versions")).status == 200
    await answered_from_memory(client, storage, [f"{MODULE}/versions"])


# --- signed URLs: each answer carries URLs for its own request, valid for their lifetime ---


async def test_each_spelling_of_a_mirror_path_gets_urls_signed_for_itself(start: Start) -> None:
    client, _ = await start(WITH_AUTH)
    spellings = [BASE, BASE.replace("registry.terraform.io", "Registry.Terraform.IO")]
    urls = []
    for directory in spellings:
        document = await (await client.get(f"{directory}/3.2.1.json", headers=AUTH)).json()
        urls.append(document["archives"]["linux_amd64"]["url"])
    assert urls[0] != urls[1]
    for directory, url in zip(spellings, urls, strict=True):
        assert (await client.get(f"{directory}/{url}")).status == 200
    # A URL signed for one spelling does not open the other: neither was handed the other's.
    assert (await client.get(f"{spellings[1]}/{urls[0]}")).status == 401
    assert (await client.get(f"{spellings[0]}/{urls[1]}")).status == 401


@pytest.mark.parametrize("extra", ["", WITH_AUTH], ids=["anonymous", "signed"])
async def test_each_client_gets_download_urls_on_the_host_it_reached(
        start: Start, extra: str) -> None:
    client, _ = await start(extra)
    headers = AUTH if extra else {}
    for host in ("a.example:8443", "b.example", "a.example:8443"):
        response = await client.get(f"{REG}/3.2.1/download/linux/amd64",
                                    headers={**headers, "Host": host})
        document = await response.json()
        for key in ("download_url", "shasums_url", "shasums_signature_url"):
            assert document[key].startswith(f"https://{host}/"), (host, key)
            assert ("sig=" in document[key]) == bool(extra)


async def test_signed_urls_expire_and_each_expiry_step_signs_anew(
        start: Start, monkeypatch: pytest.MonkeyPatch) -> None:
    client, _ = await start(WITH_AUTH + "signed_url_ttl = 120\n")  # a step of 2 s
    clock = [1_000_000.0]
    monkeypatch.setattr(url_signing, "time", SimpleNamespace(time=lambda: clock[0]))

    async def signed_zip_url() -> tuple[str, str]:
        response = await client.get(f"{BASE}/3.2.1.json", headers=AUTH)
        url = (await response.json())["archives"]["linux_amd64"]["url"]
        expires = int(url.split("expires=")[1].split("&")[0])
        assert clock[0] + 120 - 2 <= expires <= clock[0] + 120  # never beyond the TTL
        return url, response.headers["ETag"]

    first, etag = await signed_zip_url()
    clock[0] += 1  # the same step: the same bytes
    assert await signed_zip_url() == (first, etag)
    held = await client.get(f"{BASE}/3.2.1.json", headers={**AUTH, "If-None-Match": etag})
    assert held.status == 304
    clock[0] += 1  # the next step: signed anew
    second, second_etag = await signed_zip_url()
    assert second != first and second_etag != etag
    assert (await client.get(f"{BASE}/3.2.1.json",
                             headers={**AUTH, "If-None-Match": etag})).status == 200
    assert (await client.get(f"{BASE}/{first}")).status == 200
    clock[0] += 119  # past the first URL's expiry, not the second's
    assert (await client.get(f"{BASE}/{first}")).status == 401
    assert (await client.get(f"{BASE}/{second}")).status == 200
    third, _ = await signed_zip_url()
    assert third not in (first, second)


async def test_a_fill_that_records_the_h1_changes_the_next_signed_document(
        start: Start, registry: FakeRegistry) -> None:
    client, _ = await start(WITH_AUTH)
    release = registry.releases[("hashicorp", "null", "3.2.1")]
    before = await client.get(f"{BASE}/3.2.1.json", headers=AUTH)
    document = await before.json()
    assert len(document["archives"]["linux_amd64"]["hashes"]) == 1
    url = document["archives"]["linux_amd64"]["url"]
    assert await (await client.get(f"{BASE}/{url}")).read() == release.zips["linux_amd64"]
    after = await client.get(f"{BASE}/3.2.1.json", headers=AUTH)
    hashes = (await after.json())["archives"]["linux_amd64"]["hashes"]
    assert hashes == [zip_h1(release.zips["linux_amd64"]), f"zh:{release.sha256('linux_amd64')}"]
    assert after.headers.get("ETag") not in (None, before.headers.get("ETag"))
