"""Credentials for upstream registries: from the config or TF_TOKEN_*, sent only where the
registry protocol sends them, and never a client's."""

from __future__ import annotations

import base64
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from aiohttp.test_utils import TestClient

from proxy.app import create_app
from proxy.config import Secret, load_config
from tests.support.connect_proxy import ConnectProxy, use_https_proxy
from tests.support.fake_registry import FakeRegistry
from tests.support.mirror_paths import BASE, ZIP

MODULES = "/modules/registry.terraform.io/acme"


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


# --- ~/.netrc is never a source of credentials ---------------------------------------------

@pytest.fixture
def netrc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An operator's netrc ($NETRC) with entries for every host the fake upstream plays (and
    the outbound proxy, on 127.0.0.1), and a default entry."""
    path = tmp_path / "netrc"
    path.write_text("machine 127.0.0.1 login ci password host-secret\n"
                    "machine localhost login ci password host-secret\n"
                    "default login ci password default-secret\n")
    path.chmod(0o600)
    monkeypatch.setenv("NETRC", str(path))
    return path


async def test_netrc_credentials_are_never_sent_upstream(
        aiohttp_client, write_config: Callable[..., Path],  # type: ignore[no-untyped-def]
        registry: FakeRegistry, netrc: Path) -> None:
    path = write_config(upstream_extra='allowed_networks = ["127.0.0.0/8", "::1/128"]')
    client: TestClient = await aiohttp_client(create_app(load_config(path, environ={})))
    response = await client.get(f"{BASE}/{ZIP}")
    assert response.status == 200
    await response.read()
    download = await client.get(f"{MODULES}/tarball/aws/1.0.0/download")
    archive = await client.get(urlsplit((await download.json())["location"]).path)
    assert archive.status == 200
    await archive.read()
    registry.faults.add("redirect-private")  # upstream names another host: localhost
    await client.get("/mirror/registry.terraform.io/hashicorp/random/index.json")
    paths = [p for p, _value in registry.authorizations]
    assert f"/files/hashicorp/null/3.2.1/{ZIP}" in paths
    assert "/archives/tarball-1.0.0.tgz" in paths
    assert paths.count("/v1/providers/hashicorp/random/versions") > 1  # after a redirect too
    assert [(p, v) for p, v in registry.authorizations if v is not None] == []


async def test_netrc_does_not_get_in_the_way_of_a_token(
        aiohttp_client, write_config: Callable[..., Path],  # type: ignore[no-untyped-def]
        registry: FakeRegistry, netrc: Path) -> None:
    config = load_config(write_config(), environ={"TF_TOKEN_registry_terraform_io": "s3cret"})
    client: TestClient = await aiohttp_client(create_app(config))
    response = await client.get(f"{BASE}/index.json")
    assert response.status == 200, await response.text()
    assert registry.authorizations == [("/v1/providers/hashicorp/null/versions",
                                        "Bearer s3cret")]


async def test_https_proxy_credentials_come_from_its_url_only(
        aiohttp_client, proxy_config, registry: FakeRegistry,  # type: ignore[no-untyped-def]
        monkeypatch: pytest.MonkeyPatch, netrc: Path) -> None:
    tunnel = await ConnectProxy().start()
    try:
        use_https_proxy(monkeypatch, tunnel)
        client: TestClient = await aiohttp_client(create_app(proxy_config))
        assert (await client.get(f"{BASE}/index.json")).status == 200
        download = await client.get(f"{MODULES}/net/aws/1.2.0/download")  # git, via the gate
        archive = await client.get(urlsplit((await download.json())["location"]).path)
        assert archive.status == 200, await archive.text()
        assert len(tunnel.targets) >= 2
        assert set(tunnel.authorizations) == {None}  # netrc's entries stay home

        tunnel.targets.clear()
        tunnel.authorizations.clear()
        monkeypatch.setenv("HTTPS_PROXY", f"http://squid-user:squid%20pass@127.0.0.1:{tunnel.port}")
        assert (await client.get("/mirror/registry.terraform.io/hashicorp/random/index.json")
                ).status == 200
        download = await client.get(f"{MODULES}/relative/aws/1.0.0/download")
        archive = await client.get(urlsplit((await download.json())["location"]).path)
        assert archive.status == 200, await archive.text()
        expected = "Basic " + base64.b64encode(b"squid-user:squid pass").decode()
        assert len(tunnel.targets) >= 2
        assert set(tunnel.authorizations) == {expected}
    finally:
        await tunnel.stop()


async def test_credentials_in_a_service_url_win_over_the_hosts_token(
        aiohttp_client, write_config: Callable[..., Path],  # type: ignore[no-untyped-def]
        registry: FakeRegistry) -> None:
    # Both at once made aiohttp raise ValueError, which reached the client as a 500.
    extra = f"""
[upstream.hosts."private.example.com"]
token = "host-token"
[upstream.hosts."private.example.com".services]
"providers.v1" = "https://svc:url-password@127.0.0.1:{registry.port}/v1/providers/"
"""
    client: TestClient = await aiohttp_client(create_app(load_config(write_config(extra=extra),
                                                                     environ={})))
    response = await client.get("/mirror/private.example.com/hashicorp/null/index.json")
    assert response.status == 200, await response.text()
    basic = "Basic " + base64.b64encode(b"svc:url-password").decode()
    assert registry.authorizations[0] == ("/v1/providers/hashicorp/null/versions", basic)
