"""The network mirror protocol, in-process, against the fake upstream."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient

from proxy.app import create_app
from proxy.config import Config, load_config
from proxy.core.models import Platform, ProviderAddress
from proxy.verification.packages import VerifiedPackages
from proxy.verification.stored_packages import StoredPackages, fill_key
from proxy.web.routes import ARCHIVES_KEY
from tests.support.fake_registry import FakeRegistry
from tests.support.metrics import sample
from tests.support.mirror_paths import BASE, ZIP, zip_h1

MakeClient = Callable[[Config], Awaitable[TestClient]]


@pytest.fixture
def make_client(aiohttp_client) -> MakeClient:  # type: ignore[no-untyped-def]
    async def make(config: Config) -> TestClient:
        return await aiohttp_client(create_app(config))  # type: ignore[no-any-return]
    return make


async def test_index_lists_upstream_versions(client: TestClient, registry: FakeRegistry) -> None:
    response = await client.get(f"{BASE}/index.json")
    assert response.status == 200
    assert response.content_type == "application/json"
    assert await response.json() == {"versions": {"3.1.0": {}, "3.2.1": {}}}
    assert registry.paths() == ["/v1/providers/hashicorp/null/versions"]


async def test_index_drops_invalid_upstream_versions(client: TestClient,
                                                    registry: FakeRegistry) -> None:
    registry.extra_versions[("hashicorp", "null")] = [
        {"version": "v1.0.0"}, {"version": "1.02.0"}, {"version": "latest"}, {"version": 5},
        "garbage", {"version": "4.0.0-beta.1", "platforms": "nope"}]
    try:
        body = await (await client.get(f"{BASE}/index.json")).json()
    finally:
        registry.extra_versions.clear()
    assert body == {"versions": {"3.1.0": {}, "3.2.1": {}, "4.0.0-beta.1": {}}}


async def test_version_document_lists_every_platform_with_signed_zh(
        client: TestClient, registry: FakeRegistry) -> None:
    release = registry.releases[("hashicorp", "null", "3.2.1")]
    response = await client.get(f"{BASE}/3.2.1.json")
    assert response.status == 200, await response.text()
    assert response.content_type == "application/json"
    body = await response.json()
    assert body == {"archives": {
        platform: {"url": f"terraform-provider-null_3.2.1_{platform}.zip",
                   "hashes": [f"zh:{release.sha256(platform)}"]}
        for platform in release.platforms}}
    # The signature material was fetched (and checked) once for all platforms.
    sums = [p for p in registry.paths() if "SHA256SUMS" in p]
    assert sorted(sums) == sorted({p for p in sums})
    assert len(sums) == 2


async def test_archive_is_fetched_once_verified_and_served_byte_for_byte(
        client: TestClient, registry: FakeRegistry) -> None:
    release = registry.releases[("hashicorp", "null", "3.2.1")]
    responses = await asyncio.gather(*(client.get(f"{BASE}/{ZIP}") for _ in range(10)))
    for response in responses:
        assert response.status == 200
        assert response.content_type == "application/zip"
        assert await response.read() == release.zips["linux_amd64"]
    assert len(registry.archive_requests()) == 1

    again = await client.get(f"{BASE}/{ZIP}")
    assert await again.read() == release.zips["linux_amd64"]
    assert len(registry.archive_requests()) == 1

    document = await (await client.get(f"{BASE}/3.2.1.json")).json()
    assert document["archives"]["linux_amd64"]["hashes"] == [
        zip_h1(release.zips["linux_amd64"]), f"zh:{release.sha256('linux_amd64')}"]


async def test_head_on_archive_gives_its_length(client: TestClient) -> None:
    response = await client.head(f"{BASE}/{ZIP}")
    assert response.status == 200
    assert int(response.headers["Content-Length"]) > 0


async def test_corrupt_zip_is_refused_and_not_cached(
        client: TestClient, registry: FakeRegistry, proxy_config: Config) -> None:
    registry.faults.add("corrupt")
    # Bytes are streamed while they arrive; the mismatch shows at the end, so the connection
    # is cut mid-body: the client can never take the bad bytes for a complete package.
    response = await client.get(f"{BASE}/{ZIP}")
    assert response.status == 200
    with pytest.raises(aiohttp.ClientPayloadError):
        await response.read()
    assert not list((proxy_config.cache.dir / "archives").rglob("*.zip"))
    assert not list((proxy_config.cache.dir / "tmp").rglob("*.part"))
    metrics = await (await client.get("/metrics")).text()
    assert sample(metrics, "tfproxy_integrity_failures_total", kind="checksum") == 1

    registry.faults.clear()
    response = await client.get(f"{BASE}/{ZIP}")
    assert response.status == 200
    assert len(registry.archive_requests()) == 2


async def test_bad_signature_is_refused_and_nothing_is_served(
        client: TestClient, registry: FakeRegistry, proxy_config: Config) -> None:
    registry.faults.add("badsig")
    for path in (f"{BASE}/3.2.1.json", f"{BASE}/{ZIP}"):
        response = await client.get(path)
        assert response.status == 502
        assert "signature does not verify" in (await response.json())["errors"][0]
    assert registry.archive_requests() == []
    assert not list((proxy_config.cache.dir / "archives").rglob("*.zip"))

    registry.faults.clear()  # a failure is not remembered: the good release now verifies
    assert (await client.get(f"{BASE}/3.2.1.json")).status == 200


async def test_one_bad_sha256sums_met_by_each_platform_is_one_integrity_failure(
        client: TestClient, registry: FakeRegistry) -> None:
    """The platforms of a VERSION.json are looked up apart: one whose download document
    comes later checks the same bad SHA256SUMS again, and must not count it again."""
    registry.faults.add("badsig")
    registry.slow_paths["/v1/providers/hashicorp/null/3.2.1/download/darwin"] = 0.3
    registry.slow_paths["/v1/providers/hashicorp/null/3.2.1/download/windows"] = 0.6
    response = await client.get(f"{BASE}/3.2.1.json")
    assert response.status == 502
    metrics = await (await client.get("/metrics")).text()
    assert sample(metrics, "tfproxy_integrity_failures_total", kind="signature") == 1


@pytest.mark.parametrize(("fault", "message"), [
    ("nokeys", "no signing keys"),
    ("wrongshasum", "SHA256SUMS lists"),
])
async def test_unverifiable_release_is_refused(client: TestClient, registry: FakeRegistry,
                                               fault: str, message: str) -> None:
    registry.faults.add(fault)
    response = await client.get(f"{BASE}/3.2.1.json")
    assert response.status == 502
    assert message in (await response.json())["errors"][0]
    response = await client.get(f"{BASE}/{ZIP}")
    assert response.status == 502
    assert registry.archive_requests() == []


async def test_half_published_platform_is_left_out_then_picked_up(
        client: TestClient, registry: FakeRegistry) -> None:
    registry.faults.add("missing:windows_amd64")
    body = await (await client.get(f"{BASE}/3.2.1.json")).json()
    assert sorted(body["archives"]) == ["darwin_arm64", "linux_amd64"]
    registry.faults.clear()
    body = await (await client.get(f"{BASE}/3.2.1.json")).json()
    assert sorted(body["archives"]) == ["darwin_arm64", "linux_amd64", "windows_amd64"]


@pytest.mark.parametrize("path", [
    "/mirror/example.com/hashicorp/null/index.json",
    "/mirror/registry.terraform.io/hashicorp/nosuch/index.json",
    "/mirror/registry.terraform.io/hashicorp/null/9.9.9.json",
    f"/mirror/registry.terraform.io/hashicorp/null/{ZIP.replace('3.2.1', '9.9.9')}",
    "/mirror/registry.terraform.io/hashicorp/null/README.md",
    "/nothing/here",
])
async def test_unknown_things_are_json_404(client: TestClient, registry: FakeRegistry,
                                           path: str) -> None:
    response = await client.get(path)
    assert response.status == 404
    assert response.content_type == "application/json"
    assert (await response.json())["errors"]
    if path.startswith("/mirror/example.com") or path == "/nothing/here":
        assert registry.requests == []


@pytest.mark.parametrize("path", [
    "/mirror/registry.terraform.io/hashicorp/null/1.0.json",
    "/mirror/registry.terraform.io/hashicorp/null/v3.2.1.json",
    "/mirror/registry.terraform.io/hashi_corp/null/index.json",
    "/mirror/registry.terraform.io/hashicorp/null%2F..%2F..%2Fetc/index.json",
    "/mirror/registry.terraform.io/..%2F..%2Fetc/null/index.json",
    "/mirror/user@registry.terraform.io/hashicorp/null/index.json",
    "/mirror/169.254.169.254/hashicorp/null/index.json",
    "/mirror/registry.terraform.io/hashicorp/null/terraform-provider-null_3.2.1_linux_..%2F.zip",
    "/mirror/registry.terraform.io/hashicorp/null/terraform-provider-null_3.2.1.zip",
])
async def test_malformed_requests_are_json_400_without_upstream_traffic(
        client: TestClient, registry: FakeRegistry, path: str) -> None:
    response = await client.get(path)
    assert response.status == 400
    assert response.content_type == "application/json"
    assert registry.requests == []


async def test_upstream_down_without_cache_is_502(client: TestClient,
                                                  registry: FakeRegistry) -> None:
    registry.faults.add("down")
    response = await client.get(f"{BASE}/index.json")
    assert response.status == 502
    assert "503" in (await response.json())["errors"][0]


async def test_stale_versions_are_served_when_upstream_fails(
        make_client: MakeClient, write_config: Callable[..., Path],
        registry: FakeRegistry) -> None:
    config = load_config(write_config(extra="", ), environ={
        "TF_REGISTRY_PROXY_UPSTREAM_VERSIONS_TTL": "0.001"})
    client = await make_client(config)
    assert (await client.get(f"{BASE}/index.json")).status == 200
    await asyncio.sleep(0.01)
    registry.faults.add("down")
    # Expired: answered from the old copy at once, refreshed in the background (which fails).
    response = await client.get(f"{BASE}/index.json")
    assert response.status == 200
    assert "3.2.1" in (await response.json())["versions"]
    for _ in range(100):
        if registry.paths().count("/v1/providers/hashicorp/null/versions") == 2:
            break
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.05)
    # Upstream failed: the old copy is served (and counted) without asking upstream again.
    assert (await client.get(f"{BASE}/index.json")).status == 200
    assert registry.paths().count("/v1/providers/hashicorp/null/versions") == 2
    metrics = await (await client.get("/metrics")).text()
    assert sample(metrics, "tfproxy_cache_lookups_total", kind="versions",
                  result="revalidate") == 1
    assert sample(metrics, "tfproxy_cache_lookups_total", kind="versions", result="stale") == 1


async def test_cache_survives_restart_and_serves_without_upstream(
        make_client: MakeClient, proxy_config: Config, registry: FakeRegistry) -> None:
    release = registry.releases[("hashicorp", "null", "3.2.1")]
    first = await make_client(proxy_config)
    assert await (await first.get(f"{BASE}/{ZIP}")).read() == release.zips["linux_amd64"]
    await first.close()

    registry.faults.add("down")
    second = await make_client(proxy_config)
    response = await second.get(f"{BASE}/{ZIP}")
    assert response.status == 200
    assert await response.read() == release.zips["linux_amd64"]
    document = await second.get(f"{BASE}/3.2.1.json")
    assert document.status == 200
    assert "linux_amd64" in (await document.json())["archives"]


async def test_healthz_answers_and_requests_are_counted(client: TestClient) -> None:
    response = await client.get("/healthz")
    assert response.status == 200
    assert response.headers["Server"] == "tf-registry-proxy"
    assert await response.json() == {"status": "ok"}
    await client.get(f"{BASE}/index.json")
    text = await (await client.get("/metrics")).text()
    assert sample(text, "tfproxy_http_requests_total", route="mirror", status_class="2xx") == 1
    assert sample(text, "tfproxy_cache_lookups_total", kind="versions", result="miss") == 1


async def test_host_dropped_from_config_is_not_served_from_cache(
        make_client: MakeClient, proxy_config: Config, write_config: Callable[..., Path],
        registry: FakeRegistry) -> None:
    first = await make_client(proxy_config)
    assert (await (await first.get(f"{BASE}/{ZIP}")).read())
    await first.close()

    path = write_config()
    path.write_text(path.read_text().split("[upstream.hosts.")[0]
                    + 'allowed_hosts = ["registry.opentofu.org"]\n')
    second = await make_client(load_config(path, environ={}))
    registry.requests.clear()
    for name in ("index.json", "3.2.1.json", ZIP):
        response = await second.get(f"{BASE}/{name}")
        assert response.status == 404, name
    assert registry.requests == []


@pytest.mark.parametrize("path", [
    f"{BASE}/{ZIP}",
    "/modules/registry.terraform.io/acme/tarball/aws/1.0.0/tarball-aws-1.0.0.tar.gz",
])
async def test_ranges_and_preconditions_on_cached_files(client: TestClient, path: str) -> None:
    whole = await (await client.get(path)).read()
    size = len(whole)
    part = await client.get(path, headers={"Range": "bytes=10-19"})
    assert part.status == 206 and await part.read() == whole[10:20]
    assert part.headers["Content-Range"] == f"bytes 10-19/{size}"
    etag = part.headers["ETag"]
    assert (await client.get(path, headers={"If-None-Match": etag})).status == 304

    # Errors are JSON like every other, with what RFC 9110 asks of a 416.
    for headers, status in [({"Range": f"bytes={size}-"}, 416),
                            ({"Range": "bytes=oops"}, 416),
                            ({"If-Match": '"not-this-one"'}, 412)]:
        response = await client.get(path, headers=headers)
        assert response.status == status, headers
        assert response.content_type == "application/json", headers
        errors = (await response.json())["errors"]
        assert errors and all(isinstance(e, str) and e for e in errors), errors
        if status == 416:
            assert response.headers["Content-Range"] == f"bytes */{size}"
            assert str(size) in errors[0]
    head = await client.head(path, headers={"Range": f"bytes={size}-"})
    assert head.status == 416 and head.content_type == "application/json"
    assert await head.read() == b""


async def test_a_fill_asks_for_its_download_document_while_it_looks_at_the_store_again(
        client: TestClient, registry: FakeRegistry, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fill waiting for another process's fill lock asks upstream nothing (a fleet of
    replicas sends one request, not one each); once it holds the lock it asks for the
    download document and reads the verified facts at once, while it looks at the store
    again (a cold package's first byte waits for less), and then uses that answer."""
    # Not the document VERSION.json just fetched (see the next test): a fresh one.
    monkeypatch.setattr("proxy.verification.packages.RECENT_DOWNLOAD_SECONDS", -1.0)
    assert (await client.get(f"{BASE}/3.2.1.json")).status == 200  # as Terraform does
    document = "/v1/providers/hashicorp/null/3.2.1/download/linux/amd64"
    asked_before = registry.paths().count(document)
    asked_during_the_second_look: list[int] = []
    facts_read_during_the_second_look: list[int] = []
    facts_read = _count_fact_reads(monkeypatch)
    looked = StoredPackages.stored

    async def slow_second_look(stored: StoredPackages, *args: Any, check: bool = True
                               ) -> Any:
        if not check:  # the look under the lock
            await asyncio.sleep(0.3)
            asked_during_the_second_look.append(registry.paths().count(document) - asked_before)
            facts_read_during_the_second_look.append(len(facts_read))
        return await looked(stored, *args, check=check)

    monkeypatch.setattr(StoredPackages, "stored", slow_second_look)
    archives = client.server.app[ARCHIVES_KEY]
    key = fill_key(ProviderAddress.parse("registry.terraform.io", "hashicorp", "null"),
                   "3.2.1", Platform.parse("linux", "amd64"))
    async with archives.fill_lock(key, "package") as held:
        assert held
        download = asyncio.ensure_future(client.get(f"{BASE}/{ZIP}"))
        await asyncio.sleep(0.5)
        asked_while_another_held_the_lock = registry.paths().count(document) - asked_before
    response = await download
    assert response.status == 200
    assert await response.read() == registry.releases[("hashicorp", "null", "3.2.1")].zips[
        "linux_amd64"]
    assert asked_while_another_held_the_lock == 0
    assert asked_during_the_second_look[-1] == 1
    assert facts_read_during_the_second_look[-1] == 1  # the facts too, read meanwhile
    assert registry.paths().count(document) - asked_before == 1


async def test_the_zip_of_a_version_document_just_answered_costs_no_second_document(
        client: TestClient, registry: FakeRegistry, monkeypatch: pytest.MonkeyPatch) -> None:
    """Terraform asks for the zip right after VERSION.json: the download document fetched
    for it moments before is taken, with the facts verified with it (not read again from
    the index: one thread hop less before the first byte)."""
    document = "/v1/providers/hashicorp/null/3.2.1/download/linux/amd64"
    assert (await client.get(f"{BASE}/3.2.1.json")).status == 200
    asked = registry.paths().count(document)
    facts_read = _count_fact_reads(monkeypatch)
    assert (await client.get(f"{BASE}/{ZIP}")).status == 200
    assert registry.paths().count(document) == asked
    assert facts_read == []


@pytest.mark.parametrize("faults", [set(), {"expiring"}])
async def test_another_worker_takes_the_download_document_noted_with_the_facts(
        make_client: MakeClient, proxy_config: Config, registry: FakeRegistry,
        faults: set[str]) -> None:
    """Terraform fetches the zip on a new connection, which another worker (another process
    on the same store) may accept: it takes the download document the worker that answered
    VERSION.json noted with the facts, instead of asking upstream again; not a document
    whose URL holds a query (a signature may be good for one use only: asked for anew)."""
    registry.faults |= faults
    document = "/v1/providers/hashicorp/null/3.2.1/download/linux/amd64"
    answered, other = await make_client(proxy_config), await make_client(proxy_config)
    assert (await answered.get(f"{BASE}/3.2.1.json")).status == 200
    asked = registry.paths().count(document)
    response = await other.get(f"{BASE}/{ZIP}")
    assert response.status == 200
    assert await response.read() == registry.releases[("hashicorp", "null", "3.2.1")].zips[
        "linux_amd64"]
    assert registry.paths().count(document) == asked + (1 if faults else 0)


@pytest.mark.parametrize("worker", ["the same", "another"])
async def test_a_download_document_that_failed_its_check_is_not_held_for_the_zip(
        make_client: MakeClient, proxy_config: Config, registry: FakeRegistry,
        worker: str) -> None:
    """A document whose shasum SHA256SUMS did not vouch for is never taken by the zip's fill,
    neither from memory (the same worker) nor from a note (another worker): once upstream
    mends it, the zip is fetched with a fresh document."""
    document = "/v1/providers/hashicorp/null/3.2.1/download/linux/amd64"
    answered = await make_client(proxy_config)
    filling = answered if worker == "the same" else await make_client(proxy_config)
    registry.faults.add("wrongshasum:linux_amd64")
    archives = (await (await answered.get(f"{BASE}/3.2.1.json")).json())["archives"]
    assert "linux_amd64" not in archives  # left out: its facts did not verify
    registry.faults.clear()
    asked = registry.paths().count(document)
    response = await filling.get(f"{BASE}/{ZIP}")
    assert response.status == 200
    assert await response.read() == registry.releases[("hashicorp", "null", "3.2.1")].zips[
        "linux_amd64"]
    assert registry.paths().count(document) == asked + 1


async def test_a_fill_after_a_failed_one_asks_for_a_fresh_document(
        client: TestClient, registry: FakeRegistry) -> None:
    """The worker that noted a download document takes it once (from memory), never again
    from its own note: a fill that follows a failed one asks upstream anew."""
    document = "/v1/providers/hashicorp/null/3.2.1/download/linux/amd64"
    assert (await client.get(f"{BASE}/3.2.1.json")).status == 200
    registry.faults.add("corrupt")
    with pytest.raises(aiohttp.ClientPayloadError):
        await (await client.get(f"{BASE}/{ZIP}")).read()
    asked = registry.paths().count(document)
    registry.faults.clear()
    assert (await client.get(f"{BASE}/{ZIP}")).status == 200
    assert registry.paths().count(document) == asked + 1


async def test_another_worker_takes_a_noted_download_document_once(
        make_client: MakeClient, proxy_config: Config, registry: FakeRegistry) -> None:
    """A worker whose fill with a noted document failed asks upstream anew the next time."""
    document = "/v1/providers/hashicorp/null/3.2.1/download/linux/amd64"
    answered, other = await make_client(proxy_config), await make_client(proxy_config)
    assert (await answered.get(f"{BASE}/3.2.1.json")).status == 200
    asked = registry.paths().count(document)
    registry.faults.add("corrupt")
    with pytest.raises(aiohttp.ClientPayloadError):
        await (await other.get(f"{BASE}/{ZIP}")).read()
    assert registry.paths().count(document) == asked  # the noted document, taken
    registry.faults.clear()
    assert (await other.get(f"{BASE}/{ZIP}")).status == 200
    assert registry.paths().count(document) == asked + 1


async def test_a_noted_download_document_is_taken_only_moments_after(
        make_client: MakeClient, proxy_config: Config, registry: FakeRegistry,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Later, a fill in another worker asks upstream for a fresh document."""
    monkeypatch.setattr("proxy.verification.packages.RECENT_DOWNLOAD_SECONDS", -1.0)
    document = "/v1/providers/hashicorp/null/3.2.1/download/linux/amd64"
    answered, other = await make_client(proxy_config), await make_client(proxy_config)
    assert (await answered.get(f"{BASE}/3.2.1.json")).status == 200
    asked = registry.paths().count(document)
    assert (await other.get(f"{BASE}/{ZIP}")).status == 200
    assert registry.paths().count(document) == asked + 1


def _count_fact_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """From now on, one entry per read of a package's verified facts (memory or index)."""
    reads: list[int] = []
    recorded = VerifiedPackages._recorded_with_record  # what every read of them goes through

    async def counted(packages: VerifiedPackages, *args: Any) -> Any:
        reads.append(1)
        return await recorded(packages, *args)

    monkeypatch.setattr(VerifiedPackages, "_recorded_with_record", counted)
    return reads
