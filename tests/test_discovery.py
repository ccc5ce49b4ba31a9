"""Remote service discovery against a real HTTPS server, and its parsing rules."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient

from proxy.app import create_app
from proxy.config import load_config
from proxy.upstream.discovery import parse_discovery
from tests.support.fake_registry import FakeRegistry

JSON = "application/json"
FINAL = "https://registry.example/.well-known/terraform.json"


@pytest.mark.parametrize(("body", "content_type", "expected"), [
    (b'{"providers.v1": "/v1/providers/"}', JSON,
     {"providers.v1": "https://registry.example/v1/providers/"}),
    (b'{"providers.v1": "/v1/providers"}', "application/json; charset=utf-8",
     {"providers.v1": "https://registry.example/v1/providers/"}),
    # The relative-path trap: resolved against /.well-known/, exactly as clients do.
    (b'{"providers.v1": "v1/providers/"}', JSON,
     {"providers.v1": "https://registry.example/.well-known/v1/providers/"}),
    (b'{"providers.v1": "https://other.example/p/", "modules.v1": "/m/"}', JSON,
     {"providers.v1": "https://other.example/p/", "modules.v1": "https://registry.example/m/"}),
    (b'{"providers.v1": "http://plain.example/p/"}', JSON, {}),
    (b'{"providers.v1": 42, "login.v1": {"client": "x"}}', JSON, {}),
    (b'{"providers.v1": "//[x", "modules.v1": "https://["}', JSON, {}),
    (b"[" * 100_000 + b"]" * 100_000, JSON, None),
    (b'{"providers.v1": ' + b"1" * 5000 + b"}", JSON, None),
    (b'{"providers.v1": "/v1/providers/"}', "text/html", None),
    (b'["providers.v1"]', JSON, None),
    (b"not json", JSON, None),
    (b"\xff\xfe", JSON, None),
])
def test_parse_discovery(body: bytes, content_type: str,
                         expected: dict[str, str] | None) -> None:
    assert parse_discovery(body, content_type, FINAL) == expected


@pytest.fixture
def discovering_config(tmp_path: Path, registry: FakeRegistry,
                       upstream_ca_file: Path) -> Callable[[], object]:
    host = f"localhost:{registry.port}"
    path = tmp_path / "c.toml"
    path.write_text(f"""
[cache]
dir = "{tmp_path / 'cache'}"
[upstream]
ca_bundle = "{upstream_ca_file}"
allowed_hosts = ["{host}"]
""")
    return lambda: load_config(path, environ={})


async def test_mirror_discovers_upstream_services(aiohttp_client, discovering_config,  # type: ignore[no-untyped-def]
                                                  registry: FakeRegistry) -> None:
    client: TestClient = await aiohttp_client(create_app(discovering_config()))
    base = f"/mirror/localhost:{registry.port}/hashicorp/null"
    assert (await client.get(f"{base}/index.json")).status == 200
    assert (await client.get(f"{base}/3.1.0.json")).status == 200
    # Discovery happened once and was reused.
    assert registry.paths().count("/.well-known/terraform.json") == 1


async def test_discovery_follows_redirects_and_resolves_against_final_url(
        aiohttp_client, discovering_config, registry: FakeRegistry) -> None:  # type: ignore[no-untyped-def]
    registry.faults.add("moved-discovery")
    client: TestClient = await aiohttp_client(create_app(discovering_config()))
    response = await client.get(f"/mirror/localhost:{registry.port}/hashicorp/null/index.json")
    assert response.status == 200, await response.text()
    assert registry.paths()[:3] == ["/.well-known/terraform.json", "/moved/terraform.json",
                                    "/v1/providers/hashicorp/null/versions"]


async def test_host_without_services_is_404(aiohttp_client, discovering_config,  # type: ignore[no-untyped-def]
                                            registry: FakeRegistry) -> None:
    registry.faults.add("no-discovery")
    client: TestClient = await aiohttp_client(create_app(discovering_config()))
    response = await client.get(f"/mirror/localhost:{registry.port}/hashicorp/null/index.json")
    assert response.status == 404
    assert "offers no providers.v1" in (await response.json())["errors"][0]


async def test_garbage_discovery_is_an_upstream_error_not_a_verdict(
        aiohttp_client, discovering_config, registry: FakeRegistry) -> None:  # type: ignore[no-untyped-def]
    registry.faults.add("html-discovery")
    client: TestClient = await aiohttp_client(create_app(discovering_config()))
    response = await client.get(f"/mirror/localhost:{registry.port}/hashicorp/null/index.json")
    assert response.status == 502
    assert "did not answer a JSON object" in (await response.json())["errors"][0]


async def test_stale_discovery_is_used_when_upstream_breaks(
        aiohttp_client, tmp_path: Path, registry: FakeRegistry,  # type: ignore[no-untyped-def]
        upstream_ca_file: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(f"""
[cache]
dir = "{tmp_path / 'cache'}"
[upstream]
ca_bundle = "{upstream_ca_file}"
allowed_hosts = ["localhost:{registry.port}"]
discovery_ttl = 0.001
""")
    client: TestClient = await aiohttp_client(create_app(load_config(path, environ={})))
    base = f"/mirror/localhost:{registry.port}/hashicorp/null"
    assert (await client.get(f"{base}/index.json")).status == 200
    registry.faults.add("html-discovery")
    await asyncio.sleep(0.01)
    assert (await client.get(f"{base}/3.1.0.json")).status == 200
    assert (await client.get(f"{base}/3.2.1.json")).status == 200
    # One failed try, then the stale answer is used without asking again (backoff).
    assert registry.paths().count("/.well-known/terraform.json") == 2


async def test_untrusted_upstream_certificate_is_refused(
        aiohttp_client, tmp_path: Path, registry: FakeRegistry) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "c.toml"
    path.write_text(f"""
[cache]
dir = "{tmp_path / 'cache'}"
[upstream]
allowed_hosts = ["localhost:{registry.port}"]
""")
    client: TestClient = await aiohttp_client(create_app(load_config(path, environ={})))
    response = await client.get(f"/mirror/localhost:{registry.port}/hashicorp/null/index.json")
    assert response.status == 502
    assert "certificate" in (await response.json())["errors"][0].lower()
