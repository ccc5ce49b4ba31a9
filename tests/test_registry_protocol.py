"""The provider registry protocol through the proxy: upstream's signature material passed
through unchanged, every URL on the proxy, the bytes from the shared verified cache."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from aiohttp.test_utils import TestClient

from proxy.app import create_app
from proxy.config import load_config
from tests.support.fake_registry import FakeRegistry

REG = "/providers/registry.terraform.io/hashicorp/null"




def upstream_document(registry: FakeRegistry, path: str) -> dict[str, object]:
    import ssl
    context = ssl.create_default_context(cadata=registry.ca.cert_pem.bytes().decode())
    with urllib.request.urlopen(f"{registry.url}{path}", context=context) as response:
        return json.load(response)  # type: ignore[no-any-return]


async def test_versions_document_lists_versions_protocols_and_platforms(client: TestClient) -> None:
    body = await (await client.get(f"{REG}/versions")).json()
    versions = {v["version"]: v for v in body["versions"]}
    assert set(versions) == {"3.2.1", "3.1.0"}
    assert versions["3.2.1"]["protocols"] == ["5.0"]
    assert {"os": "darwin", "arch": "arm64"} in versions["3.2.1"]["platforms"]


async def test_download_document_passes_signature_material_through(
        client: TestClient, registry: FakeRegistry) -> None:
    registry.faults.add("tofu-packages")
    response = await client.get(f"{REG}/3.2.1/download/linux/amd64")
    assert response.status == 200, await response.text()
    ours = await response.json()
    theirs = upstream_document(registry, "/v1/providers/hashicorp/null/3.2.1/download/linux/"
                                         "amd64")
    urls = ("download_url", "shasums_url", "shasums_signature_url")
    assert {k: v for k, v in ours.items() if k not in urls} == \
        {k: v for k, v in theirs.items() if k not in urls}
    assert ours["packages"] == theirs["packages"]  # OpenTofu's, unchanged
    for key in urls:
        assert urlsplit(ours[key]).netloc == f"{client.host}:{client.port}", key

    release = registry.releases[("hashicorp", "null", "3.2.1")]
    registry.requests.clear()
    sums = await client.get(urlsplit(ours["shasums_url"]).path)
    assert await sums.read() == release.sums
    signature = await client.get(urlsplit(ours["shasums_signature_url"]).path)
    assert await signature.read() == release.signature
    package = await client.get(urlsplit(ours["download_url"]).path)
    assert await package.read() == release.zips["linux_amd64"]
    # SHA256SUMS and signature came from the verified cache; the zip was one fill.
    assert [p for p in registry.paths() if "SHA256SUMS" in p] == []


async def test_a_bad_signature_yields_no_document(client: TestClient,
                                                  registry: FakeRegistry) -> None:
    registry.faults.add("badsig")
    response = await client.get(f"{REG}/3.2.1/download/linux/amd64")
    assert response.status == 502
    assert "signature does not verify" in (await response.json())["errors"][0]


@pytest.mark.parametrize(("path", "status"), [
    (f"{REG}/3.2.1/download/plan9/amd64", 404),
    (f"{REG}/9.9.9/download/linux/amd64", 404),
    (f"{REG}/3.2.1/sums/{'0' * 32}/SHA256SUMS", 404),
    (f"{REG}/3.2.1/sums/xyz/SHA256SUMS", 404),
    (f"{REG}/3.2.1/sums/{'0' * 32}/passwd", 404),
    ("/providers/example.com/hashicorp/null/versions", 404),
    (f"{REG}/3.2/download/linux/amd64", 400),
    (f"{REG}/3.2.1/download/Linux/amd64", 400),
])
async def test_bad_registry_requests(client: TestClient, path: str, status: int) -> None:
    response = await client.get(path)
    assert response.status == status
    assert response.content_type == "application/json"


async def test_proxy_discovery_advertises_providers(client: TestClient) -> None:
    body = await (await client.get("/.well-known/terraform.json")).json()
    assert body["providers.v1"] == "/providers/registry.terraform.io/"


async def test_signed_urls_when_clients_authenticate(
        aiohttp_client, write_config: Callable[..., Path]) -> None:  # type: ignore[no-untyped-def]
    token = "registry-token-0123456789"
    config = load_config(write_config(extra=f'[auth]\ntokens = ["{token}"]\n'), environ={})
    client: TestClient = await aiohttp_client(create_app(config))
    headers = {"Authorization": f"Bearer {token}"}
    assert (await client.get(f"{REG}/3.2.1/download/linux/amd64")).status == 401
    document = await (await client.get(f"{REG}/3.2.1/download/linux/amd64",
                                       headers=headers)).json()
    for key in ("download_url", "shasums_url", "shasums_signature_url"):
        parts = urlsplit(document[key])
        assert "sig=" in parts.query
        assert (await client.get(f"{parts.path}?{parts.query}")).status == 200, key
        assert (await client.get(parts.path)).status == 401, key
