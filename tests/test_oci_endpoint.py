"""The OCI distribution endpoint (/v2), in-process, against the fake upstream: documents,
headers, errors in the OCI shape, auth, and one cache shared with the network mirror."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

from aiohttp.test_utils import TestClient

from proxy.app import create_app
from proxy.config import load_config
from proxy.core.executors import serving
from proxy.core.metrics import Metrics
from proxy.store import layout
from proxy.store.disk import open_disk_storage
from proxy.web.oci_tokens import issue_token, issued_token
from proxy.web.url_signing import UrlSigner
from tests.conftest import AppClient
from tests.support.audit import eventually
from tests.support.fake_registry import FakeRegistry
from tests.support.metrics import sample
from tests.support.mirror_paths import archive_path

REPO = "/v2/providers/registry.terraform.io/hashicorp/null"
INDEX = "application/vnd.oci.image.index.v1+json"
MANIFEST = "application/vnd.oci.image.manifest.v1+json"
EMPTY = "sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a"
TOKEN = "an-oci-test-token-0123456789"


async def _index(client: TestClient, tag: str = "3.2.1",
                 headers: dict[str, str] | None = None) -> tuple[str, dict[str, Any]]:
    response = await client.get(f"{REPO}/manifests/{tag}", headers=headers or {})
    assert response.status == 200, await response.text()
    body = await response.read()
    digest = response.headers["Docker-Content-Digest"]
    assert digest == "sha256:" + hashlib.sha256(body).hexdigest()
    return digest, json.loads(body)


async def _oci_error(response: Any) -> str:
    body = await response.json()
    assert list(body) == ["errors"] and len(body["errors"]) == 1, body
    return str(body["errors"][0]["code"])


async def test_tags_list_every_version_with_link_pagination(client: TestClient) -> None:
    response = await client.get(f"{REPO}/tags/list")
    assert response.status == 200
    assert await response.json() == {"name": "providers/registry.terraform.io/hashicorp/null",
                                     "tags": ["3.1.0", "3.2.1"]}
    assert response.headers["Docker-Distribution-API-Version"] == "registry/2.0"
    first = await client.get(f"{REPO}/tags/list?n=1")
    assert (await first.json())["tags"] == ["3.1.0"]
    assert first.headers["Link"] == f'<{REPO}/tags/list?n=1&last=3.1.0>; rel="next"'
    second = await client.get(f"{REPO}/tags/list?n=1&last=3.1.0")
    assert (await second.json())["tags"] == ["3.2.1"]
    assert "Link" not in second.headers


async def test_head_and_get_by_tag_name_one_index_of_every_platform(
        client: TestClient, registry: FakeRegistry) -> None:
    release = registry.releases[("hashicorp", "null", "3.2.1")]
    head = await client.head(f"{REPO}/manifests/3.2.1")
    assert head.status == 200
    assert head.headers["Content-Type"] == INDEX
    digest, index = await _index(client)
    assert head.headers["Docker-Content-Digest"] == digest
    by_digest = await client.get(f"{REPO}/manifests/{digest}")
    assert by_digest.headers["Content-Type"] == INDEX
    assert int(head.headers["Content-Length"]) == len(await by_digest.read())
    assert index["artifactType"] == "application/vnd.opentofu.provider"
    platforms = {f"{m['platform']['os']}_{m['platform']['architecture']}": m
                 for m in index["manifests"]}
    assert sorted(platforms) == sorted(release.platforms)
    for platform, entry in platforms.items():
        assert entry["artifactType"] == "application/vnd.opentofu.provider-target"
        response = await client.get(f"{REPO}/manifests/{entry['digest']}")
        body = await response.read()
        assert response.headers["Content-Type"] == MANIFEST == entry["mediaType"]
        assert len(body) == entry["size"]
        assert response.headers["Docker-Content-Digest"] == entry["digest"]
        manifest = json.loads(body)
        assert manifest["config"]["digest"] == EMPTY
        (layer,) = manifest["layers"]
        # The sha256 from the signed SHA256SUMS: OpenTofu's zh: equals a direct install's.
        assert layer == {"mediaType": "archive/zip", "digest": f"sha256:{release.sha256(platform)}",
                         "size": len(release.zips[platform])}
        blob = await client.get(f"{REPO}/blobs/{layer['digest']}")
        assert blob.status == 200
        assert await blob.read() == release.zips[platform]
        assert blob.headers["Docker-Content-Digest"] == layer["digest"]
    config = await client.get(f"{REPO}/blobs/{EMPTY}")
    assert await config.read() == b"{}"
    # A blob names no version (its digest only): its pull names the provider alone.
    status = await (await client.get("/status.json")).json()
    assert all(not pull["artifact"].endswith(" ") for pull in status["recent_pulls"]), \
        status["recent_pulls"]


async def test_a_blob_supports_range_requests(client: TestClient,
                                              registry: FakeRegistry) -> None:
    release = registry.releases[("hashicorp", "null", "3.2.1")]
    _, index = await _index(client)
    entry = next(m for m in index["manifests"] if m["platform"]["os"] == "linux")
    manifest = await (await client.get(f"{REPO}/manifests/{entry['digest']}")).json(
        content_type=None)
    layer = manifest["layers"][0]["digest"]
    platform = f"linux_{entry['platform']['architecture']}"
    response = await client.get(f"{REPO}/blobs/{layer}", headers={"Range": "bytes=10-19"})
    assert response.status == 206
    assert await response.read() == release.zips[platform][10:20]


async def test_the_first_tag_request_fills_each_package_once(
        client: TestClient, registry: FakeRegistry) -> None:
    release = registry.releases[("hashicorp", "null", "3.2.1")]
    answers = await asyncio.gather(*(client.head(f"{REPO}/manifests/3.2.1") for _ in range(5)),
                                   *(client.get(f"{REPO}/manifests/3.2.1") for _ in range(5)))
    assert {a.status for a in answers} == {200}
    assert len({a.headers["Docker-Content-Digest"] for a in answers}) == 1
    downloads = registry.archive_requests()
    assert sorted(downloads) == sorted(set(downloads))
    assert len(downloads) == len(release.platforms)


async def test_a_package_is_one_cache_entry_for_the_mirror_and_oci(
        client: TestClient, registry: FakeRegistry) -> None:
    release = registry.releases[("hashicorp", "null", "3.2.1")]
    mirrored = await client.get(archive_path("linux_amd64"))
    assert mirrored.status == 200
    await mirrored.read()
    await _index(client)
    downloads = registry.archive_requests()
    assert len(downloads) == len(release.platforms)  # linux_amd64 fetched once, by the mirror
    assert len([p for p in downloads if p.endswith("linux_amd64.zip")]) == 1
    again = await client.get(archive_path("darwin_arm64"))  # filled for OCI: a mirror hit
    assert await again.read() == release.zips["darwin_arm64"]
    assert registry.archive_requests() == downloads


async def test_digests_are_the_same_after_a_restart_and_resolve_from_the_store(
        aiohttp_client: Any, write_config: Any) -> None:
    config = load_config(write_config(), environ={})
    first = await aiohttp_client(create_app(config))
    digest, index = await _index(first)
    await first.close()
    second = await aiohttp_client(create_app(config))
    # By digest first: nothing in this process's memory names it.
    response = await second.get(f"{REPO}/manifests/{digest}")
    assert response.status == 200
    assert json.loads(await response.read()) == index
    for entry in index["manifests"]:
        assert (await second.get(f"{REPO}/manifests/{entry['digest']}")).status == 200
    assert (await _index(second))[0] == digest


async def test_offline_the_index_lists_the_stored_platforms(
        aiohttp_client: Any, write_config: Any, tmp_path: Path) -> None:
    online = await aiohttp_client(create_app(load_config(write_config(), environ={})))
    stored = await online.get(archive_path("linux_amd64"))
    assert stored.status == 200
    await stored.read()
    await online.close()
    offline = await aiohttp_client(create_app(load_config(
        write_config(upstream_extra='mode = "offline"'), environ={})))
    _, index = await _index(offline)
    assert [m["platform"] for m in index["manifests"]] == [
        {"architecture": "amd64", "os": "linux"}]
    missing = await offline.get(f"{REPO}/manifests/3.1.0")
    assert missing.status == 404
    assert await _oci_error(missing) == "MANIFEST_UNKNOWN"


async def test_platform_filters_shape_the_index(make: AppClient) -> None:
    client = await make(extra='[filters]\nplatforms = ["darwin_*"]\n')
    _, index = await _index(client)
    assert {m["platform"]["os"] for m in index["manifests"]} == {"darwin"}


async def test_errors_have_the_oci_shape_and_codes(client: TestClient) -> None:
    cases = {
        f"{REPO}/manifests/9.9.9": (404, "MANIFEST_UNKNOWN"),
        f"{REPO}/manifests/latest": (404, "MANIFEST_UNKNOWN"),
        f"{REPO}/manifests/sha256:{'0' * 64}": (404, "MANIFEST_UNKNOWN"),
        f"{REPO}/manifests/sha256:abc": (400, "DIGEST_INVALID"),
        f"{REPO}/blobs/sha256:{'0' * 64}": (404, "BLOB_UNKNOWN"),
        f"{REPO}/blobs/md5:abc": (400, "DIGEST_INVALID"),
        "/v2/providers/registry.terraform.io/hashicorp/nope/tags/list": (404, "NAME_UNKNOWN"),
        "/v2/providers/unknown.example/hashicorp/null/tags/list": (404, "NAME_UNKNOWN"),
        "/v2/providers/registry.terraform.io/bad_ns!/null/tags/list": (400, "NAME_INVALID"),
        f"{REPO}/tags/list?n=x": (400, "PAGINATION_NUMBER_INVALID"),
        f"{REPO}/tags/list?n=%C2%B2": (400, "PAGINATION_NUMBER_INVALID"),
        "/v2/_catalog": (404, "NAME_UNKNOWN"),
        "/v2/providers/registry.terraform.io/hashicorp/null/referrers/x": (404, "NAME_UNKNOWN"),
    }
    for path, (status, code) in cases.items():
        response = await client.get(path)
        assert response.status == status, (path, await response.text())
        assert await _oci_error(response) == code, path
        assert response.headers["Docker-Distribution-API-Version"] == "registry/2.0"


async def test_names_outside_the_oci_grammar_are_name_invalid_without_an_upstream_request(
        client: TestClient, registry: FakeRegistry) -> None:
    """OCI repository names are lower case, `[a-z0-9]+((\\.|_|__|-+)[a-z0-9]+)*` per
    component: refused as Distribution refuses them, before anything is looked up."""
    registry.requests.clear()
    names = ["providers/REGISTRY.TERRAFORM.IO/hashicorp/null",
             "providers/registry.terraform.io/HashiCorp/null",
             "providers/registry.terraform.io/hashicorp/NULL",
             "providers/registry.terraform.io/hashicorp/null-",
             "providers/registry.terraform.io/-hashicorp/null",
             "providers/registry..terraform.io/hashicorp/null",
             "modules/registry.terraform.io/Acme/tarball/aws",
             "modules/registry.terraform.io/acme/tarball/AWS"]
    for name in names:
        for method, path in (("GET", "tags/list"), ("HEAD", "manifests/3.2.1"),
                             ("GET", "manifests/3.2.1"), ("GET", f"blobs/sha256:{'0' * 64}")):
            response = await client.request(method, f"/v2/{name}/{path}")
            assert response.status == 400, (method, name, path)
            if method == "GET":
                assert await _oci_error(response) == "NAME_INVALID", (name, path)
    assert registry.requests == []
    lower = await client.get("/v2/providers/registry.terraform.io/hashicorp/null/tags/list")
    assert lower.status == 200


async def test_other_methods_under_v2_get_an_oci_405(client: TestClient) -> None:
    for method in ("PUT", "DELETE", "POST"):
        response = await client.request(method, f"{REPO}/manifests/3.2.1")
        assert response.status == 405
        assert await _oci_error(response) == "UNSUPPORTED"
        assert "GET" in response.headers["Allow"]


async def test_with_auth_a_401_challenges_for_the_token_flow(make: AppClient) -> None:
    client = await make(extra=f'[auth]\ntokens = [{{ name = "ci", token = "{TOKEN}" }}]\n')
    scope = ',scope="repository:providers/registry.terraform.io/hashicorp/null:pull"'
    for path, asked in (("/v2/", ""), (f"{REPO}/tags/list", scope),
                        (f"{REPO}/manifests/3.2.1", scope)):
        refused = await client.get(path)
        assert refused.status == 401
        assert await _oci_error(refused) == "UNAUTHORIZED"
        challenge = refused.headers["WWW-Authenticate"]
        assert challenge.startswith('Bearer realm="https://') and \
            challenge.endswith(f'/v2/token",service="tf-registry-proxy"{asked}'), challenge
    basic = "Basic " + base64.b64encode(f"anyone:{TOKEN}".encode()).decode()
    assert (await client.get("/v2/token")).status == 401
    wrong = "Basic " + base64.b64encode(b"anyone:not-the-token").decode()
    assert (await client.get("/v2/token", headers={"Authorization": wrong})).status == 401
    issued = await (await client.get(
        "/v2/token?service=tf-registry-proxy&scope=repository:x:pull",
        headers={"Authorization": basic})).json()
    assert issued["token"] == issued["access_token"] and issued["expires_in"] > 0
    assert TOKEN not in issued["token"]
    bearer = {"Authorization": f"Bearer {issued['token']}"}
    assert (await client.get("/v2/", headers=bearer)).status == 200
    await _index(client, headers=bearer)
    await _index(client, headers={"Authorization": basic})  # Basic on the route itself
    forged = {"Authorization": f"Bearer {issued['token'][:-2]}xx"}
    assert (await client.get(f"{REPO}/tags/list", headers=forged)).status == 401


async def test_an_issued_token_opens_only_v2_and_only_while_its_token_is_configured(
        aiohttp_client: Any, write_config: Any) -> None:
    configured = f'[auth]\ntokens = [{{ name = "ci", token = "{TOKEN}" }}]\n'
    config = load_config(write_config(extra=configured), environ={})
    client = await aiohttp_client(create_app(config))
    basic = "Basic " + base64.b64encode(f"anyone:{TOKEN}".encode()).decode()
    issued = (await (await client.get("/v2/token", headers={"Authorization": basic})).json())
    bearer = {"Authorization": f"Bearer {issued['token']}"}
    assert (await client.get(f"{REPO}/tags/list", headers=bearer)).status == 200
    assert (await client.get("/v2/token", headers=bearer)).status == 401
    assert (await client.get("/mirror/registry.terraform.io/hashicorp/null/index.json",
                             headers=bearer)).status == 401
    await client.close()
    # The same name, another token (a rotation): what was issued for the old one is refused.
    rotated = configured.replace(TOKEN, "a-rotated-token-0123456789abcdef")
    again = await aiohttp_client(create_app(load_config(write_config(extra=rotated),
                                                        environ={})))
    refused = await again.get(f"{REPO}/tags/list", headers=bearer)
    assert refused.status == 401


def test_an_issued_token_expires() -> None:
    signer = UrlSigner(b"k" * 32, ttl=-120)  # every token it issues has expired
    issued, _lifetime = issue_token(signer, "ci", signer.binding(b"secret"))
    assert issued_token(signer, issued, frozenset({signer.binding(b"secret")})) is None
    fresh = UrlSigner(b"k" * 32, ttl=600)
    issued, lifetime = issue_token(fresh, "ci", fresh.binding(b"secret"))
    assert lifetime > 0
    assert issued_token(fresh, issued, frozenset({fresh.binding(b"secret")})) == (
        fresh.binding(b"secret"), "ci")
    assert issued_token(fresh, issued, frozenset({fresh.binding(b"other")})) is None


async def test_without_auth_v2_answers_anonymously(client: TestClient) -> None:
    response = await client.get("/v2/")
    assert response.status == 200
    assert await response.json() == {}
    assert (await client.get("/v2/token")).status == 200


async def test_a_blob_served_is_audited_as_its_package(make: AppClient, registry: FakeRegistry,
                                                        tmp_path: Path) -> None:
    log = tmp_path / "audit.log"
    client = await make(server_audit_log=str(log))
    release = registry.releases[("hashicorp", "null", "3.2.1")]
    layer = f"sha256:{release.sha256('linux_amd64')}"
    await _index(client)
    response = await client.get(f"{REPO}/blobs/{layer}")
    assert await response.read() == release.zips["linux_amd64"]
    [served] = await eventually(log, "served")
    assert (served["type"], served["version"], served["os"], served["arch"]) == (
        "null", "3.2.1", "linux", "amd64")
    assert served["sha256"] == release.sha256("linux_amd64")
    assert served["bytes"] == len(release.zips["linux_amd64"])


async def test_hostile_references_get_oci_errors_and_reach_no_upstream(
        client: TestClient, registry: FakeRegistry) -> None:
    for reference in ("..%2f..%2fetc", "3.2.1%00", "sha256:" + "g" * 64, "x" * 300,
                      "3.2.1;rm", "sha256:" + "A" * 64, "%E2%80%AE3.2.1"):
        response = await client.get(f"{REPO}/manifests/{reference}")
        assert 400 <= response.status < 500, reference
        assert (await response.json())["errors"], reference
    huge = await client.get(f"{REPO}/tags/list?n=99999999999")
    assert huge.status == 400
    assert not registry.archive_requests()


async def test_oci_requests_and_bytes_are_in_the_metrics(client: TestClient,
                                                         registry: FakeRegistry) -> None:
    release = registry.releases[("hashicorp", "null", "3.2.1")]
    layer = f"sha256:{release.sha256('linux_amd64')}"
    await _index(client)
    await (await client.get(f"{REPO}/blobs/{layer}")).read()
    await (await client.get(f"{REPO}/blobs/{layer}")).read()
    await client.get("/v2/modules/registry.terraform.io/acme/net/aws/tags/list")
    text = await (await client.get("/metrics")).text()
    for route in ("oci_manifest", "oci_blob", "oci_module_tags"):
        assert (sample(text, "tfproxy_http_requests_total", route=route,
                       status_class="2xx") or 0) >= 1, route
    assert sample(text, "tfproxy_served_bytes_total", kind="package") == \
        2 * len(release.zips["linux_amd64"])
    assert (sample(text, "tfproxy_cache_lookups_total", kind="archive", result="hit")
            or 0) >= 2


async def test_a_layer_record_never_serves_a_package_under_another_digest(
        client: TestClient, proxy_config: Any) -> None:
    """A digest's record names a version and platform; if the package verified for them now
    has another sha256 (pruned, then republished upstream), that digest is unknown."""
    await _index(client)
    stale = "ab" * 32
    async with serving(), AsyncExitStack() as opened:
        storage = await open_disk_storage(proxy_config.cache, Metrics(), opened)
        await storage.index.set(layout.oci_layer_record(
            "providers/registry.terraform.io/hashicorp/null", stale),
            {"version": "3.2.1", "os": "linux", "arch": "amd64"})
    response = await client.get(f"{REPO}/blobs/sha256:{stale}")
    assert response.status == 404
    assert await _oci_error(response) == "BLOB_UNKNOWN"
