"""Credentials for upstream registries: from the config or TF_TOKEN_*, sent only where the
registry protocol sends them, and never a client's."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from aiohttp.test_utils import TestClient

from proxy.app import create_app
from proxy.config import Secret, load_config
from tests.support.connect_proxy import ConnectProxy
from tests.support.fake_registry import FakeRegistry
from tests.test_mirror import BASE, ZIP


def test_tokens_from_config_and_environment(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[upstream.hosts."private.example"]\ntoken = "from-file"\n'
                    '[upstream.hosts."other.example"]\ntoken = "file-loses"\n')
    config = load_config(path, environ={"TF_TOKEN_other_example": "env-wins",
                                        "TF_TOKEN_my__registry_example_com": "dashes",
                                        "TF_TOKEN_xn____bcher_kva_example": "puny",
                                        "TF_TOKEN_not a host": "ignored"})
    upstream = config.upstream
    assert upstream.token_for("private.example") == "from-file"
    assert upstream.token_for("other.example") == "env-wins"
    assert upstream.token_for("my-registry.example.com") == "dashes"
    assert upstream.token_for("registry.terraform.io") is None
    # A token does not make a host allowed, and secrets never show in a repr.
    assert not upstream.serves("my-registry.example.com")
    assert "from-file" not in repr(config) and "env-wins" not in repr(config)
    assert repr(Secret("x")) == "Secret('***')"


async def test_token_goes_to_registry_documents_only(
        aiohttp_client, write_config: Callable[..., Path],  # type: ignore[no-untyped-def]
        registry: FakeRegistry) -> None:
    config = load_config(write_config(), environ={"TF_TOKEN_registry_terraform_io": "s3cret"})
    client: TestClient = await aiohttp_client(create_app(config))
    response = await client.get(f"{BASE}/{ZIP}", headers={"Authorization": "Bearer CLIENT"})
    assert response.status == 200
    await response.read()
    sent = dict(registry.authorizations)
    assert sent["/v1/providers/hashicorp/null/versions"] == "Bearer s3cret"
    assert sent["/v1/providers/hashicorp/null/3.2.1/download/linux/amd64"] == "Bearer s3cret"
    for path, value in registry.authorizations:
        if path.startswith("/files/"):  # SHA256SUMS, signature, zip: no token, as clients do
            assert value is None, path
        assert value != "Bearer CLIENT"


async def test_client_authorization_is_never_forwarded(
        aiohttp_client, proxy_config, registry: FakeRegistry) -> None:  # type: ignore[no-untyped-def]
    client: TestClient = await aiohttp_client(create_app(proxy_config))
    for path in (f"{BASE}/index.json", f"{BASE}/3.2.1.json", f"{BASE}/{ZIP}",
                 "/modules/registry.terraform.io/acme/tarball/aws/1.0.0/download"):
        response = await client.get(path, headers={"Authorization": "Bearer CLIENT-TOKEN"})
        assert response.status == 200
        await response.read()
    assert registry.authorizations
    assert all(value is None for _path, value in registry.authorizations)


async def test_token_does_not_follow_a_redirect_to_another_host(
        aiohttp_client, write_config: Callable[..., Path],  # type: ignore[no-untyped-def]
        registry: FakeRegistry) -> None:
    path = write_config(upstream_extra='allowed_networks = ["127.0.0.0/8", "::1/128"]')
    config = load_config(path, environ={"TF_TOKEN_registry_terraform_io": "s3cret"})
    client: TestClient = await aiohttp_client(create_app(config))
    registry.faults.add("redirect-private")  # 127.0.0.1 -> localhost: another host
    await client.get(f"{BASE}/index.json")
    assert registry.authorizations[0] == ("/v1/providers/hashicorp/null/versions",
                                          "Bearer s3cret")
    assert registry.authorizations[1][1] is None


async def test_outbound_traffic_goes_through_https_proxy(
        aiohttp_client, proxy_config, registry: FakeRegistry,  # type: ignore[no-untyped-def]
        monkeypatch) -> None:  # type: ignore[no-untyped-def]
    tunnel = await ConnectProxy().start()
    try:
        for name in ("NO_PROXY", "no_proxy", "https_proxy", "HTTP_PROXY", "http_proxy"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("HTTPS_PROXY", f"http://127.0.0.1:{tunnel.port}")
        client: TestClient = await aiohttp_client(create_app(proxy_config))
        response = await client.get(f"{BASE}/{ZIP}")
        assert await response.read() == registry.releases[
            ("hashicorp", "null", "3.2.1")].zips["linux_amd64"]
        assert tunnel.targets and set(tunnel.targets) == {f"127.0.0.1:{registry.port}"}

        # NO_PROXY exempts hosts, as usual.
        tunnel.targets.clear()
        monkeypatch.setenv("NO_PROXY", "127.0.0.1")
        assert (await client.get("/mirror/registry.terraform.io/hashicorp/random/index.json")
                ).status == 200
        assert tunnel.targets == []
    finally:
        await tunnel.stop()
