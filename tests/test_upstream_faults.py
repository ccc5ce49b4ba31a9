"""A hostile, broken, slow or changing upstream: clear errors, nothing wrong cached."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
from aiohttp.test_utils import TestClient

import proxy.store.freshness
from proxy.config import Config
from proxy.store import spool as store_spool
from tests.support.fake_registry import FakeRegistry
from tests.support.metrics import sample, total
from tests.support.mirror_paths import BASE, ZIP

Make = Callable[..., Awaitable[TestClient]]


async def error_of(response: aiohttp.ClientResponse) -> str:
    assert response.content_type == "application/json"
    return str((await response.json())["errors"][0])


async def test_compressed_answers_are_refused_not_blamed_on_signatures(
        make: Make, registry: FakeRegistry) -> None:
    client = await make()
    registry.faults.add("gzip")
    for path in (f"{BASE}/index.json", f"{BASE}/3.2.1.json"):
        response = await client.get(path)
        assert response.status == 502
        assert "content coding 'gzip'" in await error_of(response)
    text = await (await client.get("/metrics")).text()
    # Every kind there, at 0 (None would be a renamed metric passing for "nothing counted").
    assert total(text, "tfproxy_integrity_failures_total") == 0, text
    assert ("GET", "/v1/providers/hashicorp/null/versions") in registry.requests


async def test_stalled_upstream_is_a_504(make: Make, registry: FakeRegistry) -> None:
    client = await make(upstream_metadata_timeout="0.5")
    registry.faults.add("stall")
    response = await client.get(f"{BASE}/index.json")
    assert response.status == 504
    assert "did not answer in time" in await error_of(response)


async def test_expired_list_is_answered_without_waiting_for_a_stalled_upstream(
        make: Make, registry: FakeRegistry) -> None:
    client = await make(upstream_versions_ttl="0.001", upstream_metadata_timeout="30")
    assert (await client.get(f"{BASE}/index.json")).status == 200
    await asyncio.sleep(0.01)
    registry.faults.add("stall")
    # Upstream would hold us 5 s (and our timeout is 30 s): the old copy answers at once.
    response = await asyncio.wait_for(client.get(f"{BASE}/index.json"), timeout=3)
    assert response.status == 200
    assert "3.2.1" in (await response.json())["versions"]


@pytest.mark.parametrize(("fault", "message"), [
    ("redirectloop", "more than 5 redirects"),
    ("httpredirect", "refusing non-https upstream URL"),
    ("badredirect", "redirected to an invalid URL"),
    ("deepjson", "invalid JSON"),
    ("hugejson", "larger than 1048576 bytes"),
])
async def test_hostile_versions_answers(make: Make, registry: FakeRegistry, fault: str,
                                        message: str) -> None:
    client = await make()
    registry.faults.add(fault)
    response = await client.get(f"{BASE}/index.json")
    assert response.status == 502
    assert message in await error_of(response)


async def test_hostile_download_url(make: Make, registry: FakeRegistry) -> None:
    client = await make()
    registry.faults.add("badurl")
    response = await client.get(f"{BASE}/3.2.1.json")
    assert response.status == 502
    assert "download_url is not a valid https URL" in await error_of(response)


async def test_short_lived_download_urls_are_fetched_fresh(
        make: Make, registry: FakeRegistry) -> None:
    client = await make()
    registry.faults.add("expiring")
    assert (await client.get(f"{BASE}/3.2.1.json")).status == 200  # hands out 3 URLs
    for platform in ("linux_amd64", "darwin_arm64"):
        response = await client.get(f"{BASE}/terraform-provider-null_3.2.1_{platform}.zip")
        assert response.status == 200, await response.text()
        assert await response.read() == \
            registry.releases[("hashicorp", "null", "3.2.1")].zips[platform]


async def test_one_platform_failing_its_checksum_does_not_block_the_others(
        make: Make, registry: FakeRegistry) -> None:
    client = await make()
    registry.faults.add("wrongshasum:windows_amd64")
    response = await client.get(f"{BASE}/3.2.1.json")
    assert response.status == 200
    assert sorted((await response.json())["archives"]) == ["darwin_arm64", "linux_amd64"]
    windows = await client.get(f"{BASE}/terraform-provider-null_3.2.1_windows_amd64.zip")
    assert windows.status == 502
    text = await (await client.get("/metrics")).text()
    bad_sums = sample(text, "tfproxy_integrity_failures_total", kind="sha256sums")
    assert bad_sums is not None and bad_sums >= 1, text
    assert not any("windows" in p for p in registry.archive_requests())


async def test_unlisted_platform_costs_no_upstream_request(make: Make,
                                                           registry: FakeRegistry) -> None:
    client = await make()
    assert (await client.get(f"{BASE}/index.json")).status == 200
    registry.requests.clear()
    response = await client.get(f"{BASE}/terraform-provider-null_3.2.1_plan9_amd64.zip")
    assert response.status == 404
    assert "not published for plan9_amd64" in await error_of(response)
    assert registry.requests == []


async def test_package_over_the_size_limit_is_refused(make: Make, registry: FakeRegistry,
                                                      proxy_config: Config) -> None:
    client = await make(upstream_max_archive_size="200B")
    response = await client.get(f"{BASE}/{ZIP}")
    assert response.status == 502
    assert "200-byte limit" in await error_of(response)
    assert not list(proxy_config.cache.dir.rglob("*.zip"))


async def test_a_package_upstream_refuses_leaves_no_spool_behind(
        make: Make, registry: FakeRegistry, proxy_config: Config,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The spool is made while upstream is asked for the package: its answer refused, the
    spool goes too."""
    made: list[Path] = []
    make_spool_file = store_spool._make_spool_file

    def recorded(temp: Path) -> int:
        fd = make_spool_file(temp)
        made.append(temp)
        return fd

    monkeypatch.setattr(store_spool, "_make_spool_file", recorded)
    client = await make()
    assert (await client.get(f"{BASE}/3.2.1.json")).status == 200  # its facts, held
    registry.faults.add("down")  # now the package itself fails
    response = await client.get(f"{BASE}/{ZIP}")
    assert response.status == 502
    for _ in range(100):
        if made and not made[0].exists():
            break
        await asyncio.sleep(0.02)
    assert len(made) == 1 and not made[0].exists()  # made while upstream was asked, gone
    assert not list((proxy_config.cache.dir / "tmp").rglob("*.part"))


async def test_opentofu_registry_may_publish_without_keys(
        make: Make, registry: FakeRegistry) -> None:
    client = await make(extra=f"""
[upstream.hosts."registry.opentofu.org".services]
"providers.v1" = "{registry.providers_url}"
""")
    registry.faults.add("nokeys")
    base = "/mirror/registry.opentofu.org/hashicorp/null"
    assert (await client.get(f"{base}/3.2.1.json")).status == 200
    assert (await client.get(f"{base}/{ZIP}")).status == 200
    # ...but no other host may.
    assert (await client.get(f"{BASE}/3.2.1.json")).status == 502


async def test_unknown_version_forces_a_refresh(make: Make, registry: FakeRegistry,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(proxy.store.freshness, "UNKNOWN_ENTRY_REFRESH_SECONDS", 0.0)
    client = await make()
    assert "3.3.0" not in (await (await client.get(f"{BASE}/index.json")).json())["versions"]
    registry.add_release("hashicorp", "null", "3.3.0")
    try:
        response = await client.get(f"{BASE}/3.3.0.json")
        assert response.status == 200
        assert "3.3.0" in (await (await client.get(f"{BASE}/index.json")).json())["versions"]
    finally:
        del registry.releases[("hashicorp", "null", "3.3.0")]


async def test_client_leaving_mid_fill_does_not_cancel_it(make: Make,
                                                          registry: FakeRegistry) -> None:
    client = await make()
    assert (await client.get(f"{BASE}/3.2.1.json")).status == 200
    registry.faults.add("slowzip")
    leaving = await client.get(f"{BASE}/{ZIP}")
    assert leaving.status == 200
    await leaving.content.readexactly(32)  # the first bytes arrive while upstream trickles
    leaving.close()                         # ...and the client hangs up
    response = await client.get(f"{BASE}/{ZIP}")  # joins the fill still under way
    assert response.status == 200
    assert await response.read() == registry.releases[("hashicorp", "null", "3.2.1")].zips[
        "linux_amd64"]
    assert len(registry.archive_requests()) == 1


async def test_leftovers_are_swept_at_start(make: Make, proxy_config: Config) -> None:
    tmp = proxy_config.cache.dir / "tmp"
    (tmp / "work-x").mkdir(parents=True)
    (tmp / "work-x" / "half.tf").write_text("x")
    (tmp / "abc.part").write_bytes(b"half a zip")
    client = await make()
    assert (await client.get("/healthz")).status == 200
    assert not (tmp / "work-x").exists() and not (tmp / "abc.part").exists()
    # Its own temp dir only, beside the shared lock files.
    assert {p.name[0] for p in tmp.iterdir() if p.is_dir() and p.name != "locks"} == {"p"}


async def test_streaming_clients_get_bytes_before_the_download_ends(
        make: Make, registry: FakeRegistry, proxy_config: Config) -> None:
    client = await make()
    assert (await client.get(f"{BASE}/3.2.1.json")).status == 200
    registry.faults.add("slowzip")
    readers = [await client.get(f"{BASE}/{ZIP}") for _ in range(3)]
    firsts = [await r.content.readexactly(64) for r in readers]
    # Bytes flowed to every reader while upstream was still sending: nothing is published
    # yet, and there is one upstream request.
    assert not list(proxy_config.cache.dir.rglob("*.zip"))
    assert len(registry.archive_requests()) == 1
    expected = registry.releases[("hashicorp", "null", "3.2.1")].zips["linux_amd64"]
    for reader, first in zip(readers, firsts, strict=True):
        assert int(reader.headers["Content-Length"]) == len(expected)
        assert first + await reader.read() == expected


async def test_corrupt_download_aborts_every_streaming_client(
        make: Make, registry: FakeRegistry, proxy_config: Config) -> None:
    client = await make()
    assert (await client.get(f"{BASE}/3.2.1.json")).status == 200
    registry.faults.update({"slowzip", "corrupt"})
    readers = [await client.get(f"{BASE}/{ZIP}") for _ in range(3)]
    for reader in readers:
        assert reader.status == 200
        with pytest.raises(aiohttp.ClientPayloadError):
            await reader.read()
    assert not list(proxy_config.cache.dir.rglob("*.zip"))
    registry.faults.clear()
    response = await client.get(f"{BASE}/{ZIP}")
    assert await response.read() == registry.releases[
        ("hashicorp", "null", "3.2.1")].zips["linux_amd64"]


async def test_concurrent_fills_are_capped_and_the_rest_wait(
        make: Make, registry: FakeRegistry) -> None:
    client = await make(upstream_max_concurrent_fills="1")
    assert (await client.get(f"{BASE}/3.2.1.json")).status == 200
    registry.faults.add("slowzip")
    names = [f"terraform-provider-null_3.2.1_{p}.zip" for p in ("linux_amd64", "darwin_arm64")]
    downloads = [asyncio.ensure_future(client.get(f"{BASE}/{n}")) for n in names]
    await asyncio.sleep(0.3)  # the first trickles (about 0.6 s); the second must wait
    assert len(registry.archive_requests()) == 1
    text = await (await client.get("/metrics")).text()
    assert sample(text, "tfproxy_fills_in_flight") == 1
    for name, download in zip(names, downloads, strict=True):
        platform = name.removeprefix("terraform-provider-null_3.2.1_").removesuffix(".zip")
        assert await (await download).read() == registry.releases[
            ("hashicorp", "null", "3.2.1")].zips[platform]
    assert len(registry.archive_requests()) == 2


@pytest.mark.parametrize(("fault", "path", "message"), [
    ("loopback-url", ZIP, "refusing to connect to localhost"),
    ("metadata-url", ZIP, "refusing to connect to 169.254.169.254"),
    ("redirect-private", "index.json", "refusing to connect to localhost"),
])
async def test_upstream_cannot_aim_the_proxy_at_private_addresses(
        make: Make, registry: FakeRegistry, fault: str, path: str, message: str) -> None:
    client = await make()
    registry.faults.add(fault)
    response = await client.get(f"{BASE}/{path}")
    assert response.status == 502
    assert message in await error_of(response)
    assert registry.archive_requests() == []  # the refused host was never contacted
    assert registry.paths().count("/v1/providers/hashicorp/null/versions") <= 1


async def test_allowed_networks_open_private_ranges(make: Make,
                                                    registry: FakeRegistry) -> None:
    client = await make(upstream_extra='allowed_networks = ["127.0.0.0/8", "::1/128"]')
    registry.faults.add("loopback-url")
    response = await client.get(f"{BASE}/{ZIP}")
    assert response.status == 200
    assert await response.read() == registry.releases[
        ("hashicorp", "null", "3.2.1")].zips["linux_amd64"]
