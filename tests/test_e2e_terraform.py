"""End to end: the real Terraform CLI installs providers through a real proxy process."""

from __future__ import annotations

import hashlib
import json
import ssl
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.fake_registry import FakeRegistry
from tests.support.proxy_process import ProxyProcess, free_port
from tests.support.terraform import NULL_AND_RANDOM, lock_file_hashes, terraform_env, terraform_init

pytestmark = pytest.mark.e2e

ROOT_MODULE = NULL_AND_RANDOM


@pytest.fixture
def proxy(tmp_path: Path, write_config: Callable[..., Path]) -> Iterator[ProxyProcess]:
    port = free_port()
    cache = tmp_path / "cache"
    config = write_config(cache_dir=cache, port=port)
    with ProxyProcess(config, cache, port, tmp_path / "proxy.log") as running:
        yield running


def client_setup(tmp_path: Path, proxy: ProxyProcess, name: str,
                 root_module: str = ROOT_MODULE) -> tuple[Path, dict[str, str]]:
    """A fresh working directory and environment using the printed client config."""
    printed = proxy.cli("client-config")
    assert printed.returncode == 0, printed.stderr
    assert f" {proxy.ca_file} > " in printed.stdout
    cli_config = tmp_path / f"{name}.tfrc"
    cli_config.write_text(printed.stdout)
    workdir = tmp_path / name
    workdir.mkdir()
    (workdir / "main.tf").write_text(root_module)
    return workdir, terraform_env(tmp_path / f"{name}-home", cli_config, proxy.ca_file)


def installed_binary(workdir: Path, type_: str, version: str) -> bytes:
    path = (workdir / ".terraform/providers/registry.terraform.io/hashicorp" / type_ / version
            / "linux_amd64" / f"terraform-provider-{type_}_v{version}")
    return path.read_bytes()


def test_terraform_init_through_the_proxy(tmp_path: Path, proxy: ProxyProcess,
                                          registry: FakeRegistry) -> None:
    workdir, env = client_setup(tmp_path, proxy, "first")
    result = terraform_init(workdir, env)
    assert result.retcode == 0, result.output
    # A CLI config that fails to parse is only a warning: the sole warning allowed is the
    # mirror's expected one about lock file checksums for other platforms.
    warnings = [line for line in result.output.splitlines() if line.startswith("Warning:")]
    assert warnings == ["Warning: Incomplete lock file information for providers"]
    assert "Installed hashicorp/null v3.2.1 (verified checksum)" in result.stdout
    assert "Installed hashicorp/random v3.6.0 (verified checksum)" in result.stdout

    null = registry.releases[("hashicorp", "null", "3.2.1")]
    random = registry.releases[("hashicorp", "random", "3.6.0")]
    assert installed_binary(workdir, "null", "3.2.1") == null.binaries["linux_amd64"]
    assert installed_binary(workdir, "random", "3.6.0") == random.binaries["linux_amd64"]
    assert sorted(registry.archive_requests()) == sorted([
        "/files/hashicorp/null/3.2.1/terraform-provider-null_3.2.1_linux_amd64.zip",
        "/files/hashicorp/random/3.6.0/terraform-provider-random_3.6.0_linux_amd64.zip"])

    # The h1: Terraform computed itself is the one the proxy publishes for that zip.
    context = ssl.create_default_context(cafile=str(proxy.ca_file))
    url = f"{proxy.url}mirror/registry.terraform.io/hashicorp/null/3.2.1.json"
    with urllib.request.urlopen(url, context=context) as response:
        published = json.load(response)["archives"]["linux_amd64"]["hashes"]
    locked = lock_file_hashes(workdir)["registry.terraform.io/hashicorp/null"]
    assert locked[0] in published
    assert f"zh:{hashlib.sha256(null.zips['linux_amd64']).hexdigest()}" in published

    # A second client in a fresh directory: served from the cache, no upstream package request.
    registry.requests.clear()
    second, env2 = client_setup(tmp_path, proxy, "second")
    result = terraform_init(second, env2)
    assert result.retcode == 0, result.output
    assert installed_binary(second, "null", "3.2.1") == null.binaries["linux_amd64"]
    assert registry.archive_requests() == []


def test_terraform_init_fails_cleanly_on_a_bad_signature(tmp_path: Path, proxy: ProxyProcess,
                                                         registry: FakeRegistry) -> None:
    registry.faults.add("badsig")
    workdir, env = client_setup(tmp_path, proxy, "badsig")
    result = terraform_init(workdir, env)
    assert result.retcode != 0
    assert "502 Bad Gateway" in result.output  # Terraform does not show the JSON error body
    assert "integrity failure (signature)" in proxy.log.read_text()
    assert registry.archive_requests() == []
    assert not (workdir / ".terraform/providers").exists() or not any(
        (workdir / ".terraform/providers").rglob("terraform-provider-*"))


MODULE_ROOT = """
terraform {
  required_providers {
    null = { source = "hashicorp/null", version = "3.2.1" }
  }
}

module "net" {
  source  = "acme/net/aws"
  version = "1.2.0"
}

module "tarball" {
  source  = "registry.terraform.io/acme/tarball/aws"
  version = "~> 1.0"
}
"""


def test_terraform_installs_registry_modules_through_the_proxy_and_offline(
        tmp_path: Path, proxy: ProxyProcess, registry: FakeRegistry) -> None:
    root = MODULE_ROOT + f"""
module "direct" {{
  source  = "127.0.0.1:{proxy.port}/acme/tarball/aws"
  version = "1.0.0"
}}
"""
    workdir, env = client_setup(tmp_path, proxy, "modules", root)
    result = terraform_init(workdir, env)
    assert result.retcode == 0, result.output
    installed = workdir / ".terraform/modules"
    manifest = json.loads((installed / "modules.json").read_text())
    versions = {m["Key"]: m.get("Version") for m in manifest["Modules"] if m["Key"]}
    # "direct" is addressed to the proxy's own host: our discovery document sent Terraform
    # to the default upstream host's modules.
    assert versions == {"net": "1.2.0", "tarball": "1.0.0", "direct": "1.0.0"}
    assert b'default = "net"' in (installed / "net/main.tf").read_bytes()
    assert (installed / "net/shared/main.tf").exists()       # the git submodule
    assert (installed / "net/modules/sub/main.tf").exists()
    assert not (installed / "net/.git").exists()
    assert (installed / "tarball/main.tf").exists()          # the //*/modules/inner subdir
    assert any(p.startswith("/git/net.git/") for p in registry.paths())
    # Upstream registry and git server gone: a fresh directory still initializes, so every
    # byte came from the proxy.
    registry.requests.clear()
    registry.faults.add("down")
    again, env2 = client_setup(tmp_path, proxy, "modules-offline", MODULE_ROOT)
    result = terraform_init(again, env2)
    assert result.retcode == 0, result.output
    assert (again / ".terraform/modules/net/shared/main.tf").exists()
    assert registry.requests == []


SLOW_MODULE_ROOT = """
module "net" {
  source  = "acme/net/aws"
  version = "1.2.0"
}
"""


def test_terraform_init_succeeds_first_time_with_a_module_source_slower_than_its_timeout(
        tmp_path: Path, proxy: ProxyProcess, registry: FakeRegistry) -> None:
    # Terraform gives each registry request (the module's `download`) 10 s and one retry
    # (TF_REGISTRY_CLIENT_TIMEOUT, TF_REGISTRY_DISCOVERY_RETRY; 0 retries means the default).
    # The limit is shortened to 4 s here so that both attempts end (by about 9 s) well before
    # the 12 s clone does: otherwise the retry could find the clone done and hide the bug.
    delay = 12.0
    registry.slow_paths["/git/net.git/info/refs"] = delay
    workdir, env = client_setup(tmp_path, proxy, "slow", SLOW_MODULE_ROOT)
    env["TF_REGISTRY_CLIENT_TIMEOUT"] = "4"
    started = time.monotonic()
    result = terraform_init(workdir, env)
    assert result.retcode == 0, result.output
    assert time.monotonic() - started >= delay  # the source really was that slow
    installed = workdir / ".terraform/modules/net"
    assert b'default = "net"' in (installed / "main.tf").read_bytes()
    assert (installed / "shared/main.tf").exists()
    assert registry.paths().count("/git/net.git/info/refs") == 1
    assert registry.paths().count("/v1/modules/acme/net/aws/1.2.0/download") == 1


def test_terraform_through_a_proxy_that_requires_a_token(
        tmp_path: Path, write_config: Callable[..., Path], registry: FakeRegistry) -> None:
    token = "e2e-client-token-0123456789"
    port = free_port()
    cache = tmp_path / "cache"
    config = write_config(cache_dir=cache, port=port, extra=f'[auth]\ntokens = ["{token}"]\n')
    with ProxyProcess(config, cache, port, tmp_path / "proxy.log") as proxy:
        denied, env = client_setup(tmp_path, proxy, "denied", MODULE_ROOT)
        result = terraform_init(denied, env)
        assert result.retcode != 0
        assert "401" in result.output or "Unauthorized" in result.output

        workdir, env = client_setup(tmp_path, proxy, "allowed", MODULE_ROOT)
        cli_config = Path(env["TF_CLI_CONFIG_FILE"])
        cli_config.write_text(cli_config.read_text().replace("REPLACE-WITH-YOUR-TOKEN", token))
        result = terraform_init(workdir, env)
        assert result.retcode == 0, result.output
        assert (workdir / ".terraform/modules/tarball/main.tf").exists()
        assert (workdir / ".terraform/modules/net/shared/main.tf").exists()
