"""The README's Troubleshooting table against the real Terraform CLI and a real proxy process:
for each failure, the message Terraform prints is the one the table names, and the proxy's log
has one WARNING naming the artifact, the reason and what to do, however often it is asked."""

from __future__ import annotations

import http.client
import re
import urllib.error
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from proxy.core.errors import (
    FilteredOut,
    HostNotServed,
    IntegrityError,
    Offline,
    Unauthorized,
    UpstreamError,
)
from tests.support.fake_registry import FakeRegistry
from tests.support.proxy_process import ProxyProcess, free_port
from tests.support.terraform import TerraformResult, terraform_env, terraform_init

pytestmark = pytest.mark.e2e

README = Path(__file__).resolve().parents[1] / "README.md"


def requiring(source: str, version: str) -> str:
    return (f'terraform {{\n  required_providers {{\n    thing = {{ source = "{source}", '
            f'version = "{version}" }}\n  }}\n}}\n')


@pytest.fixture
def start_proxy(tmp_path: Path, write_config: Callable[..., Path]) -> Iterator[
        Callable[[str], ProxyProcess]]:
    started: list[ProxyProcess] = []

    def start(upstream_extra: str = "", extra: str = "") -> ProxyProcess:
        port = free_port()
        cache = tmp_path / "cache"
        config = write_config(cache_dir=cache, port=port, upstream_extra=upstream_extra,
                              extra=extra)
        proxy = ProxyProcess(config, cache, port, tmp_path / "proxy.log")
        started.append(proxy)
        return proxy.start()

    yield start
    for proxy in started:
        proxy.stop()


def init(tmp_path: Path, proxy: ProxyProcess, root_module: str) -> TerraformResult:
    """`terraform init` in a fresh directory with the client config the proxy prints."""
    printed = proxy.cli("client-config")
    assert printed.returncode == 0, printed.stderr
    cli_config = tmp_path / "client.tfrc"
    cli_config.write_text(printed.stdout)
    workdir = tmp_path / "work"
    workdir.mkdir(exist_ok=True)
    (workdir / "main.tf").write_text(root_module)
    return terraform_init(workdir, terraform_env(tmp_path / "home", cli_config, proxy.ca_file))


def troubleshooting_rows() -> str:
    text = README.read_text()
    start = text.index("## Troubleshooting")
    return text[start:text.index("\n## ", start + 1)]


# Placeholders in the README's messages, and what they stand for in Terraform's output.
PLACEHOLDERS = {"NS": r"[\w-]+", "TYPE": r"[\w-]+", "VERSION": r"[\w.-]+",
                "HOST": r"[\w.:-]+", "PROXY": r"[\w.:-]+", "...": r".*?"}


def said(result: TerraformResult, row: str) -> None:
    """The README's troubleshooting table names row (a message, `...` and placeholders such
    as NS or VERSION in it), and Terraform's output has that message (its lines rewrapped as
    Terraform wraps them)."""
    assert f"`{row}`" in troubleshooting_rows(), row
    assert result.retcode != 0, result.output
    flat = " ".join(re.sub(r"[│╷╵]", " ", result.output).split())
    pattern = "".join(PLACEHOLDERS.get(part, re.escape(part))
                      for part in re.split(r"(\.\.\.|(?<![A-Z])(?:NS|TYPE|VERSION|HOST|PROXY)"
                                           r"(?![A-Z]))", row))
    assert re.search(pattern, flat), (pattern, result.output)


def warnings(proxy: ProxyProcess) -> list[str]:
    return [line for line in proxy.log.read_text().splitlines()
            if line.startswith("WARNING") or " WARNING " in line]


def one_warning(proxy: ProxyProcess, artifact: str, outcome: str, reason: str,
                advice: str) -> None:
    """Exactly one WARNING line about artifact: what it was answered, why, and what to do."""
    about = [line for line in warnings(proxy) if f" {artifact}: " in line]
    assert len(about) == 1, warnings(proxy)
    assert f"{artifact}: {outcome}, " in about[0]
    assert reason in about[0] and about[0].endswith(f"what to do: {advice}")


def ask_again(proxy: ProxyProcess, path: str, status: int) -> None:
    with pytest.raises(urllib.error.HTTPError) as refused:
        proxy.get(path)
    assert refused.value.code == status


def test_a_host_the_proxy_does_not_serve(tmp_path: Path, start_proxy: Callable[..., ProxyProcess],
                                         registry: FakeRegistry) -> None:
    proxy = start_proxy()
    result = init(tmp_path, proxy, requiring("evil.example.com/acme/thing", "1.0.0"))
    said(result, "provider HOST/NS/TYPE was not found in any of the search locations")
    assert "evil.example.com/acme/thing" in result.output
    ask_again(proxy, "mirror/evil.example.com/acme/thing/index.json", 404)
    one_warning(proxy, "provider evil.example.com/acme/thing", "answered 404",
                "host evil.example.com is not served by this proxy", HostNotServed.advice)


def test_an_offline_miss(tmp_path: Path, start_proxy: Callable[..., ProxyProcess],
                         registry: FakeRegistry) -> None:
    proxy = start_proxy('mode = "offline"')
    result = init(tmp_path, proxy, requiring("hashicorp/null", "3.2.1"))
    said(result, "provider HOST/NS/TYPE was not found in any of the search locations")
    ask_again(proxy, "mirror/registry.terraform.io/hashicorp/null/index.json", 404)
    one_warning(proxy, "provider registry.terraform.io/hashicorp/null", "answered 404",
                "the proxy is offline", Offline.advice)
    assert registry.requests == []


def test_a_version_upstream_does_not_have(tmp_path: Path,
                                          start_proxy: Callable[..., ProxyProcess],
                                          registry: FakeRegistry) -> None:
    """Terraform picks versions from the list itself: the proxy answered the list, so it has
    nothing to warn about; the table says where to look instead."""
    proxy = start_proxy()
    result = init(tmp_path, proxy, requiring("hashicorp/null", "9.9.9"))
    said(result, "no available releases match the given constraints")
    assert warnings(proxy) == []


def test_upstream_down_on_a_miss(tmp_path: Path, start_proxy: Callable[..., ProxyProcess],
                                 registry: FakeRegistry) -> None:
    proxy = start_proxy()
    registry.faults.add("down")
    result = init(tmp_path, proxy, requiring("hashicorp/null", "3.2.1"))
    # Terraform asked twice (it retries a 5xx): still one line.
    said(result, "the request failed after 2 attempts, please try again later: 502 Bad "
                 "Gateway")
    ask_again(proxy, "mirror/registry.terraform.io/hashicorp/null/index.json", 502)
    one_warning(proxy, "provider registry.terraform.io/hashicorp/null", "answered 502",
                "upstream registry.terraform.io answered 503", UpstreamError.advice)


def test_a_package_that_fails_verification(tmp_path: Path,
                                           start_proxy: Callable[..., ProxyProcess],
                                           registry: FakeRegistry) -> None:
    """The archive streams to Terraform as it arrives; when its bytes do not match the
    signed checksum the connection is cut, so that Terraform cannot take it as whole."""
    proxy = start_proxy()
    registry.faults.add("corrupt")
    result = init(tmp_path, proxy, requiring("hashicorp/null", "3.2.1"))
    said(result, "Error while installing NS/TYPE vVERSION: ... connection reset by peer")
    zip_path = ("mirror/registry.terraform.io/hashicorp/null/"
                "terraform-provider-null_3.2.1_linux_amd64.zip")
    with pytest.raises((OSError, http.client.HTTPException)):  # the same again: cut off
        proxy.get(zip_path)
    one_warning(proxy, "provider registry.terraform.io/hashicorp/null 3.2.1 linux_amd64",
                "cut off mid-download", "does not match the signed checksum",
                IntegrityError.advice)
    assert "cut off mid-body" not in proxy.log.read_text()  # explained once, not twice


def test_a_client_without_a_token(tmp_path: Path, start_proxy: Callable[..., ProxyProcess],
                                  registry: FakeRegistry) -> None:
    proxy = start_proxy(extra='[auth]\ntokens = ["a-troubleshooting-token-0123456789"]\n')
    result = init(tmp_path, proxy, requiring("hashicorp/null", "3.2.1"))
    said(result, "host PROXY rejected the given authentication credentials")
    one_warning(proxy, "provider registry.terraform.io/hashicorp/null", "answered 401",
                "a bearer token is required", Unauthorized.advice)


def test_a_platform_the_filters_leave_out(tmp_path: Path,
                                          start_proxy: Callable[..., ProxyProcess],
                                          registry: FakeRegistry) -> None:
    """The version document lists the platforms served: Terraform finds its own missing."""
    proxy = start_proxy(extra='[filters]\nplatforms = ["darwin_*"]\n')
    result = init(tmp_path, proxy, requiring("hashicorp/null", "3.2.1"))
    said(result, "Provider HOST/NS/TYPE vVERSION does not have a package available for your "
                 "current platform")
    ask_again(proxy, "mirror/registry.terraform.io/hashicorp/null/"
                     "terraform-provider-null_3.2.1_linux_amd64.zip", 404)
    one_warning(proxy, "provider registry.terraform.io/hashicorp/null 3.2.1 linux_amd64",
                "answered 404", "linux_amd64 packages are not served by this proxy (filters)",
                FilteredOut.advice)


def test_an_offline_module_miss(tmp_path: Path, start_proxy: Callable[..., ProxyProcess],
                                registry: FakeRegistry) -> None:
    proxy = start_proxy('mode = "offline"')
    result = init(tmp_path, proxy, 'module "net" {\n  source  = "acme/net/aws"\n'
                                   '  version = "1.2.0"\n}\n')
    said(result, "Module not found")
    one_warning(proxy, "module registry.terraform.io/acme/net/aws", "answered 404",
                "offline", Offline.advice)
