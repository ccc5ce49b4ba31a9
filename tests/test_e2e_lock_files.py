"""Lock files identical to a direct install: the real Terraform CLI through the proxy's
provider registry protocol (`client-config --mode registry`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.fake_registry import FakeRegistry
from tests.support.proxy_process import ProxyProcess, free_port
from tests.support.terraform import lock_file_hashes, terraform_env, terraform_init

pytestmark = pytest.mark.e2e

ROOT_MODULE = """
terraform {
  required_providers {
    null   = { source = "hashicorp/null", version = "3.2.1" }
    random = { source = "hashicorp/random", version = "3.6.0" }
  }
}
"""


@pytest.fixture
def proxy(tmp_path: Path, write_config: Callable[..., Path]) -> Iterator[ProxyProcess]:
    port = free_port()
    cache = tmp_path / "cache"
    with ProxyProcess(write_config(cache_dir=cache, port=port), cache, port,
                      tmp_path / "proxy.log") as running:
        yield running


def workdir(tmp_path: Path, name: str, lock: Path | None = None) -> Path:
    path = tmp_path / name
    path.mkdir()
    (path / "main.tf").write_text(ROOT_MODULE)
    if lock is not None:
        (path / ".terraform.lock.hcl").write_text(lock.read_text())
    return path


def proxy_env(tmp_path: Path, proxy: ProxyProcess, mode: str, name: str) -> dict[str, str]:
    printed = proxy.cli("client-config", "--mode", mode)
    assert printed.returncode == 0, printed.stderr
    config = tmp_path / f"{name}.tfrc"
    config.write_text(printed.stdout)
    return terraform_env(tmp_path / f"{name}-home", config, proxy.ca_file)


def test_registry_mode_lock_file_equals_a_direct_install(
        tmp_path: Path, proxy: ProxyProcess, registry: FakeRegistry,
        upstream_ca_file: Path) -> None:
    # A direct install from the upstream registry, for reference.
    direct_config = tmp_path / "direct.tfrc"
    direct_config.write_text(f'host "registry.terraform.io" {{\n  services = {{\n'
                             f'    "providers.v1" = "{registry.providers_url}"\n  }}\n}}\n')
    direct = workdir(tmp_path, "direct")
    result = terraform_init(direct, terraform_env(tmp_path / "direct-home", direct_config,
                                                  upstream_ca_file))
    assert result.retcode == 0, result.output
    expected = lock_file_hashes(direct)
    assert all(any(h.startswith("zh:") for h in hashes) for hashes in expected.values())

    through = workdir(tmp_path, "through")
    result = terraform_init(through, proxy_env(tmp_path, proxy, "registry", "registry"))
    assert result.retcode == 0, result.output
    assert "Installed hashicorp/null v3.2.1 (self-signed" in result.stdout  # checked by the CLI
    assert "Incomplete lock file information" not in result.output
    locked = lock_file_hashes(through)
    assert {k: sorted(v) for k, v in locked.items()} == \
        {k: sorted(v) for k, v in expected.items()}
    release = registry.releases[("hashicorp", "null", "3.2.1")]
    for platform in release.platforms:  # zh: of every platform, as a direct install has
        assert f"zh:{release.sha256(platform)}" in locked["registry.terraform.io/hashicorp/null"]

    # The lock file works in mirror mode, and with the upstream down, unchanged.
    registry.faults.add("down")
    lock = through / ".terraform.lock.hcl"
    for mode in ("mirror", "registry"):
        again = workdir(tmp_path, f"again-{mode}", lock)
        result = terraform_init(again, proxy_env(tmp_path, proxy, mode, f"again-{mode}"))
        assert result.retcode == 0, (mode, result.output)
        assert (again / ".terraform.lock.hcl").read_text() == lock.read_text(), mode


def test_mirror_mode_lock_file_is_kept_and_completed_in_registry_mode(
        tmp_path: Path, proxy: ProxyProcess, registry: FakeRegistry) -> None:
    first = workdir(tmp_path, "mirror")
    result = terraform_init(first, proxy_env(tmp_path, proxy, "mirror", "mirror"))
    assert result.retcode == 0, result.output
    lock = first / ".terraform.lock.hcl"
    second = workdir(tmp_path, "registry", lock)
    result = terraform_init(second, proxy_env(tmp_path, proxy, "registry", "registry"))
    assert result.retcode == 0, result.output
    # The registry install adds the other platforms' zh: hashes, keeping the h1: it had.
    before, after = lock_file_hashes(first), lock_file_hashes(second)
    assert "registry.terraform.io/hashicorp/null" in before, before  # else the loop checks nothing
    for provider, hashes in before.items():
        assert set(hashes) <= set(after[provider])
        assert any(h.startswith("zh:") for h in after[provider])
