"""The CLI releases mirror (/releases/), in-process against the fake upstream: the trees
version managers read, files byte for byte, verification against the release keys,
single-flight and streaming fills, offline, hostile input and auth."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import re
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import aiohttp
import pysequoia
import pytest
from aiohttp.test_utils import TestClient

from proxy.app import create_app
from proxy.config import load_config
from proxy.core.executors import serving
from proxy.core.metrics import Metrics
from proxy.store import layout
from proxy.store.disk import open_disk_storage
from tests.support.audit import eventually
from tests.support.fake_registry import FakeRegistry
from tests.support.fake_releases import CliRelease, release_requests
from tests.support.gpg import GpgKey
from tests.support.metrics import sample

TF = "/releases/terraform"
TOFU = "/releases/opentofu/opentofu/releases/download"
TOKEN = "a-releases-test-token-0123456789"
Make = Callable[..., Awaitable[TestClient]]


@pytest.fixture
def make_releases(aiohttp_client: Any, write_config: Any, registry: FakeRegistry,
                  release_keys: Path) -> Make:
    """A client of a proxy whose [releases] are the fake upstream's (extra: more config)."""

    async def build(extra: str = "", upstream_extra: str = "", **env: str) -> TestClient:
        text = registry.cli.toml(release_keys) + extra
        environ = {f"TF_REGISTRY_PROXY_{k.upper()}": v for k, v in env.items()}
        config = load_config(write_config(extra=text, upstream_extra=upstream_extra),
                             environ=environ)
        return await aiohttp_client(create_app(config))  # type: ignore[no-any-return]

    return build


def _terraform(registry: FakeRegistry, version: str = "1.11.4") -> CliRelease:
    return registry.cli.releases[("terraform", version)]


async def _get(client: TestClient, path: str, status: int = 200) -> bytes:
    response = await client.get(path)
    body = await response.read()
    assert response.status == status, (path, body[:300])
    return body


async def test_the_terraform_tree_lists_versions_newest_first_with_links_on_the_proxy(
        make_releases: Make) -> None:
    client = await make_releases()
    for path in (f"{TF}/", TF):  # tfenv asks with the slash, tenv without
        page = (await _get(client, path)).decode()
        # tfenv greps every version-like string out of the page: only versions, newest first.
        assert list(dict.fromkeys(re.findall(r"[0-9]+\.[0-9]+\.[0-9]+", page))) == \
            ["1.11.4", "1.10.5"]
        hrefs = re.findall(r'href="([^"]+)"', page)
        assert hrefs == [f"{TF}/1.11.4/", f"{TF}/1.10.5/"]
    listing = await (await client.get(f"{TF}/index.json")).json()
    assert list(listing["versions"]) == ["1.11.4", "1.10.5"]
    version = await (await client.get(f"{TF}/1.11.4/index.json")).json()
    assert version["shasums"] == "terraform_1.11.4_SHA256SUMS"
    assert version["shasums_signature"] == "terraform_1.11.4_SHA256SUMS.sig"
    builds = {(b["os"], b["arch"]): b for b in version["builds"]}
    assert builds[("linux", "amd64")]["url"].endswith(
        f"{TF}/1.11.4/terraform_1.11.4_linux_amd64.zip")
    assert builds[("linux", "amd64")]["url"].startswith(f"https://{client.host}:")
    files = (await _get(client, f"{TF}/1.11.4/")).decode()
    assert "terraform_1.11.4_SHA256SUMS" in files and "linux_amd64.zip" in files


async def test_files_are_upstreams_bytes_verified_and_then_hits(
        make_releases: Make, registry: FakeRegistry) -> None:
    client = await make_releases()
    release = _terraform(registry)
    for name in (release.archive("linux_amd64"), release.sums_name,
                 f"{release.sums_name}.sig", release.keyed_signature):
        assert await _get(client, f"{TF}/1.11.4/{name}") == release.files[name]
    fetched = release_requests(registry.requests)
    assert fetched == [f"/hashicorp/terraform/1.11.4/{release.archive('linux_amd64')}"]
    registry.requests.clear()
    assert await _get(client, f"{TF}/1.11.4/{release.archive('linux_amd64')}") == \
        release.files[release.archive("linux_amd64")]
    assert registry.requests == []  # the zip, its SHA256SUMS and signatures: all held
    head = await client.head(f"{TF}/1.11.4/{release.archive('linux_amd64')}")
    assert head.status == 200
    assert int(head.headers["Content-Length"]) == len(release.files[release.archive(
        "linux_amd64")])
    part = await client.get(f"{TF}/1.11.4/{release.archive('linux_amd64')}",
                            headers={"Range": "bytes=0-9"})
    assert part.status == 206 and await part.read() == \
        release.files[release.archive("linux_amd64")][:10]


async def test_concurrent_misses_make_one_download_each_client_gets_every_byte(
        make_releases: Make, registry: FakeRegistry) -> None:
    client = await make_releases()
    release = _terraform(registry, "1.10.5")
    name = release.archive("darwin_arm64")
    registry.slow_paths[f"/hashicorp/terraform/1.10.5/{name}"] = 0.3
    bodies = await asyncio.gather(*(_get(client, f"{TF}/1.10.5/{name}") for _ in range(8)))
    assert set(bodies) == {release.files[name]}
    assert len(release_requests(registry.requests)) == 1


async def test_a_tampered_archive_is_refused_and_never_stored(
        make_releases: Make, registry: FakeRegistry, tmp_path: Path) -> None:
    client = await make_releases()
    release = _terraform(registry)
    name = release.archive("windows_amd64")
    registry.faults.add("tamper-release")
    response = await client.get(f"{TF}/1.11.4/{name}")
    if response.status == 200:  # the body had started: the connection is cut before its end
        with pytest.raises(aiohttp.ClientPayloadError):
            await response.read()
    else:
        assert response.status == 502
    assert not list((tmp_path / "cache" / "releases").rglob("*.zip"))
    metrics = await (await client.get("/metrics")).text()
    assert sample(metrics, "tfproxy_integrity_failures_total", kind="checksum") == 1
    registry.faults.clear()
    assert await _get(client, f"{TF}/1.11.4/{name}") == release.files[name]


async def test_a_stored_archive_damaged_since_is_dropped_and_fetched_again(
        make_releases: Make, registry: FakeRegistry, tmp_path: Path) -> None:
    client = await make_releases()
    release = _terraform(registry)
    name = release.archive("darwin_arm64")
    await _get(client, f"{TF}/1.11.4/{name}")
    await client.close()
    stored = tmp_path / "cache" / "releases" / "terraform" / "1.11.4" / name
    stored.write_bytes(b"x" + stored.read_bytes()[1:])
    again = await make_releases()
    registry.requests.clear()
    assert await _get(again, f"{TF}/1.11.4/{name}") == release.files[name]
    assert len(release_requests(registry.requests)) == 1
    metrics = await (await again.get("/metrics")).text()
    assert sample(metrics, "tfproxy_integrity_failures_total", kind="stored") == 1


async def test_a_release_signed_by_another_key_serves_nothing(
        make_releases: Make, registry: FakeRegistry, tmp_path: Path) -> None:
    client = await make_releases()
    release = _terraform(registry)
    registry.faults.add("badsig-release")
    for name in (release.archive("linux_amd64"), release.sums_name):
        response = await client.get(f"{TF}/1.11.4/{name}")
        assert response.status == 502
        message = (await response.json())["errors"][0]
        assert "signature does not verify with the terraform release keys" in message
    assert release_requests(registry.requests) == []  # no archive was even asked for
    assert not (tmp_path / "cache" / "releases").exists() or \
        not list((tmp_path / "cache" / "releases").rglob("*.zip"))
    registry.faults.clear()  # a failure is not remembered
    assert await _get(client, f"{TF}/1.11.4/{release.sums_name}") == \
        release.files[release.sums_name]


async def test_only_signatures_that_verify_are_served_and_named(
        make_releases: Make, registry: FakeRegistry) -> None:
    """A plain .sig by a key not configured beside a keyed one by the release key: the
    release verifies, the bad .sig is not served, and index.json names the good one."""
    client = await make_releases()
    release = _terraform(registry, "1.10.5")
    registry.faults.add("badsig-plain")
    assert await _get(client, f"{TF}/1.10.5/{release.keyed_signature}") == \
        release.files[release.keyed_signature]
    missing = await client.get(f"{TF}/1.10.5/{release.sums_name}.sig")
    assert missing.status == 404
    assert "verifies with the release keys" in (await missing.json())["errors"][0]
    version = await (await client.get(f"{TF}/1.10.5/index.json")).json()
    assert version["shasums_signature"] == release.keyed_signature
    assert version["shasums_signatures"] == [release.keyed_signature]


async def test_a_signature_a_client_asks_for_is_fetched_and_served_only_if_it_verifies(
        make_releases: Make, registry: FakeRegistry) -> None:
    """Names nobody listed (a key ID the proxy knows nothing of): fetched when asked for,
    served if they verify with the configured release keys, refused if not; once each."""
    client = await make_releases()
    release = _terraform(registry, "1.10.5")
    sums = release.files[release.sums_name]
    good, bad = f"{release.sums_name}.0123ABCD.sig", f"{release.sums_name}.FEDC4321.sig"
    release.files[good] = registry.cli.signer.detach_sign(sums)
    release.files[bad] = registry.cli.impostor.detach_sign(sums)
    try:
        assert await _get(client, f"{TF}/1.10.5/{good}") == release.files[good]
        refused = await client.get(f"{TF}/1.10.5/{bad}")
        assert refused.status == 404
        assert "verifies with the release keys" in (await refused.json())["errors"][0]
        registry.requests.clear()
        assert await _get(client, f"{TF}/1.10.5/{good}") == release.files[good]  # kept
        assert not [path for _method, path in registry.requests if path.endswith(good)]
    finally:
        del release.files[good], release.files[bad]


async def test_opentofu_release_assets_with_gpgsig_cosign_files_and_tofudl_list(
        make_releases: Make, registry: FakeRegistry) -> None:
    client = await make_releases()
    release = registry.cli.releases[("opentofu", "1.9.0")]
    for name in (release.archive("linux_amd64"), release.archive("linux_amd64", ".tar.gz"),
                 release.sums_name, f"{release.sums_name}.gpgsig", f"{release.sums_name}.sig",
                 f"{release.sums_name}.pem"):
        assert await _get(client, f"{TOFU}/v1.9.0/{name}") == release.files[name], name
    page = (await _get(client, f"{TOFU}")).decode()
    assert re.findall(r'href="[^"]*/(v[^"/]+)/"', page) == ["v1.9.0", "v1.8.8"]
    api = await (await client.get("/releases/tofu/api.json")).json()
    assert [v["id"] for v in api["versions"]] == ["1.9.0", "1.8.8"]
    assert release.archive("darwin_arm64") in api["versions"][0]["files"]


async def test_offline_the_held_releases_are_listed_and_served(
        make_releases: Make, registry: FakeRegistry) -> None:
    online = await make_releases()
    release = _terraform(registry)
    name = release.archive("linux_amd64")
    await _get(online, f"{TF}/1.11.4/{name}")
    await online.close()
    registry.requests.clear()
    offline = await make_releases(upstream_extra='mode = "offline"')
    assert await _get(offline, f"{TF}/1.11.4/{name}") == release.files[name]
    assert await _get(offline, f"{TF}/1.11.4/{release.sums_name}.sig") == \
        release.files[f"{release.sums_name}.sig"]
    page = (await _get(offline, f"{TF}/")).decode()
    assert "1.11.4" in page and "1.10.5" not in page
    missing = await offline.get(f"{TF}/1.10.5/terraform_1.10.5_linux_amd64.zip")
    assert missing.status == 404
    assert "offline" in (await missing.json())["errors"][0]
    assert registry.requests == []


async def test_with_upstream_down_held_releases_and_the_last_list_still_serve(
        make_releases: Make, registry: FakeRegistry) -> None:
    client = await make_releases()
    release = _terraform(registry)
    await _get(client, f"{TF}/")
    await _get(client, f"{TF}/1.11.4/{release.archive('linux_amd64')}")
    registry.faults.add("down")
    assert await _get(client, f"{TF}/1.11.4/{release.archive('linux_amd64')}") == \
        release.files[release.archive("linux_amd64")]
    assert "1.10.5" in (await _get(client, f"{TF}/")).decode()
    response = await client.get(f"{TF}/1.10.5/terraform_1.10.5_linux_amd64.zip")
    assert response.status == 502


@pytest.mark.parametrize("path", [
    f"{TF}/1.11/terraform_1.11_linux_amd64.zip",  # not a version
    f"{TF}/1.11.4/terraform_1.11.4_linux_amd64.exe",  # not a file it publishes
    f"{TF}/1.11.4/terraform_1.10.5_linux_amd64.zip",  # another version's
    f"{TF}/1.11.4/..%2f..%2fetc%2fpasswd",
    f"{TF}/1.11.4/terraform_1.11.4_SHA256SUMS.bad.sig",
    f"{TOFU}/1.9.0/tofu_1.9.0_linux_amd64.zip",  # tags start with v
    f"{TOFU}/v1.9.0/terraform_1.9.0_linux_amd64.zip",
    "/releases/keys/../../etc/passwd",
    "/releases/keys/other.asc",
    "/releases/vault/1.0.0/vault_1.0.0_linux_amd64.zip",
])
async def test_hostile_or_unknown_paths_get_a_json_4xx_and_reach_no_upstream(
        make_releases: Make, registry: FakeRegistry, path: str) -> None:
    client = await make_releases()
    response = await client.get(path)
    assert 400 <= response.status < 500, (path, response.status)
    assert (await response.json())["errors"]
    assert registry.requests == []  # not even a SHA256SUMS


async def test_an_unknown_version_is_404(make_releases: Make) -> None:
    client = await make_releases()
    response = await client.get(f"{TF}/9.9.9/terraform_9.9.9_linux_amd64.zip")
    assert response.status == 404
    assert "no release 9.9.9" in (await response.json())["errors"][0]


async def test_a_platform_not_in_the_signed_sums_is_404(make_releases: Make) -> None:
    client = await make_releases()
    response = await client.get(f"{TF}/1.11.4/terraform_1.11.4_freebsd_arm.zip")
    assert response.status == 404
    assert "not in its signed SHA256SUMS" in (await response.json())["errors"][0]


async def test_the_release_keys_are_served_for_clients_that_verify(
        make_releases: Make, signer: GpgKey) -> None:
    client = await make_releases()
    for name in ("hashicorp.asc", "opentofu.asc"):
        body = await _get(client, f"/releases/keys/{name}")
        assert str(pysequoia.Cert.from_bytes(body).fingerprint).upper() == \
            signer.fingerprint.upper()


async def test_with_auth_a_token_is_needed_as_bearer_or_basic_password(
        make_releases: Make, registry: FakeRegistry) -> None:
    client = await make_releases(extra=f'[auth]\ntokens = [{{ name = "ci", token = "{TOKEN}" }}]\n')
    release = _terraform(registry)
    path = f"{TF}/1.11.4/{release.sums_name}"
    refused = await client.get(path)
    assert refused.status == 401
    assert any(challenge.startswith('Basic realm="tf-registry-proxy"')
               for challenge in refused.headers.getall("WWW-Authenticate"))
    basic = "Basic " + base64.b64encode(f"tenv:{TOKEN}".encode()).decode()
    for header in (f"Bearer {TOKEN}", basic):
        response = await client.get(path, headers={"Authorization": header})
        assert response.status == 200


async def test_fetches_and_serves_are_audited_and_counted_as_the_cli_release(
        make_releases: Make, registry: FakeRegistry, tmp_path: Path) -> None:
    log = tmp_path / "audit.log"
    client = await make_releases(server_audit_log=str(log))
    release = _terraform(registry)
    name = release.archive("linux_amd64")
    await _get(client, f"{TF}/1.11.4/{name}")
    [fetched] = await eventually(log, "fetched")
    [served] = await eventually(log, "served")
    for line in (fetched, served):
        assert (line["kind"], line["name"], line["version"], line["os"], line["arch"]) == (
            "cli", "terraform", "1.11.4", "linux", "amd64")
    assert fetched["sha256"] == hashlib.sha256(release.files[name]).hexdigest()
    metrics = await (await client.get("/metrics")).text()
    assert sample(metrics, "tfproxy_served_bytes_total", kind="release") == \
        len(release.files[name])
    assert sample(metrics, "tfproxy_cache_lookups_total", kind="release", result="miss") == 1


async def test_with_upstream_down_and_no_list_kept_the_held_releases_are_listed(
        make_releases: Make, registry: FakeRegistry, tmp_path: Path) -> None:
    first = await make_releases()
    release = _terraform(registry)
    await _get(first, f"{TF}/1.11.4/{release.archive('linux_amd64')}")
    await first.close()  # the release list was never asked for: no copy of it is kept
    registry.faults.add("down")
    client = await make_releases()
    page = (await _get(client, f"{TF}/")).decode()
    assert "1.11.4" in page and "1.10.5" not in page
    version = await (await client.get(f"{TF}/1.11.4/index.json")).json()
    assert [b["filename"] for b in version["builds"]] == [release.archive("linux_amd64")]


async def test_a_malformed_release_record_leaves_the_listing_standing(
        make_releases: Make, registry: FakeRegistry, tmp_path: Path) -> None:
    client = await make_releases()
    release = _terraform(registry)
    await _get(client, f"{TF}/1.11.4/{release.sums_name}")
    async with serving(), AsyncExitStack() as opened:
        config = load_config(tmp_path / "proxy.toml", environ={})
        storage = await open_disk_storage(config.cache, Metrics(), opened)
        await storage.index.set(layout.release_record("terraform", "1.10.5"), {"sums": 5})
        await storage.index.set(layout.release_record("terraform", "garbage"), {})
    again = await make_releases()
    registry.faults.add("down")
    page = (await _get(again, f"{TF}/")).decode()
    assert "1.11.4" in page


async def test_a_stored_release_no_configured_key_vouches_for_is_not_served(
        make_releases: Make, registry: FakeRegistry, tmp_path: Path,
        impostor: GpgKey) -> None:
    """The keys were replaced since a release was stored: what only the old key signed is
    refused, online (fetched again, and refused again) and offline."""
    client = await make_releases()
    release = _terraform(registry)
    name = release.archive("linux_amd64")
    await _get(client, f"{TF}/1.11.4/{name}")
    await client.close()
    other = tmp_path / "other-keys.asc"
    other.write_text(impostor.armored_public_key)
    for upstream_extra in ("", 'mode = "offline"'):
        again = await make_releases(upstream_extra=upstream_extra,
                                    releases_terraform_keys=str(other))
        for path in (f"{TF}/1.11.4/{name}", f"{TF}/1.11.4/{release.sums_name}"):
            response = await again.get(path)
            assert response.status == 502, (upstream_extra, path, await response.text())
        await again.close()


async def test_with_auth_the_release_keys_are_public(make_releases: Make) -> None:
    client = await make_releases(extra=f'[auth]\ntokens = ["{TOKEN}"]\n')
    assert (await client.get("/releases/keys/hashicorp.asc")).status == 200
    assert (await client.get(f"{TF}/")).status == 401
