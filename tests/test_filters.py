"""Optional filters: which providers, modules and platforms are served."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from aiohttp.test_utils import TestClient

from proxy.app import create_app
from proxy.config import FiltersConfig, load_config
from proxy.config.filters import Filters
from proxy.core.models import ModuleAddress, Platform, ProviderAddress
from tests.support.fake_registry import FakeRegistry
from tests.support.mirror_paths import BASE


def test_filters_allow_and_exclude_by_pattern() -> None:
    filters = Filters(FiltersConfig(
        providers=("hashicorp/*", "registry.opentofu.org/acme/*"),
        exclude_providers=("*/random",), modules=("acme/*/aws",),
        exclude_modules=("registry.terraform.io/acme/evil/*",),
        platforms=("linux_*", "darwin_arm64")))
    provider = ProviderAddress.parse
    assert filters.provider_allowed(provider("registry.terraform.io", "hashicorp", "null"))
    assert not filters.provider_allowed(provider("registry.terraform.io", "hashicorp",
                                                 "random"))
    assert not filters.provider_allowed(provider("registry.terraform.io", "acme", "x"))
    assert filters.provider_allowed(provider("registry.opentofu.org", "acme", "x"))
    assert filters.module_allowed(ModuleAddress.parse("registry.terraform.io", "Acme", "Net",
                                                      "aws"))
    assert not filters.module_allowed(ModuleAddress.parse("registry.terraform.io", "acme",
                                                          "evil", "aws"))
    assert filters.platform_allowed(Platform("linux", "arm64"))
    assert not filters.platform_allowed(Platform("windows", "amd64"))
    everything = Filters()
    assert everything.platform_allowed(Platform("plan9", "386"))


async def test_filters_in_the_app(aiohttp_client, write_config: Callable[..., Path],  # type: ignore[no-untyped-def]
                                  registry: FakeRegistry) -> None:
    path = write_config(extra='''
[filters]
exclude_providers = ["hashicorp/random"]
exclude_modules = ["acme/net/*"]
platforms = ["linux_amd64", "darwin_*"]
''')
    client: TestClient = await aiohttp_client(create_app(load_config(path, environ={})))
    body = await (await client.get(f"{BASE}/3.2.1.json")).json()
    assert sorted(body["archives"]) == ["darwin_arm64", "linux_amd64"]
    windows = await client.get(f"{BASE}/terraform-provider-null_3.2.1_windows_amd64.zip")
    assert windows.status == 404
    registry.requests.clear()
    for path in ("/mirror/registry.terraform.io/hashicorp/random/index.json",
                 "/modules/registry.terraform.io/acme/net/aws/versions"):
        response = await client.get(path)
        assert response.status == 404
        assert "filters" in (await response.json())["errors"][0]
    assert registry.requests == []
    assert not any("windows" in p for p in registry.paths())
